"""batches: the change feed of `follow`, and credit runs over a set of episodes

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25

Why: online, `follow` publishes a credit run per batch (a GRPO group: the episodes sharing a
key) as soon as the batch is complete. ``batches`` is that feed: one row per published batch
(key, counts, scorer, credit run, weight version, when it was complete and when its credits
were ready, ``superseded_by`` when a changed episode republished it); ``batch_episodes``
lists its episode versions. A batch's credit run covers only its episodes:
``credit_runs.episode_scope`` holds their ids (JSON; NULL for a run over every complete
episode, as before), so its staleness looks at those episodes alone.

Frozen history: nothing here reads the models.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

STEP_CREDITS_0003 = """
CREATE VIEW step_credits AS
SELECT r.name AS run, r.id AS run_id, r.scorer_id, r.variant, e.id AS episode_id, e.name AS episode,
       e.source_key AS episode_key, e.external_id, e.reward, s.id AS step_id, s.step_index,
       s.message_index, s.phase, s.subtask_id, s.subtask_reward, c.mean_logprob,
       c.token_count, c.pi_hind, c.rho_raw, c.rho, c.r_t, c.discount, c.q_h, c.q_h_smoothed,
       c.a_macro, c.micro, c.advantage
FROM credits c
JOIN credit_runs r ON r.id = c.run_id
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
"""

SUBTASK_CREDITS = """
CREATE VIEW subtask_credits AS
SELECT run, episode_id, episode, COALESCE(subtask_id, phase) AS subtask,
       MIN(step_index) AS first_step, COUNT(*) AS steps, MAX(subtask_reward) AS subtask_reward,
       AVG(mean_logprob) AS mean_logprob, AVG(pi_hind) AS pi_hind, AVG(rho) AS rho,
       AVG(q_h) AS q_h, AVG(q_h_smoothed) AS q_h_smoothed
FROM step_credits
GROUP BY run, episode_id, episode, COALESCE(subtask_id, phase)
"""


def upgrade() -> None:
    op.add_column('credit_runs', sa.Column('episode_scope', sa.Text(), nullable=True))
    op.create_table(
        'batches',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('key', sa.String(length=500), nullable=False),
        sa.Column('batch_hash', sa.String(length=64), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('episodes', sa.Integer(), nullable=False),
        sa.Column('steps', sa.Integer(), nullable=False),
        sa.Column('scored', sa.Integer(), nullable=False),
        sa.Column('failed', sa.Integer(), nullable=False),
        sa.Column('failed_episodes', sa.Text(), nullable=True),
        sa.Column('scorer_id', sa.String(length=64), sa.ForeignKey('scorers.id', ondelete='CASCADE'), nullable=False),
        sa.Column('credit_run_id', sa.Integer(), sa.ForeignKey('credit_runs.id', ondelete='SET NULL'), nullable=True),
        sa.Column('credit_run', sa.String(length=200), nullable=True),
        sa.Column('weight_version', sa.String(length=200), nullable=True),
        sa.Column('complete_at', sa.String(length=40), nullable=False),
        sa.Column('ready_at', sa.String(length=40), nullable=False),
        sa.Column('lag_s', sa.Float(), nullable=True),
        sa.Column('superseded_by', sa.Integer(), nullable=True),
        sa.UniqueConstraint('batch_hash', name='uq_batches_batch_hash'),
    )
    op.create_index('ix_batches_key', 'batches', ['key'])
    op.create_table(
        'batch_episodes',
        sa.Column('batch_id', sa.Integer(), sa.ForeignKey('batches.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('episode_id', sa.Integer(), sa.ForeignKey('episodes.id', ondelete='CASCADE'), primary_key=True),
    )


def downgrade() -> None:
    op.drop_table('batch_episodes')
    op.drop_index('ix_batches_key', table_name='batches')
    op.drop_table('batches')
    op.execute("DROP VIEW IF EXISTS subtask_credits")
    op.execute("DROP VIEW IF EXISTS step_credits")
    with op.batch_alter_table('credit_runs', schema=None) as batch_op:
        batch_op.drop_column('episode_scope')
    op.execute(STEP_CREDITS_0003)
    op.execute(SUBTASK_CREDITS)
