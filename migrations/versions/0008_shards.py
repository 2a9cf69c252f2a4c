"""shards: batch mode's provider batches, and the items and attempts they hold

``shards`` holds one row per provider batch of a job (its provider ids, state,
counts, timestamps and the budget it reserved); ``items.shard_id`` names the
shard that holds an item (state ``submitted``) or answered it, and
``attempts.shard_id`` the shard a results line came from (null: online).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "shards",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", BigId, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("token", sa.String(64), nullable=False, unique=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(32)),
        sa.Column("endpoint", sa.Text()),
        sa.Column("model", sa.Text()),
        sa.Column("own_ids", sa.Boolean(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("worst_usd", sa.Float()),
        sa.Column("input_file_id", sa.Text()),
        sa.Column("batch_id", sa.Text()),
        sa.Column("output_file_id", sa.Text()),
        sa.Column("error_file_id", sa.Text()),
        sa.Column("provider_status", sa.String(32)),
        sa.Column("counts", sa.Text()),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("create_sent_at", sa.Float()),
        sa.Column("creates", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("provider_created_at", sa.Float()),
        sa.Column("in_progress_at", sa.Float()),
        sa.Column("ended_at", sa.Float()),
        sa.Column("expires_at", sa.Float()),
        sa.Column("collected_at", sa.Float()),
        sa.Column("cancel_reason", sa.String(16)),
        sa.Column("error", sa.Text()),
    )
    op.create_index("ix_shards_job_state", "shards", ["job_id", "state"])
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("shard_id", BigId, nullable=True))
    op.create_index(
        "ix_items_shard",
        "items",
        ["shard_id", "id"],
        sqlite_where=sa.text("shard_id IS NOT NULL"),
        postgresql_where=sa.text("shard_id IS NOT NULL"),
    )
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("shard_id", BigId, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("shard_id")
    op.drop_index("ix_items_shard", table_name="items")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("shard_id")
    op.drop_index("ix_shards_job_state", table_name="shards")
    op.drop_table("shards")
