"""credit signal: each credit run records whether the hindsight term is in its advantages

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27

Why: on outcome-only rollouts a run with dense returns gives a zero hindsight term on every
step, and its advantages are GRPO's group term alone, silently. ``credit_runs.signal`` keeps,
per run, the JSON of ``credits/signal.py``'s ``CreditSignal`` (steps, steps whose hindsight
term is non-zero, episodes whose advantages vary, the mean spread within an episode, and the
note of a choice the run made itself). Runs computed before this revision keep NULL: their
signal is measured from their stored credits when it is read.

Frozen history: nothing here reads the models; the view texts are copied as they are at this
revision (the downgrade drops and restores them around the column's removal).
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


STEP_CREDITS_0007 = """
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
    op.add_column('credit_runs', sa.Column('signal', sa.Text(), nullable=True))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN in place (SQLite >= 3.35, PostgreSQL): a batch copy of credit_runs
    # would drop the old table, and its ON DELETE CASCADE would take every credit with it
    op.execute("DROP VIEW IF EXISTS subtask_credits")
    op.execute("DROP VIEW IF EXISTS step_credits")
    op.execute("ALTER TABLE credit_runs DROP COLUMN signal")
    op.execute(STEP_CREDITS_0007)
    op.execute(SUBTASK_CREDITS)
