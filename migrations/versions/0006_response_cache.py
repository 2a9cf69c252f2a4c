"""response cache: each item's request key, and where a reused answer came from

``items.request_hash`` is the key of the item's first request (provider kind,
URL, canonical body; never a header), stored when the item is answered.
``items.cached_from`` is the id of the item whose answer was reused (null for
an answer this item paid for). Two small partial indexes: succeeded items by
key (the cache's one lookup), and reused items by job (``status`` counts them
without reading every row).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("request_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("cached_from", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True))
    op.create_index(
        "ix_items_answered_by_request",
        "items",
        ["request_hash", "id"],
        sqlite_where=sa.text("state = 'succeeded'"),
        postgresql_where=sa.text("state = 'succeeded'"),
    )
    op.create_index(
        "ix_items_reused",
        "items",
        ["job_id"],
        sqlite_where=sa.text("cached_from IS NOT NULL"),
        postgresql_where=sa.text("cached_from IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_items_reused", table_name="items")
    op.drop_index("ix_items_answered_by_request", table_name="items")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("cached_from")
        batch.drop_column("request_hash")
