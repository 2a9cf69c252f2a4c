"""cost: USD and cached input tokens per attempt, USD per item

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("cached_tokens", sa.Integer, nullable=True))
        batch.add_column(sa.Column("cost_usd", sa.Float, nullable=True))
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("cost_usd", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.drop_column("cost_usd")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("cost_usd")
        batch.drop_column("cached_tokens")
