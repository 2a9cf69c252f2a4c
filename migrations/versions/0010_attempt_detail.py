"""attempt detail: each failed attempt's message, and time to first byte

``attempts.error_message`` keeps the (redacted, shortened) message of a failed
attempt, so errors by class and by status have an example even when every item
that met the error later succeeded (an item keeps only its last error, and a
success clears it). ``attempts.ttfb_ms`` is the time from sending a request to
its response's headers (streamed or not): with ``queue_wait_ms`` and
``latency_ms`` it splits a request's time into waiting for a slot, the network
and server up to the first byte, and the rest of the answer.

``ttfb_ms`` has no index of its own: one cost the run's ledger writer about
15 µs per clean answer (a fifth of its work per answer; bench/RESULTS.md), and
only ``report`` reads the distribution (a sort, about 2 s over 500,000 answers).
The count triggers of 0009 are unchanged (they name their columns), and adding
columns does not rebuild the table on SQLite, so the triggers stay.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("error_message", sa.Text()))
    op.add_column("attempts", sa.Column("ttfb_ms", sa.Float()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # DROP COLUMN in place (SQLite >= 3.35): batch_alter_table would rebuild attempts and drop
        # the count trigger of 0009 with it.
        op.execute("ALTER TABLE attempts DROP COLUMN ttfb_ms")
        op.execute("ALTER TABLE attempts DROP COLUMN error_message")
        return
    op.drop_column("attempts", "ttfb_ms")
    op.drop_column("attempts", "error_message")
