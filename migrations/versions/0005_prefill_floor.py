"""prefill floor accounting: tokens sent and cached per score, conversation tokens per episode

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25

Why: scoring costs GPU prefill, and the floor is each token of an episode's conversation
prefilled once. ``scores.sent_tokens`` is the step's share of the tokens its request sent
(the request's tokens are split among the steps it scored, so they add up to what was sent);
``scores.sent_cached_tokens`` its share of the tokens the server reported served from its
cache (the request's count on its first step, 0 on the others; NULL when not reported).
``episode_floors`` holds, per scorer and episode, the conversation's tokens: the whole
conversation rendered once with the episode's hindsight block, up to the end of its last step.
Scores stored before this revision have NULL shares and their episodes no floor row: the
accounting leaves them out.

Frozen history: nothing here reads the models.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (no table rebuild): the step_scores view over scores stays as it is.
    op.add_column('scores', sa.Column('sent_tokens', sa.Integer(), nullable=True))
    op.add_column('scores', sa.Column('sent_cached_tokens', sa.Integer(), nullable=True))
    op.create_table(
        'episode_floors',
        sa.Column('scorer_id', sa.String(length=64), sa.ForeignKey('scorers.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('episode_id', sa.Integer(), sa.ForeignKey('episodes.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('conversation_tokens', sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('episode_floors')
    op.drop_column('scores', 'sent_cached_tokens')
    op.drop_column('scores', 'sent_tokens')
