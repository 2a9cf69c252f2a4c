"""item counts: a job's items per state kept by the database; indexes for errors

``item_counts`` holds how many of a job's items are in each state (the sum of
``n`` over a job's rows of a state), kept exact by triggers on ``items`` for
every insert, state change and delete, whatever code path writes them. On SQLite
a row per job and state is updated (one writer at a time); on PostgreSQL a
statement appends a row per state it changed (concurrent writers never wait on a
shared counter), and the ledger folds a job's rows now and then. ``status`` and
``list`` read these few rows instead of counting a million items.

The triggers are created before the counts are filled in, inside the upgrade's
transaction: on PostgreSQL, CREATE TRIGGER locks ``items`` against writes until
the commit, so no write falls between the fill and the first counted one.

``ix_items_errors`` and ``ix_attempts_errors`` (partial: rows with an error class)
let errors by class and by status read only the rows that have one.

The trigger SQL is a copy of ``batchrun.ledger.models.ITEM_COUNT_TRIGGERS`` as of
this revision (a test compares a migrated ledger with a new one).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

TRIGGERS = {
    "sqlite": (
        """CREATE TRIGGER items_counted_insert AFTER INSERT ON items BEGIN
            UPDATE item_counts SET n = n + 1 WHERE job_id = NEW.job_id AND state = NEW.state;
            INSERT INTO item_counts (job_id, state, n) SELECT NEW.job_id, NEW.state, 1
                WHERE NOT EXISTS (SELECT 1 FROM item_counts WHERE job_id = NEW.job_id AND state = NEW.state);
        END""",
        """CREATE TRIGGER items_counted_update AFTER UPDATE OF state ON items WHEN OLD.state IS NOT NEW.state BEGIN
            UPDATE item_counts SET n = n - 1 WHERE job_id = OLD.job_id AND state = OLD.state;
            UPDATE item_counts SET n = n + 1 WHERE job_id = NEW.job_id AND state = NEW.state;
            INSERT INTO item_counts (job_id, state, n) SELECT NEW.job_id, NEW.state, 1
                WHERE NOT EXISTS (SELECT 1 FROM item_counts WHERE job_id = NEW.job_id AND state = NEW.state);
        END""",
        """CREATE TRIGGER items_counted_delete AFTER DELETE ON items BEGIN
            UPDATE item_counts SET n = n - 1 WHERE job_id = OLD.job_id AND state = OLD.state;
        END""",
    ),
    "postgresql": (
        """CREATE FUNCTION batchrun_count_items() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'INSERT' THEN
                INSERT INTO item_counts (job_id, state, n)
                    SELECT job_id, state, count(*) FROM new_rows GROUP BY job_id, state;
            ELSIF TG_OP = 'DELETE' THEN
                INSERT INTO item_counts (job_id, state, n)
                    SELECT job_id, state, -count(*) FROM old_rows GROUP BY job_id, state;
            ELSE
                INSERT INTO item_counts (job_id, state, n)
                    SELECT job_id, state, sum(d) FROM (
                        SELECT job_id, state, -1 AS d FROM old_rows
                        UNION ALL SELECT job_id, state, 1 AS d FROM new_rows
                    ) AS moved GROUP BY job_id, state HAVING sum(d) <> 0;
            END IF;
            RETURN NULL;
        END $$""",
        """CREATE TRIGGER items_counted_insert AFTER INSERT ON items REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION batchrun_count_items()""",
        """CREATE TRIGGER items_counted_update AFTER UPDATE ON items REFERENCING OLD TABLE AS old_rows
            NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION batchrun_count_items()""",
        """CREATE TRIGGER items_counted_delete AFTER DELETE ON items REFERENCING OLD TABLE AS old_rows
            FOR EACH STATEMENT EXECUTE FUNCTION batchrun_count_items()""",
    ),
}


def upgrade() -> None:
    op.create_table(
        "item_counts",
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_item_counts_job_state", "item_counts", ["job_id", "state"])
    for statement in TRIGGERS[op.get_bind().dialect.name]:
        op.execute(statement)
    op.execute("INSERT INTO item_counts (job_id, state, n) SELECT job_id, state, count(*) FROM items GROUP BY job_id, state")
    for table in ("items", "attempts"):
        op.create_index(
            f"ix_{table}_errors",
            table,
            ["job_id", "error_class"],
            sqlite_where=sa.text("error_class IS NOT NULL"),
            postgresql_where=sa.text("error_class IS NOT NULL"),
        )


def downgrade() -> None:
    for table in ("attempts", "items"):
        op.drop_index(f"ix_{table}_errors", table_name=table)
    for trigger in ("items_counted_insert", "items_counted_update", "items_counted_delete"):
        op.execute(f"DROP TRIGGER {trigger}" + (" ON items" if op.get_bind().dialect.name == "postgresql" else ""))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION batchrun_count_items()")
    op.drop_index("ix_item_counts_job_state", table_name="item_counts")
    op.drop_table("item_counts")
