"""fences: one row per input line, idempotent attempt rows, persisted re-asks

``items (job_id, line)`` becomes unique: an input line is stored once, as an
item or as a rejected line, never both and never twice. Ledgers written by
overlapping ingests before this revision may hold a line twice (a real item
and a ``rejected duplicate_custom_id`` copy of it, or two rejected copies):
the copies are deleted first, keeping the real item, else the first row.

``attempts.seq`` numbers a run's attempts (unique with ``run_id``), so a write
replayed after a lost acknowledgement (a PostgreSQL connection cut at commit)
cannot add an attempt, or charge it, twice.

``items.lease_claim`` numbers the claim (within its run) that leased an item, so an
outcome a run queued for an earlier claim of an item (one swept from it while the run was
stalled, then claimed again) cannot land on the later one, and a claim replayed after a
lost acknowledgement returns what the first one leased instead of leasing more.

``items.followups`` holds a structured item's re-asks so far (JSON: the invalid
answers and the feedback sent with them), so a run killed during re-asks
carries on from the last committed re-ask instead of paying for them again.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "DELETE FROM items WHERE state = 'rejected' AND EXISTS ("
        "SELECT 1 FROM items AS other WHERE other.job_id = items.job_id AND other.line = items.line "
        "AND other.id <> items.id AND (other.state <> 'rejected' OR other.id < items.id))"
    )
    op.drop_index("ix_items_job_line", table_name="items")
    op.create_index("uq_items_job_line", "items", ["job_id", "line"], unique=True)
    with op.batch_alter_table("items") as batch:
        batch.add_column(sa.Column("followups", sa.Text(), nullable=True))
        batch.add_column(sa.Column("lease_claim", sa.Integer(), nullable=True))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("seq", sa.Integer(), nullable=True))
    op.create_index("uq_attempts_run_seq", "attempts", ["run_id", "seq"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_attempts_run_seq", table_name="attempts")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("seq")
    with op.batch_alter_table("items") as batch:
        batch.drop_column("lease_claim")
        batch.drop_column("followups")
    op.drop_index("uq_items_job_line", table_name="items")
    op.create_index("ix_items_job_line", "items", ["job_id", "line"])
