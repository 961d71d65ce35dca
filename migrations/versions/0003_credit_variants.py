"""credit variants and stored advantages

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25

Why: a credit run can now follow the paper's estimator (``variant = 'paper'``: per-group
statistics, one-step smoothing, signed advantages) as well as the original scripts'
(``'original'``, the default). The advantage becomes part of the run: each credit keeps
its macro term (``a_macro``, GRPO A_i), its micro term (``micro``, after do-no-harm) and
the ``advantage`` a trainer receives (for ``original``, the Eq. 8 weight the default
export writes). Runs computed before this revision read as ``original`` and keep NULL in
the three columns; exports compute their weights as before. ``step_credits`` shows the
new columns (``variant``, ``a_macro``, ``micro``, ``advantage``); ``subtask_credits`` is
recreated unchanged because it reads ``step_credits``.

Frozen history: the view texts are copied here as they are at this revision.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

STEP_CREDITS = """
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

STEP_CREDITS_0001 = """
CREATE VIEW step_credits AS
SELECT r.name AS run, r.id AS run_id, r.scorer_id, e.id AS episode_id, e.name AS episode,
       e.source_key AS episode_key, e.external_id, e.reward, s.id AS step_id, s.step_index,
       s.message_index, s.phase, s.subtask_id, s.subtask_reward, c.mean_logprob,
       c.token_count, c.pi_hind, c.rho_raw, c.rho, c.r_t, c.discount, c.q_h, c.q_h_smoothed
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


def _drop_views() -> None:
    op.execute("DROP VIEW IF EXISTS subtask_credits")
    op.execute("DROP VIEW IF EXISTS step_credits")


def upgrade() -> None:
    _drop_views()
    with op.batch_alter_table('credit_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('variant', sa.String(length=16), nullable=False, server_default='original'))
    with op.batch_alter_table('credits', schema=None) as batch_op:
        batch_op.add_column(sa.Column('a_macro', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('micro', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('advantage', sa.Float(), nullable=True))
    op.execute(STEP_CREDITS)
    op.execute(SUBTASK_CREDITS)


def downgrade() -> None:
    _drop_views()
    with op.batch_alter_table('credits', schema=None) as batch_op:
        batch_op.drop_column('advantage')
        batch_op.drop_column('micro')
        batch_op.drop_column('a_macro')
    with op.batch_alter_table('credit_runs', schema=None) as batch_op:
        batch_op.drop_column('variant')
    op.execute(STEP_CREDITS_0001)
    op.execute(SUBTASK_CREDITS)
