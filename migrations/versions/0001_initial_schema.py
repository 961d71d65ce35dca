"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-21

Why: the first schema. Episodes (versioned by content hash, raw source kept), their
converted messages, steps and plan subtasks; the scoring queue (attempts with leases,
attempt_errors), scores (per-token float32 logprobs), scorers and workers; credit runs
and credits; and the views people query (step_scores, step_credits, subtask_credits).
Later revisions add only real changes.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


# Views are plain SQL that both SQLite and PostgreSQL accept. Frozen here: a later
# change to a view is a new revision that drops and recreates it.
VIEWS = {
    "step_scores": """
CREATE VIEW step_scores AS
SELECT sc.scorer_id, e.id AS episode_id, e.name AS episode, e.source_key AS episode_key,
       e.reward, s.id AS step_id, s.step_index, s.message_index, s.phase, s.subtask_id,
       s.subtask_reward, sc.mean_logprob, sc.token_count, sc.total_action_tokens,
       sc.skipped_action_tokens, sc.truncated_prefix_tokens, sc.input_tokens,
       sc.prompt_tokens, sc.cached_tokens, sc.latency_s, sc.flattened
FROM scores sc
JOIN steps s ON s.id = sc.step_id
JOIN episodes e ON e.id = s.episode_id
WHERE e.is_current
""",
    "step_credits": """
CREATE VIEW step_credits AS
SELECT r.name AS run, r.id AS run_id, r.scorer_id, e.id AS episode_id, e.name AS episode,
       e.source_key AS episode_key, e.external_id, e.reward, s.id AS step_id, s.step_index,
       s.message_index, s.phase, s.subtask_id, s.subtask_reward, c.mean_logprob,
       c.token_count, c.pi_hind, c.rho_raw, c.rho, c.r_t, c.discount, c.q_h, c.q_h_smoothed
FROM credits c
JOIN credit_runs r ON r.id = c.run_id
JOIN steps s ON s.id = c.step_id
JOIN episodes e ON e.id = s.episode_id
""",
    "subtask_credits": """
CREATE VIEW subtask_credits AS
SELECT run, episode_id, episode, COALESCE(subtask_id, phase) AS subtask,
       MIN(step_index) AS first_step, COUNT(*) AS steps, MAX(subtask_reward) AS subtask_reward,
       AVG(mean_logprob) AS mean_logprob, AVG(pi_hind) AS pi_hind, AVG(rho) AS rho,
       AVG(q_h) AS q_h, AVG(q_h_smoothed) AS q_h_smoothed
FROM step_credits
GROUP BY run, episode_id, episode, COALESCE(subtask_id, phase)
""",
}


def upgrade() -> None:
    op.create_table('episodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('source_key', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('is_current', sa.Boolean(), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('source_format', sa.String(length=32), nullable=False),
    sa.Column('external_id', sa.Text(), nullable=True),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=False),
    sa.Column('phase', sa.Text(), nullable=True),
    sa.Column('plan_score', sa.Float(), nullable=True),
    sa.Column('frozen_scores', sa.Text(), nullable=False),
    sa.Column('turns', sa.Integer(), nullable=True),
    sa.Column('tool_call_count', sa.Integer(), nullable=True),
    sa.Column('reward_backfilled', sa.Boolean(), nullable=False),
    sa.Column('include_thinking', sa.Boolean(), nullable=False),
    sa.Column('max_tool_result_chars', sa.Integer(), nullable=False),
    sa.Column('num_messages', sa.Integer(), nullable=False),
    sa.Column('num_steps', sa.Integer(), nullable=False),
    sa.Column('warnings', sa.Text(), nullable=True),
    sa.Column('raw_source', sa.LargeBinary(), nullable=False),
    sa.Column('ingested_at', sa.String(length=40), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_episodes')),
    sa.UniqueConstraint('source_key', 'version', name=op.f('uq_episodes_source_key_version'))
    )
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.create_index('ix_episodes_current', ['is_current', 'source_key'], unique=False)

    op.create_table('scorers',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('label', sa.Text(), nullable=False),
    sa.Column('spec', sa.Text(), nullable=False),
    sa.Column('created_at', sa.String(length=40), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_scorers'))
    )
    op.create_table('workers',
    sa.Column('id', sa.String(length=200), nullable=False),
    sa.Column('scorer_id', sa.String(length=64), nullable=True),
    sa.Column('host', sa.Text(), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('heartbeat_at', sa.Float(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('scored', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_workers'))
    )
    op.create_table('credit_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('scorer_id', sa.String(length=64), nullable=False),
    sa.Column('params', sa.Text(), nullable=False),
    sa.Column('run_hash', sa.String(length=64), nullable=False),
    sa.Column('episodes', sa.Integer(), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('incomplete_episodes', sa.Integer(), nullable=False),
    sa.Column('incomplete', sa.Text(), nullable=True),
    sa.Column('created_at', sa.String(length=40), nullable=False),
    sa.ForeignKeyConstraint(['scorer_id'], ['scorers.id'], name=op.f('fk_credit_runs_scorer_id_scorers'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_credit_runs')),
    sa.UniqueConstraint('name', name=op.f('uq_credit_runs_name')),
    sa.UniqueConstraint('run_hash', name=op.f('uq_credit_runs_run_hash'))
    )
    op.create_table('messages',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('message_index', sa.Integer(), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('tool_calls', sa.Text(), nullable=True),
    sa.Column('name', sa.Text(), nullable=True),
    sa.Column('tool_call_id', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_messages_episode_id_episodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_messages')),
    sa.UniqueConstraint('episode_id', 'message_index', name=op.f('uq_messages_episode_id_message_index'))
    )
    op.create_table('steps',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('message_index', sa.Integer(), nullable=False),
    sa.Column('phase', sa.String(length=16), nullable=False),
    sa.Column('subtask_id', sa.Text(), nullable=True),
    sa.Column('subtask_reward', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_steps_episode_id_episodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_steps')),
    sa.UniqueConstraint('episode_id', 'step_index', name=op.f('uq_steps_episode_id_step_index'))
    )
    op.create_table('subtasks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('subtask_id', sa.Text(), nullable=False),
    sa.Column('description', sa.Text(), nullable=True),
    sa.Column('acceptance_criteria', sa.Text(), nullable=True),
    sa.Column('frozen_score', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_subtasks_episode_id_episodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_subtasks')),
    sa.UniqueConstraint('episode_id', 'position', name=op.f('uq_subtasks_episode_id_position'))
    )
    op.create_table('tags',
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_tags_episode_id_episodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('episode_id', 'key', name=op.f('pk_tags'))
    )
    op.create_table('attempts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('step_id', sa.Integer(), nullable=False),
    sa.Column('scorer_id', sa.String(length=64), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('step_index', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('lease_owner', sa.Text(), nullable=True),
    sa.Column('lease_expires_at', sa.Float(), nullable=True),
    sa.Column('attempt_count', sa.Integer(), nullable=False),
    sa.Column('last_error_kind', sa.String(length=64), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], name=op.f('fk_attempts_episode_id_episodes'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['scorer_id'], ['scorers.id'], name=op.f('fk_attempts_scorer_id_scorers'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['step_id'], ['steps.id'], name=op.f('fk_attempts_step_id_steps'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts')),
    sa.UniqueConstraint('step_id', 'scorer_id', name=op.f('uq_attempts_step_id_scorer_id'))
    )
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index('ix_attempts_claim', ['scorer_id', 'status', 'lease_expires_at'], unique=False)

    op.create_table('credits',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step_id', sa.Integer(), nullable=False),
    sa.Column('mean_logprob', sa.Float(), nullable=False),
    sa.Column('token_count', sa.Integer(), nullable=False),
    sa.Column('pi_hind', sa.Float(), nullable=False),
    sa.Column('rho_raw', sa.Float(), nullable=False),
    sa.Column('rho', sa.Float(), nullable=False),
    sa.Column('r_t', sa.Float(), nullable=False),
    sa.Column('discount', sa.Float(), nullable=False),
    sa.Column('q_h', sa.Float(), nullable=False),
    sa.Column('q_h_smoothed', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['credit_runs.id'], name=op.f('fk_credits_run_id_credit_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['step_id'], ['steps.id'], name=op.f('fk_credits_step_id_steps'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'step_id', name=op.f('pk_credits'))
    )
    with op.batch_alter_table('credits', schema=None) as batch_op:
        batch_op.create_index('ix_credits_step', ['step_id'], unique=False)

    op.create_table('scores',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('step_id', sa.Integer(), nullable=False),
    sa.Column('scorer_id', sa.String(length=64), nullable=False),
    sa.Column('token_logprobs', sa.LargeBinary(), nullable=False),
    sa.Column('token_count', sa.Integer(), nullable=False),
    sa.Column('mean_logprob', sa.Float(), nullable=False),
    sa.Column('total_action_tokens', sa.Integer(), nullable=False),
    sa.Column('skipped_action_tokens', sa.Integer(), nullable=False),
    sa.Column('truncated_prefix_tokens', sa.Integer(), nullable=False),
    sa.Column('input_tokens', sa.Integer(), nullable=False),
    sa.Column('logprob_start_len', sa.Integer(), nullable=False),
    sa.Column('flattened', sa.Boolean(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('cached_tokens', sa.Integer(), nullable=True),
    sa.Column('latency_s', sa.Float(), nullable=True),
    sa.Column('server_model', sa.Text(), nullable=True),
    sa.Column('worker_id', sa.Text(), nullable=True),
    sa.Column('created_at', sa.String(length=40), nullable=False),
    sa.ForeignKeyConstraint(['scorer_id'], ['scorers.id'], name=op.f('fk_scores_scorer_id_scorers'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['step_id'], ['steps.id'], name=op.f('fk_scores_step_id_steps'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_scores')),
    sa.UniqueConstraint('step_id', 'scorer_id', name=op.f('uq_scores_step_id_scorer_id'))
    )
    with op.batch_alter_table('scores', schema=None) as batch_op:
        batch_op.create_index('ix_scores_scorer_step', ['scorer_id', 'step_id'], unique=False)

    op.create_table('attempt_errors',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('attempt_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('worker_id', sa.Text(), nullable=True),
    sa.Column('at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempts.id'], name=op.f('fk_attempt_errors_attempt_id_attempts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempt_errors'))
    )
    with op.batch_alter_table('attempt_errors', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempt_errors_attempt_id'), ['attempt_id'], unique=False)
    for sql in VIEWS.values():
        op.execute(sql)


def downgrade() -> None:
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    with op.batch_alter_table('attempt_errors', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempt_errors_attempt_id'))

    op.drop_table('attempt_errors')
    with op.batch_alter_table('scores', schema=None) as batch_op:
        batch_op.drop_index('ix_scores_scorer_step')

    op.drop_table('scores')
    with op.batch_alter_table('credits', schema=None) as batch_op:
        batch_op.drop_index('ix_credits_step')

    op.drop_table('credits')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index('ix_attempts_claim')

    op.drop_table('attempts')
    op.drop_table('tags')
    op.drop_table('subtasks')
    op.drop_table('steps')
    op.drop_table('messages')
    op.drop_table('credit_runs')
    op.drop_table('workers')
    op.drop_table('scorers')
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index('ix_episodes_current')

    op.drop_table('episodes')
