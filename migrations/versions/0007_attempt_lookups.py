"""attempt lookups: an episode's queue rows and a worker's leases by index

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27

Why: a scoring run over a few episodes (``follow``'s cycle, ``score --episode``) counted,
claimed and listed its queue rows through ``ix_attempts_claim`` (scorer, status): every
queued step of the scorer in the store, so a one-new-episode cycle grew with the store.
``ix_attempts_episode`` (episode, scorer, status, lease expiry) finds the rows of the filtered
episodes alone; ``ix_attempts_lease_owner`` finds a worker's leases (heartbeat, release at the
end of a run, ``status``) without reading the whole table.

Frozen history: nothing here reads the models.
"""
from __future__ import annotations

from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        'ix_attempts_episode', 'attempts', ['episode_id', 'scorer_id', 'status', 'lease_expires_at'], unique=False
    )
    op.create_index('ix_attempts_lease_owner', 'attempts', ['lease_owner'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_attempts_lease_owner', table_name='attempts')
    op.drop_index('ix_attempts_episode', table_name='attempts')
