"""the self-distillation family: per-token credits, per-episode log-ratios, top-k per position

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27

Why: a ``log-ratio`` credit run (``credits compute --variant log-ratio``, docs/FAMILY.md)
credits every token, not only every step: ``token_credits`` holds, per (run, step), the
per-token log-ratio log π_teacher − log π_student and the per-token advantage handed to
trainers (little-endian float32 blobs, one value per scored token, in the scored order).
``episode_log_ratios`` sums a log-ratio run's per-step means back to the episode (the
sequence-level log-ratio and its per-token mean). ``topk_scores`` holds, per (step, scorer),
the K most likely ids and their logprobs at every scored position (``score --top-k K``):
int32 ids and float16 logprobs, position-major (token_count × K values each).

Frozen history: nothing here reads the models.
"""

from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

EPISODE_LOG_RATIOS = """
CREATE VIEW episode_log_ratios AS
SELECT r.name AS run, r.id AS run_id, e.id AS episode_id, e.name AS episode, e.reward,
       COUNT(*) AS steps, SUM(c.token_count) AS tokens,
       SUM(c.q_h * c.token_count) AS log_ratio_sum,
       SUM(c.q_h * c.token_count) / SUM(c.token_count) AS log_ratio_mean
FROM credits c
JOIN credit_runs r ON r.id = c.run_id
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
WHERE r.variant = 'log-ratio'
GROUP BY r.name, r.id, e.id, e.name, e.reward
"""


def upgrade() -> None:
    op.create_table(
        "token_credits",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("log_ratios", sa.LargeBinary(), nullable=False),
        sa.Column("advantages", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["credit_runs.id"], name=op.f("fk_token_credits_run_id_credit_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["step_id"], ["steps.id"], name=op.f("fk_token_credits_step_id_steps"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step_id", name=op.f("pk_token_credits")),
    )
    op.create_table(
        "topk_scores",
        sa.Column("step_id", sa.Integer(), nullable=False),
        sa.Column("scorer_id", sa.String(length=64), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("ids", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["step_id"], ["steps.id"], name=op.f("fk_topk_scores_step_id_steps"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["scorer_id"], ["scorers.id"], name=op.f("fk_topk_scores_scorer_id_scorers"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("scorer_id", "step_id", name=op.f("pk_topk_scores")),
    )
    op.execute(EPISODE_LOG_RATIOS)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS episode_log_ratios")
    op.drop_table("topk_scores")
    op.drop_table("token_credits")
