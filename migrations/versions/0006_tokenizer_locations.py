"""tokenizer locations: where a tokenizer with given files was found, to find it again

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26

Why: a scorer records its tokenizer's files (``spec.tokenizer.files_sha256``), not where
they were, and the tokenized export and the trainer hand-off asked for ``--tokenizer``
every time. ``tokenizer_locations`` remembers each directory a tokenizer with those files
was loaded from (by ``score``, or given to an export); an export without ``--tokenizer``
tries them, newest first, and uses one only when its files still hash the same.

Frozen history: nothing here reads the models.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tokenizer_locations',
        sa.Column('files_sha256', sa.String(length=64), primary_key=True),
        sa.Column('path', sa.String(length=4096), primary_key=True),
        sa.Column('seen_at', sa.String(length=40), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('tokenizer_locations')
