"""counts kept by the database: items per state, attempt totals and histogram; indexes for status

``item_counts`` holds how many of a job's items are in each state (the sum of
``n`` over a job's rows of a state), kept exact by triggers on ``items`` for
every insert, state change and delete, whatever code path writes them.
``attempt_totals`` (requests, tokens, cost, first/last start, and count and sum
of each distribution's values) and ``attempt_histogram`` (items by number of
attempt rows) are kept the same way by a trigger on ``attempts`` (insert only:
attempts are never updated). On SQLite a row per job (and state, or k) is
updated (one writer at a time); on PostgreSQL a statement appends a row per
job and state it changed (concurrent writers never wait on a shared counter),
and the ledger folds a job's rows now and then. ``status`` and ``list`` read
these few rows instead of a million items and attempts.

The triggers are created before the counts are filled in, inside the upgrade's
transaction: on PostgreSQL, CREATE TRIGGER locks ``items`` against writes until
the commit, so no write falls between the fill and the first counted one.

``ix_items_errors`` and ``ix_attempts_errors`` (partial: rows with an error class)
let errors by class and by status read only the rows that have one;
``ix_attempts_latency``, ``ix_attempts_queue_wait`` and ``ix_attempts_ttft``
(partial: the attempts each distribution covers) hold each distribution in
order, so a percentile is one step into an index from its nearer end.

The trigger SQL is a copy of ``batchrun.ledger.models.COUNT_TRIGGERS`` as of
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
        """CREATE TRIGGER attempts_counted_insert AFTER INSERT ON attempts BEGIN
            INSERT INTO attempt_totals (job_id, requests, clean, input_tokens, output_tokens, cached_tokens, cost_usd,
                latency_n, latency_sum, queue_wait_n, queue_wait_sum, ttft_n, ttft_sum)
                SELECT NEW.job_id, 0, 0, 0, 0, 0, 0.0, 0, 0.0, 0, 0.0, 0, 0.0
                WHERE NOT EXISTS (SELECT 1 FROM attempt_totals WHERE job_id = NEW.job_id);
            UPDATE attempt_totals SET
                requests = requests + 1,
                clean = clean + (NEW.error_class IS NULL),
                input_tokens = input_tokens + coalesce(NEW.input_tokens, 0),
                output_tokens = output_tokens + coalesce(NEW.output_tokens, 0),
                cached_tokens = cached_tokens + coalesce(NEW.cached_tokens, 0),
                cost_usd = cost_usd + coalesce(NEW.cost_usd, 0.0),
                first_started_at = min(coalesce(first_started_at, NEW.started_at), NEW.started_at),
                last_started_at = max(coalesce(last_started_at, NEW.started_at), NEW.started_at),
                latency_n = latency_n + (NEW.error_class IS NULL AND NEW.latency_ms IS NOT NULL),
                latency_sum = latency_sum + CASE WHEN NEW.error_class IS NULL THEN coalesce(NEW.latency_ms, 0.0) ELSE 0.0 END,
                queue_wait_n = queue_wait_n + (NEW.queue_wait_ms IS NOT NULL),
                queue_wait_sum = queue_wait_sum + coalesce(NEW.queue_wait_ms, 0.0),
                ttft_n = ttft_n + (NEW.error_class IS NULL AND NEW.ttft_ms IS NOT NULL),
                ttft_sum = ttft_sum + CASE WHEN NEW.error_class IS NULL THEN coalesce(NEW.ttft_ms, 0.0) ELSE 0.0 END
            WHERE job_id = NEW.job_id;
            UPDATE attempt_histogram SET n = n - 1 WHERE job_id = NEW.job_id
                AND k = (SELECT count(*) FROM attempts WHERE item_id = NEW.item_id) - 1;
            INSERT INTO attempt_histogram (job_id, k, n)
                SELECT NEW.job_id, c, 0 FROM (SELECT count(*) AS c FROM attempts WHERE item_id = NEW.item_id)
                WHERE NOT EXISTS (SELECT 1 FROM attempt_histogram WHERE job_id = NEW.job_id AND k = c);
            UPDATE attempt_histogram SET n = n + 1 WHERE job_id = NEW.job_id
                AND k = (SELECT count(*) FROM attempts WHERE item_id = NEW.item_id);
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
        """CREATE FUNCTION batchrun_count_attempts() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO attempt_totals (job_id, requests, clean, input_tokens, output_tokens, cached_tokens, cost_usd,
                    first_started_at, last_started_at, latency_n, latency_sum, queue_wait_n, queue_wait_sum, ttft_n, ttft_sum)
                SELECT job_id, count(*), count(*) FILTER (WHERE error_class IS NULL),
                    coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0), coalesce(sum(cached_tokens), 0),
                    coalesce(sum(cost_usd), 0.0), min(started_at), max(started_at),
                    count(*) FILTER (WHERE error_class IS NULL AND latency_ms IS NOT NULL),
                    coalesce(sum(latency_ms) FILTER (WHERE error_class IS NULL), 0.0),
                    count(queue_wait_ms), coalesce(sum(queue_wait_ms), 0.0),
                    count(*) FILTER (WHERE error_class IS NULL AND ttft_ms IS NOT NULL),
                    coalesce(sum(ttft_ms) FILTER (WHERE error_class IS NULL), 0.0)
                FROM new_rows GROUP BY job_id;
            INSERT INTO attempt_histogram (job_id, k, n)
                WITH added AS (
                    SELECT job_id, item_id, count(*) AS m FROM new_rows GROUP BY job_id, item_id
                ), now_has AS (
                    SELECT a.job_id, a.m, (SELECT count(*) FROM attempts x WHERE x.item_id = a.item_id) AS total
                    FROM added AS a
                )
                SELECT job_id, k, sum(d) FROM (
                    SELECT job_id, total AS k, 1 AS d FROM now_has
                    UNION ALL SELECT job_id, total - m AS k, -1 AS d FROM now_has WHERE total > m
                ) AS moved GROUP BY job_id, k HAVING sum(d) <> 0;
            RETURN NULL;
        END $$""",
        """CREATE TRIGGER attempts_counted_insert AFTER INSERT ON attempts REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION batchrun_count_attempts()""",
    ),
}

DISTRIBUTIONS = (
    ("latency", "latency_ms", "error_class IS NULL AND latency_ms IS NOT NULL"),
    ("queue_wait", "queue_wait_ms", "queue_wait_ms IS NOT NULL"),
    ("ttft", "ttft_ms", "error_class IS NULL AND ttft_ms IS NOT NULL"),
)


def upgrade() -> None:
    # A job the user cancelled: lines its ingest stores from then on come in cancelled.
    op.add_column("jobs", sa.Column("cancelled_at", sa.Float()))
    op.create_table(
        "item_counts",
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_item_counts_job_state", "item_counts", ["job_id", "state"])
    op.create_table(
        "attempt_totals",
        sa.Column("job_id", BigId, nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False)
          for name in ("requests", "clean", "input_tokens", "output_tokens", "cached_tokens")),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("first_started_at", sa.Float()),
        sa.Column("last_started_at", sa.Float()),
        *(column for name, _, _ in DISTRIBUTIONS for column in (
            sa.Column(f"{name}_n", sa.BigInteger(), nullable=False), sa.Column(f"{name}_sum", sa.Float(), nullable=False)
        )),
    )
    op.create_index("ix_attempt_totals_job", "attempt_totals", ["job_id"])
    op.create_table(
        "attempt_histogram",
        sa.Column("job_id", BigId, nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_attempt_histogram_job_k", "attempt_histogram", ["job_id", "k"])
    for statement in TRIGGERS[op.get_bind().dialect.name]:
        op.execute(statement)
    op.execute("INSERT INTO item_counts (job_id, state, n) SELECT job_id, state, count(*) FROM items GROUP BY job_id, state")
    clean = "error_class IS NULL"
    op.execute(
        "INSERT INTO attempt_totals (job_id, requests, clean, input_tokens, output_tokens, cached_tokens, cost_usd, "
        "first_started_at, last_started_at, latency_n, latency_sum, queue_wait_n, queue_wait_sum, ttft_n, ttft_sum) "
        f"SELECT job_id, count(*), sum(CASE WHEN {clean} THEN 1 ELSE 0 END), coalesce(sum(input_tokens), 0), "
        "coalesce(sum(output_tokens), 0), coalesce(sum(cached_tokens), 0), coalesce(sum(cost_usd), 0.0), "
        "min(started_at), max(started_at), "
        f"sum(CASE WHEN {clean} AND latency_ms IS NOT NULL THEN 1 ELSE 0 END), "
        f"coalesce(sum(CASE WHEN {clean} THEN latency_ms END), 0.0), count(queue_wait_ms), "
        f"coalesce(sum(queue_wait_ms), 0.0), sum(CASE WHEN {clean} AND ttft_ms IS NOT NULL THEN 1 ELSE 0 END), "
        f"coalesce(sum(CASE WHEN {clean} THEN ttft_ms END), 0.0) FROM attempts GROUP BY job_id"
    )
    op.execute(
        "INSERT INTO attempt_histogram (job_id, k, n) SELECT job_id, k, count(*) FROM "
        "(SELECT job_id, item_id, count(*) AS k FROM attempts GROUP BY job_id, item_id) AS per_item GROUP BY job_id, k"
    )
    for table in ("items", "attempts"):
        op.create_index(
            f"ix_{table}_errors",
            table,
            ["job_id", "error_class"],
            sqlite_where=sa.text("error_class IS NOT NULL"),
            postgresql_where=sa.text("error_class IS NOT NULL"),
        )
    for name, column, where in DISTRIBUTIONS:
        op.create_index(
            f"ix_attempts_{name}", "attempts", ["job_id", column],
            sqlite_where=sa.text(where), postgresql_where=sa.text(where),
        )


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_column("cancelled_at")
    for name, _, _ in DISTRIBUTIONS:
        op.drop_index(f"ix_attempts_{name}", table_name="attempts")
    for table in ("attempts", "items"):
        op.drop_index(f"ix_{table}_errors", table_name=table)
    for table, trigger in (("attempts", "attempts_counted_insert"), ("items", "items_counted_insert"),
                           ("items", "items_counted_update"), ("items", "items_counted_delete")):
        op.execute(f"DROP TRIGGER {trigger}" + (f" ON {table}" if postgresql else ""))
    if postgresql:
        op.execute("DROP FUNCTION batchrun_count_attempts()")
        op.execute("DROP FUNCTION batchrun_count_items()")
    op.drop_index("ix_attempt_histogram_job_k", table_name="attempt_histogram")
    op.drop_table("attempt_histogram")
    op.drop_index("ix_attempt_totals_job", table_name="attempt_totals")
    op.drop_table("attempt_totals")
    op.drop_index("ix_item_counts_job_state", table_name="item_counts")
    op.drop_table("item_counts")
