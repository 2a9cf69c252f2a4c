"""initial ledger: jobs, runs, items, attempts, exports

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("spec_source", sa.Text, nullable=False),
        sa.Column("spec_json", sa.Text, nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("input_path", sa.Text, nullable=False),
        sa.Column("input_hash", sa.String(64), nullable=False),
        sa.Column("ingest_done", sa.Boolean, nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("lock_run_id", sa.String(32), nullable=True),
        sa.Column("lock_pid", sa.Integer, nullable=True),
        sa.Column("lock_host", sa.String(255), nullable=True),
        sa.Column("lock_since", sa.Float, nullable=True),
        sa.Column("lock_heartbeat", sa.Float, nullable=True),
    )
    op.create_index("ix_jobs_identity", "jobs", ["spec_hash", "input_hash"])

    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("job_id", BigId, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("command", sa.String(32), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=True),
        sa.Column("exit_code", sa.Integer, nullable=True),
    )
    op.create_index("ix_runs_job_id", "runs", ["job_id"])

    op.create_table(
        "items",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", BigId, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("line", sa.Integer, nullable=False),
        sa.Column("custom_id", sa.Text, nullable=False),
        sa.Column("url", sa.Text, nullable=True),
        sa.Column("body", sa.Text, nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("lease_owner", sa.String(32), nullable=True),
        sa.Column("lease_expires", sa.Float, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("response", sa.Text, nullable=True),
        sa.Column("output", sa.Text, nullable=True),
        sa.Column("request_id", sa.String(200), nullable=True),
        sa.Column("error_class", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("input_tokens", sa.Integer, nullable=True),
        sa.Column("output_tokens", sa.Integer, nullable=True),
        sa.Column("latency_ms", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
    )
    op.create_index("ix_items_claim", "items", ["job_id", "state", "id"])
    op.create_index("ix_items_job_line", "items", ["job_id", "line"])
    op.create_index(
        "uq_items_job_custom_id",
        "items",
        ["job_id", "custom_id"],
        unique=True,
        sqlite_where=sa.text("state != 'rejected'"),
        postgresql_where=sa.text("state != 'rejected'"),
    )

    op.create_table(
        "attempts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", BigId, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("item_id", BigId, sa.ForeignKey("items.id", ondelete="CASCADE"), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("queue_wait_ms", sa.Float, nullable=True),
        sa.Column("latency_ms", sa.Float, nullable=True),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("error_class", sa.String(64), nullable=True),
        sa.Column("input_tokens", sa.Integer, nullable=True),
        sa.Column("output_tokens", sa.Integer, nullable=True),
    )
    op.create_index("ix_attempts_job_id", "attempts", ["job_id"])
    op.create_index("ix_attempts_item_id", "attempts", ["item_id"])

    op.create_table(
        "exports",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", BigId, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("lines", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_exports_job_id", "exports", ["job_id"])
    op.create_index("ix_exports_sha256", "exports", ["sha256"])


def downgrade() -> None:
    for table in ("exports", "attempts", "items", "runs", "jobs"):
        op.drop_table(table)
