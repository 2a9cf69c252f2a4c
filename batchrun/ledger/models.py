"""The ledger schema: jobs, items, attempts, runs, exports, rate buckets, shards and item counts.

Times are UNIX seconds as floats: portable between SQLite and PostgreSQL and
cheap to compare on the hot path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import DDL, BigInteger, Boolean, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text, event, text

# SQLite only auto-increments a column declared exactly INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


metadata = MetaData()

jobs = Table(
    "jobs",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("name", String(200)),
    Column("created_at", Float, nullable=False),
    Column("spec_source", Text, nullable=False),
    Column("spec_json", Text, nullable=False),
    Column("spec_hash", String(64), nullable=False),
    Column("input_path", Text, nullable=False),
    Column("input_hash", String(64), nullable=False),
    Column("ingest_done", Boolean, default=False, nullable=False),
    Column("total", Integer, default=0, nullable=False),
    Column("lock_run_id", String(32)),
    Column("lock_pid", Integer),
    Column("lock_host", String(255)),
    Column("lock_since", Float),
    Column("lock_heartbeat", Float),
    Column("cancelled_at", Float),  # `batchrun cancel`: lines stored from then on come in cancelled
    Index("ix_jobs_identity", "spec_hash", "input_hash"),
)

runs = Table(
    "runs",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), index=True, nullable=False),
    Column("command", String(32), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("host", String(255), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
    Column("ended_at", Float),
    Column("exit_code", Integer),
)

items = Table(
    "items",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("line", Integer, nullable=False),
    Column("custom_id", Text, nullable=False),
    Column("url", Text),
    Column("body", Text),
    Column("state", String(16), nullable=False),
    Column("lease_owner", String(32)),
    Column("lease_expires", Float),
    Column("lease_claim", Integer),  # which claim of the owner run leased it (its outcomes carry it)
    Column("attempts", Integer, default=0, nullable=False),
    Column("status_code", Integer),
    Column("response", Text),
    Column("output", Text),
    Column("parsed", Text),
    Column("validation_errors", Text),
    Column("max_tokens", Integer),
    Column("request_id", String(200)),
    Column("error_class", String(64)),
    Column("error_message", Text),
    Column("input_tokens", Integer),
    Column("output_tokens", Integer),
    Column("latency_ms", Float),
    Column("finished_at", Float),
    Column("cost_usd", Float),
    # The response cache: the key of the item's first request (batchrun.cache), and the
    # item whose answer was reused for this one (null: this item's answer was paid for).
    Column("request_hash", String(64)),
    Column("cached_from", BigId),
    # A structured item's re-asks so far: JSON [[invalid answer, feedback], ...] (null: none).
    Column("followups", Text),
    # Batch mode: the shard (provider batch) that holds the item (state submitted) or answered it.
    Column("shard_id", BigId),
    Index("ix_items_claim", "job_id", "state", "id"),
    Index(
        "ix_items_shard",
        "shard_id",
        "id",
        sqlite_where=text("shard_id IS NOT NULL"),
        postgresql_where=text("shard_id IS NOT NULL"),
    ),
    Index(
        "ix_items_answered_by_request",
        "request_hash",
        "id",
        sqlite_where=text("state = 'succeeded'"),
        postgresql_where=text("state = 'succeeded'"),
    ),
    Index(
        "ix_items_reused",
        "job_id",
        sqlite_where=text("cached_from IS NOT NULL"),
        postgresql_where=text("cached_from IS NOT NULL"),
    ),
    # Errors by class and by status (status, report) read only the items that have one.
    Index(
        "ix_items_errors",
        "job_id",
        "error_class",
        sqlite_where=text("error_class IS NOT NULL"),
        postgresql_where=text("error_class IS NOT NULL"),
    ),
    # One row per input line: an item or a rejected line, never both, never twice.
    Index("uq_items_job_line", "job_id", "line", unique=True),
    # Only rejected lines may repeat a custom_id (a duplicate is itself rejected).
    Index(
        "uq_items_job_custom_id",
        "job_id",
        "custom_id",
        unique=True,
        sqlite_where=text("state != 'rejected'"),
        postgresql_where=text("state != 'rejected'"),
    ),
)


def item_columns(row_type: type, renamed: dict[str, str]) -> tuple[Any, ...]:
    """The items columns behind each field of the dataclass ``row_type``, in its order: rows are then built
    by name (a field is its column, or the one ``renamed`` names), whatever the dataclass's order."""
    return tuple(items.c[renamed.get(f.name, f.name)] for f in dataclasses.fields(row_type))

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), index=True, nullable=False),
    Column("item_id", ForeignKey("items.id", ondelete="CASCADE"), index=True, nullable=False),
    Column("run_id", String(32), nullable=False),
    Column("number", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("queue_wait_ms", Float),
    Column("latency_ms", Float),
    Column("status_code", Integer),
    Column("error_class", String(64)),
    Column("input_tokens", Integer),
    Column("output_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("cost_usd", Float),
    Column("ttft_ms", Float),  # streamed attempts: time to first token
    Column("tpot_ms", Float),  # streamed attempts: ms per output token after the first
    # The run's own number for the attempt: a replayed write cannot add it twice.
    Column("seq", Integer),
    Column("shard_id", BigId),  # batch mode: the shard whose results line this is (null: an online request)
    # A failed attempt's message (redacted, at most ATTEMPT_MESSAGE_CHARS): an example for its error
    # class and status even when the item later succeeded (and so keeps no message).
    Column("error_message", Text),
    # Time from sending to the response's headers (streamed or not). No index: one costs the writer
    # ~15 µs per answer (bench/RESULTS.md), and only `report` sorts these.
    Column("ttfb_ms", Float),
    Index("uq_attempts_run_seq", "run_id", "seq", unique=True),
    Index(
        "ix_attempts_errors",
        "job_id",
        "error_class",
        sqlite_where=text("error_class IS NOT NULL"),
        postgresql_where=text("error_class IS NOT NULL"),
    ),
    # The attempts each distribution of status/report covers, in the order of their values: a
    # percentile is one step into the index from its nearer end (LedgerQueries.attempt_distribution).
    *(
        Index(
            f"ix_attempts_{name}",
            "job_id",
            column,
            sqlite_where=text(where),
            postgresql_where=text(where),
        )
        for name, column, where in (
            ("latency", "latency_ms", "error_class IS NULL AND latency_ms IS NOT NULL"),
            ("queue_wait", "queue_wait_ms", "queue_wait_ms IS NOT NULL"),
            ("ttft", "ttft_ms", "error_class IS NULL AND ttft_ms IS NOT NULL"),
        )
    ),
)

exports = Table(
    "exports",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), index=True, nullable=False),
    Column("path", Text, nullable=False),
    Column("format", String(32), nullable=False),
    Column("sha256", String(64), index=True, nullable=False),
    Column("lines", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
)

# A job's requests- or tokens-per-minute budget, shared by all its runs (PostgreSQL workers).
#
# A token bucket that may go into debt: a take subtracts what it asks for and
# the taker waits ``-level / rate`` seconds when the level is negative. Times
# are the database's clock, so hosts with skewed clocks share it fairly.
rate_buckets = Table(
    "rate_buckets",
    metadata,
    Column("job_id", BigId, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("kind", String(16), primary_key=True),  # "requests" or "tokens"
    Column("level", Float, nullable=False),
    Column("rate", Float, nullable=False),  # per second
    Column("capacity", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

# Batch mode: one row per provider batch ("shard") of a job (batchrun.batch). The row and its
# items (state submitted, items.shard_id) are committed before the provider is asked to create
# the batch; ``token`` names the shard at the provider (OpenAI metadata and file name), so a
# batch created but never recorded is found again instead of created twice.
shards = Table(
    "shards",
    metadata,
    Column("id", BigId, primary_key=True, autoincrement=True),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("token", String(64), nullable=False, unique=True),
    Column("kind", String(32), nullable=False),  # the provider kind
    Column("state", String(16), nullable=False),  # states.ShardState
    Column("run_id", String(32)),  # the run that made it
    Column("endpoint", Text),  # OpenAI: the one endpoint of its requests
    Column("model", Text),  # the one model of its requests (null: each request's own)
    Column("own_ids", Boolean, nullable=False),  # lines carry the items' custom_ids (else "i<item id>")
    Column("requests", Integer, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),  # estimated: what the enqueued-token limit counts
    Column("worst_usd", Float),  # the budget's reservation for it (null: no budget)
    Column("input_file_id", Text),
    Column("batch_id", Text),  # the provider's batch id
    Column("output_file_id", Text),
    Column("error_file_id", Text),
    Column("provider_status", String(32)),  # as the provider last said
    Column("counts", Text),  # JSON: the provider's request counts, as last polled
    Column("created_at", Float, nullable=False),  # the row
    Column("create_sent_at", Float),  # the last create call (the database's clock on PostgreSQL)
    Column("creates", Integer, nullable=False, server_default=text("0")),  # create calls sent for it
    Column("provider_created_at", Float),
    Column("in_progress_at", Float),
    Column("ended_at", Float),
    Column("expires_at", Float),
    Column("collected_at", Float),
    Column("cancel_reason", String(16)),  # "user" (batchrun cancel) or "deadline", once cancelled at the provider
    Column("error", Text),  # why the provider refused it, or what went wrong collecting it
    Index("ix_shards_job_state", "job_id", "state"),
)

# How many of a job's items are in each state: the sum of ``n`` over a job's rows of a state.
# The database keeps it (triggers on items, below), so every write of any code path counts,
# and ``status``/``list`` read a few rows instead of counting a million items.
#
# - SQLite (one writer at a time): one row per job and state, updated by row triggers.
# - PostgreSQL (many writers): rows are only appended, one per state a statement changed
#   (statement triggers over the transition tables), so concurrent writers never wait on a
#   shared counter row; :meth:`~batchrun.ledger.store.Ledger.fold_counts` folds a job's rows
#   into one per state now and then.
#
# A migration that rebuilds ``items`` (``batch_alter_table`` on SQLite) drops the triggers with
# it and must create them again (tests/integration/test_ledger.py compares the schemas).
item_counts = Table(
    "item_counts",
    metadata,
    Column("job_id", BigId, nullable=False),
    Column("state", String(16), nullable=False),
    Column("n", BigInteger, nullable=False),
    Index("ix_item_counts_job_state", "job_id", "state"),
)

# What a job's attempts add up to (status, report, the budget's spend), kept by the database
# like item_counts (triggers on attempts, below): on PostgreSQL, rows appended per statement
# and folded now and then. A job's figures are the sums (first/last: min/max) over its rows.
# ``*_n``/``*_sum``: count and sum of each distribution's values (the attempts it covers).
attempt_totals = Table(
    "attempt_totals",
    metadata,
    Column("job_id", BigId, nullable=False),
    Column("requests", BigInteger, nullable=False),
    Column("clean", BigInteger, nullable=False),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("cached_tokens", BigInteger, nullable=False),
    Column("cost_usd", Float, nullable=False),
    Column("first_started_at", Float),
    Column("last_started_at", Float),
    Column("latency_n", BigInteger, nullable=False),
    Column("latency_sum", Float, nullable=False),
    Column("queue_wait_n", BigInteger, nullable=False),
    Column("queue_wait_sum", Float, nullable=False),
    Column("ttft_n", BigInteger, nullable=False),
    Column("ttft_sum", Float, nullable=False),
    Index("ix_attempt_totals_job", "job_id"),
)

# Items by number of attempt rows (requests, 429s included): the sum of ``n`` over a job's rows of a ``k``.
attempt_histogram = Table(
    "attempt_histogram",
    metadata,
    Column("job_id", BigId, nullable=False),
    Column("k", Integer, nullable=False),
    Column("n", BigInteger, nullable=False),
    Index("ix_attempt_histogram_job_k", "job_id", "k"),
)

COUNT_TRIGGERS = {
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

for _dialect, _statements in COUNT_TRIGGERS.items():
    for _statement in _statements:
        # After every table (items among them) exists.
        event.listen(metadata, "after_create", DDL(_statement).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]
