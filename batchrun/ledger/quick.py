"""The quick reader: what ``status`` and ``list`` read of a SQLite ledger, with the stdlib's ``sqlite3``.

A command that only reads (``status`` without ``--watch``, ``list``) would spend most of its
time importing SQLAlchemy (~0.3 s of a 0.4 s ``status`` on this kind of machine), not in its
queries, which read the counts the database keeps (``item_counts``, ``attempt_totals``,
``attempt_histogram``) and step into the ``ix_attempts_*`` indexes. :func:`open_quick_reader`
opens the file read-only (``mode=ro``: it never creates, migrates or writes anything) and
returns a reader only when the ledger's schema is the head this code knows
(:data:`~batchrun.ledger.basics.SCHEMA_HEAD`); for PostgreSQL, an older or newer schema, or a
file it cannot read, it returns None and the command goes through SQLAlchemy as before.

Each method asks what :class:`~batchrun.ledger.queries.LedgerQueries` asks, in the same SQL,
and folds the rows with the same steps (records.py); tests/acceptance/test_quick_status.py
checks that ``status`` and ``list`` print the same bytes through both.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from batchrun.ledger.basics import SCHEMA_HEAD, SQLITE_BUSY_TIMEOUT_MS, resolve_db_url
from batchrun.ledger.records import (
    ANY_STATUS,
    JOB_COLUMNS,
    MEASURE_TOTALS,
    RUN_COLUMNS,
    SQLITE_CACHED_COUNT,
    AttemptTotals,
    Distribution,
    ErrorGroup,
    JobRecord,
    RunRow,
    ShardRecord,
    answered_routes,
    attempt_statuses,
    attempt_totals,
    class_groups,
    distribution,
    fill_examples,
    job_not_found,
    job_record,
    rank_step,
    shard_record,
    status_groups,
    turnaround_seconds,
)
from batchrun.errors import LedgerError
from batchrun.states import ItemState, no_counts

# The attempts each measure covers (LedgerQueries._measure), as the partial ix_attempts_* indexes say.
_MEASURE_WHERE = {
    "latency_ms": "latency_ms IS NOT NULL AND error_class IS NULL",
    "queue_wait_ms": "queue_wait_ms IS NOT NULL",
    "ttft_ms": "ttft_ms IS NOT NULL AND error_class IS NULL",
}
_JOB_SELECT = ", ".join(JOB_COLUMNS)
_SHARD_SELECT = ", ".join(f.name for f in dataclasses.fields(ShardRecord))  # the shards columns, by name
_FINISHED_WITH_ERROR = (ItemState.FAILED.value, ItemState.INVALID_OUTPUT.value, ItemState.REJECTED.value)
_KEEPS_MESSAGE = (ItemState.PENDING.value, ItemState.RUNNING.value, ItemState.FAILED.value, ItemState.CANCELLED.value)


def open_quick_reader(db: str | os.PathLike[str] | None) -> QuickReader | None:
    """A read-only reader of the SQLite ledger at ``db`` if its schema is the head, else None
    (PostgreSQL, another revision, not a ledger, or a file ``sqlite3`` cannot open read-only)."""
    url = resolve_db_url(db)
    if not url.startswith("sqlite:///") or ("://" in str(db) and "?" in url):
        return None  # a database server, or a URL with driver options: SQLAlchemy's to read
    path = Path(url.removeprefix("sqlite:///"))
    uri = f"{path.as_uri()}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        revision = None  # not a ledger (yet), or not a database: the usual path says what it is
    if revision is None or revision[0] != SCHEMA_HEAD:
        conn.close()
        return None
    return QuickReader(conn, url, uri)


class QuickReader:
    """A :class:`~batchrun.ledger.protocol.StatusReader` over one read-only ``sqlite3`` connection."""

    def __init__(self, conn: sqlite3.Connection, url: str, uri: str) -> None:
        self.conn = conn
        self.url = url
        self.uri = uri  # the file's read-only URI, for the connections of attempt_distributions' threads

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> QuickReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction (a snapshot), as each LedgerQueries call is."""
        self.conn.execute("BEGIN")
        try:
            yield self.conn
        finally:
            self.conn.execute("COMMIT")

    def _rows(self, sql: str, *params: Any) -> list[Any]:
        with self._read() as conn:
            return conn.execute(sql, params).fetchall()

    # -- jobs -----------------------------------------------------------------

    def get_job(self, job_id: int) -> JobRecord:
        with self._read() as conn:
            rows = _named(conn.execute(f"SELECT {_JOB_SELECT} FROM jobs WHERE id = ?", (job_id,)))
        if not rows:
            raise job_not_found(job_id, self.url)
        return job_record(rows[0])

    def list_jobs(self) -> list[tuple[JobRecord, dict[str, int]]]:
        with self._read() as conn:
            jobs = [job_record(row) for row in _named(conn.execute(f"SELECT {_JOB_SELECT} FROM jobs ORDER BY id"))]
            counts: dict[int, dict[str, int]] = {job.id: no_counts() for job in jobs}
            for job_id, state, n in conn.execute("SELECT job_id, state, sum(n) FROM item_counts GROUP BY job_id, state"):
                if job_id in counts and n:
                    counts[job_id][state] = int(n)
        return [(job, counts[job.id]) for job in jobs]

    def counts(self, job_id: int) -> dict[str, int]:
        counts = no_counts()
        for state, n in self._rows("SELECT state, sum(n) FROM item_counts WHERE job_id = ? GROUP BY state", job_id):
            if n:
                counts[state] = int(n)
        return counts

    def cached_count(self, job_id: int) -> int:
        (n,), = self._rows(SQLITE_CACHED_COUNT, job_id)
        return int(n or 0)

    # -- attempts -------------------------------------------------------------

    def attempt_totals(self, job_id: int) -> AttemptTotals:
        (row,) = self._rows(
            "SELECT sum(requests), sum(clean), sum(input_tokens), sum(output_tokens), sum(cached_tokens), "
            "sum(cost_usd), min(first_started_at), max(last_started_at) FROM attempt_totals WHERE job_id = ?",
            job_id,
        )
        return attempt_totals(row)

    def attempt_distribution(self, job_id: int, measure: str, percentiles: Sequence[int] = (50, 90, 99)) -> Distribution:
        with self._read() as conn:
            return _distribution(conn, job_id, measure, percentiles)

    def attempt_distributions(
        self, job_id: int, measures: Sequence[str], percentiles: Sequence[int] = (50, 90, 99)
    ) -> dict[str, Distribution]:
        """:meth:`attempt_distribution` of each measure, the others' steps into their indexes on threads of their
        own (a connection each: sqlite3 lets the GIL go while it steps): on 1,000,000 attempts those steps are
        most of ``status``'s queries, and a second core does one while this one does another."""
        found: dict[str, Distribution] = {}
        errors: list[BaseException] = []

        def read(measure: str) -> None:
            try:
                conn = sqlite3.connect(self.uri, uri=True, timeout=SQLITE_BUSY_TIMEOUT_MS / 1000, isolation_level=None)
                try:
                    conn.execute("BEGIN")
                    found[measure] = _distribution(conn, job_id, measure, percentiles)
                finally:
                    conn.close()
            except BaseException as exc:  # raised in the caller's thread below
                errors.append(exc)

        threads = [threading.Thread(target=read, args=(m,), daemon=True) for m in measures[1:]]
        for thread in threads:
            thread.start()
        try:
            if measures:
                found[measures[0]] = self.attempt_distribution(job_id, measures[0], percentiles)
        finally:
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]
        return {m: found[m] for m in measures}

    def errors_by_class(self, job_id: int) -> list[ErrorGroup]:
        with self._read() as conn:
            by_attempt = dict(conn.execute(
                "SELECT error_class, count(*) FROM attempts WHERE job_id = ? AND error_class IS NOT NULL "
                "GROUP BY error_class", (job_id,)
            ).fetchall())
            by_item_state = conn.execute(
                "SELECT error_class, state, count(*) FROM items WHERE job_id = ? AND state IN (?, ?, ?) "
                "AND error_class IS NOT NULL GROUP BY error_class, state", (job_id, *_FINISHED_WITH_ERROR)
            ).fetchall()
            examples = dict(conn.execute(
                "SELECT error_class, max(error_message) FROM items WHERE job_id = ? AND error_class IS NOT NULL "
                "AND error_message IS NOT NULL GROUP BY error_class", (job_id,)
            ).fetchall())
            fill_examples(examples, {key: [key] for key in by_attempt},
                          lambda key, error_class: _attempt_example(conn, job_id, error_class))
        return class_groups(by_attempt, [(k, st, int(n)) for k, st, n in by_item_state], examples)

    def errors_by_status(self, job_id: int) -> list[ErrorGroup]:
        with self._read() as conn:
            by_attempt, classes = attempt_statuses(conn.execute(
                "SELECT status_code, error_class, count(*) FROM attempts WHERE job_id = ? AND error_class IS NOT NULL "
                "GROUP BY status_code, error_class", (job_id,)
            ).fetchall())
            by_item = dict(conn.execute(
                "SELECT status_code, count(*) FROM items WHERE job_id = ? AND state = ? GROUP BY status_code",
                (job_id, ItemState.FAILED.value),
            ).fetchall())
            # The state inside the aggregate, as LedgerQueries does: only ix_items_errors serves it.
            examples = dict(conn.execute(
                "SELECT status_code, max(CASE WHEN (state IN (?, ?, ?, ?)) THEN error_message END) FROM items "
                "WHERE job_id = ? AND error_class IS NOT NULL AND error_message IS NOT NULL GROUP BY status_code",
                (*_KEEPS_MESSAGE, job_id),
            ).fetchall())
            fill_examples(examples, classes,
                          lambda status, error_class: _attempt_example(conn, job_id, error_class, status))
        return status_groups(by_attempt, by_item, examples)

    def requests_per_item(self, job_id: int) -> dict[int, int]:
        rows = self._rows("SELECT k, sum(n) FROM attempt_histogram WHERE job_id = ? GROUP BY k", job_id)
        return {int(k): int(n) for k, n in rows if k >= 1 and n}

    # -- runs and shards ------------------------------------------------------

    def job_runs(self, job_id: int) -> tuple[list[RunRow], float]:
        rows = self._rows(
            f"SELECT {', '.join(RUN_COLUMNS)} FROM runs WHERE job_id = ? AND (ended_at IS NULL OR started_at = "
            "(SELECT max(started_at) FROM runs WHERE job_id = ?)) ORDER BY started_at DESC",
            job_id, job_id,
        )
        return [RunRow(*row) for row in rows], time.time()

    def shards(self, job_id: int) -> list[ShardRecord]:
        with self._read() as conn:
            rows = _named(conn.execute(f"SELECT {_SHARD_SELECT} FROM shards WHERE job_id = ? ORDER BY id", (job_id,)))
        return [shard_record(row) for row in rows]

    def turnarounds(self, kind: str, limit: int = 200) -> list[float]:
        rows = self._rows(
            "SELECT ended_at - coalesce(provider_created_at, created_at) FROM shards "
            "WHERE kind = ? AND ended_at IS NOT NULL ORDER BY id DESC LIMIT ?", kind, limit,
        )
        return turnaround_seconds(r[0] for r in rows)

    def answered_by_route(self, job_id: int) -> dict[str, int]:
        route = "CASE WHEN (cached_from IS NOT NULL) THEN 'cache' WHEN (shard_id IS NOT NULL) THEN 'batch' ELSE 'online' END"
        return answered_routes(self._rows(
            f"SELECT {route}, count(*) FROM items WHERE job_id = ? AND state = ? GROUP BY {route}",
            job_id, ItemState.SUCCEEDED.value,
        ))


def _attempt_example(conn: sqlite3.Connection, job_id: int, error_class: str, status: Any = ANY_STATUS) -> str | None:
    """LedgerQueries._attempt_example: one failed attempt's message of this class (and status)."""
    sql = "SELECT error_message FROM attempts WHERE job_id = ? AND error_class = ? AND error_message IS NOT NULL"
    args: list[Any] = [job_id, error_class]
    if status is not ANY_STATUS:
        sql += " AND status_code IS NULL" if status is None else " AND status_code = ?"
        args += [] if status is None else [status]
    row = conn.execute(sql + " LIMIT 1", args).fetchone()
    return None if row is None else str(row[0])


def _named(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """A cursor's rows as {column: value}."""
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _distribution(conn: sqlite3.Connection, job_id: int, measure: str, percentiles: Sequence[int]) -> Distribution:
    """One measure's distribution, in the read transaction open on ``conn``."""
    if measure not in _MEASURE_WHERE:
        raise ValueError(f"unknown attempt measure {measure!r}")
    name = MEASURE_TOTALS[measure]
    n, total = conn.execute(f"SELECT sum({name}_n), sum({name}_sum) FROM attempt_totals WHERE job_id = ?", (job_id,)).fetchone()
    n = int(n or 0)
    # The same statement as LedgerQueries': one step into ix_attempts_<name> from its nearer end.
    select = f"SELECT {measure} FROM attempts WHERE job_id = ? AND {_MEASURE_WHERE[measure]} ORDER BY {measure}"

    def at(rank: int) -> float:
        low_end, offset = rank_step(rank, n)
        row = conn.execute(f"{select}{'' if low_end else ' DESC'} LIMIT 1 OFFSET ?", (job_id, offset)).fetchone()
        if row is None or row[0] is None:
            raise LedgerError(f"job {job_id}: attempt_totals counts {n} {measure} values, the attempts fewer")
        return float(row[0])

    return distribution(n, total, percentiles, at)
