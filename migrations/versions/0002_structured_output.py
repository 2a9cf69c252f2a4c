"""structured output: parsed answers, validation errors, per-item max_tokens

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("parsed", sa.Text, nullable=True))
        batch.add_column(sa.Column("validation_errors", sa.Text, nullable=True))
        batch.add_column(sa.Column("max_tokens", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_column("max_tokens")
        batch.drop_column("validation_errors")
        batch.drop_column("parsed")
