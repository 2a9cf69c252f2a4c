"""streaming: time to first token and time per output token per attempt

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("ttft_ms", sa.Float, nullable=True))
        batch.add_column(sa.Column("tpot_ms", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("tpot_ms")
        batch.drop_column("ttft_ms")
