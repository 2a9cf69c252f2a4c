"""Read-only questions about a job's items and attempts: what status, report, compare and export read back.

Counts by state, attempt totals, nearest-rank distributions and histograms, errors
by class and by status, throughput, two jobs' shared outputs, the item rows export
streams, the items finished since a poll (results as they finish), single items and
their attempts (``batchrun show``), and what a run reads at its start (spend so far,
recent latencies). The
write side (jobs, ingest, the lock and leases, claim and record, the response
cache, user actions) is :class:`~batchrun.ledger.store.Ledger`; both work over
the same engine, and the Ledger passes on the three a run asks (so a run sees one
:class:`~batchrun.ledger.protocol.RunLedger`); these queries never call the Ledger.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, Float, Integer, and_, case, extract, func, literal_column, or_, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import DBAPIError

from batchrun.errors import LedgerError
from batchrun.ledger.basics import SHOW_FILTERS
from batchrun.ledger.engine import LEDGER_RETRY_SECONDS, is_transient
from batchrun.ledger.models import attempt_histogram as histogram_t
from batchrun.ledger.models import attempt_totals as totals_t
from batchrun.ledger.models import attempts as attempts_t
from batchrun.ledger.models import item_columns
from batchrun.ledger.models import item_counts as counts_t
from batchrun.ledger.models import items as items_t
from batchrun.ledger.models import runs as runs_t
from batchrun.ledger.records import (
    ANY_STATUS,
    MEASURE_TOTALS,
    RUN_COLUMNS,
    SQLITE_CACHED_COUNT,
    AttemptTotals,
    Distribution,
    ErrorGroup,
    RunRow,
    attempt_statuses,
    attempt_totals,
    class_groups,
    distribution,
    fill_examples,
    rank_step,
    status_groups,
)
from batchrun.states import FINISHED_STATES, OPEN_STATES, ItemState, no_counts


@dataclass(frozen=True)
class ItemRow:
    """An item as export and reports read it."""

    line: int
    custom_id: str
    state: str
    attempts: int
    status_code: int | None
    response: str | None
    output: str | None
    request_id: str | None
    error_class: str | None
    error_message: str | None
    input_tokens: int | None
    output_tokens: int | None
    latency_ms: float | None
    parsed: str | None = None
    validation_errors: str | None = None
    item_id: int = 0
    cost_usd: float | None = None
    cached_from: int | None = None  # the answer was reused from this item (the response cache)
    finished_at: float | None = None


@dataclass(frozen=True)
class SharedOutputs:
    """The custom_ids two jobs share, and how many of them both answered."""

    shared: int
    both_succeeded: int


@dataclass(frozen=True)
class ItemDetail:
    """One item as ``batchrun show`` reads it: its row, and the request it was made from."""

    row: ItemRow
    url: str | None  # None: the provider's default route
    body: str | None  # the stored request body (a rejected line has none)
    max_tokens: int | None  # a limit set by `batchrun retry --max-tokens`
    followups: str | None  # JSON [[invalid answer, feedback], ...] of its re-asks so far


@dataclass(frozen=True)
class AttemptRow:
    """One HTTP request for an item, as recorded."""

    number: int
    started_at: float
    queue_wait_ms: float | None
    latency_ms: float | None
    status_code: int | None
    error_class: str | None
    input_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None
    cost_usd: float | None
    ttft_ms: float | None
    item_id: int = 0
    ttfb_ms: float | None = None  # time to the response's headers (recorded since schema 0010)
    error_message: str | None = None  # a failed attempt's message, redacted and shortened (since 0010)


RECONNECT_PAUSE_S = 1.0  # between tries to reopen an export's cursor while the server is away
_ITEM_ROW_COLUMNS = item_columns(ItemRow, {"item_id": "id"})
_ATTEMPT_ROW_COLUMNS = tuple(attempts_t.c[f.name] for f in dataclasses.fields(AttemptRow))


class LedgerQueries:
    """The read-only queries over a ledger's engine: ``LedgerQueries(ledger.engine)``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"

    def counts(self, job_id: int) -> dict[str, int]:
        """How many of the job's items are in each state (every state present, 0 if none).

        Read from ``item_counts``, which the database keeps (models.py): a few rows, not the items.
        """
        counts = no_counts()
        with self.engine.connect() as conn:
            for state, n in conn.execute(
                select(counts_t.c.state, func.sum(counts_t.c.n)).where(counts_t.c.job_id == job_id).group_by(counts_t.c.state)
            ):
                if n:
                    counts[state] = int(n)
        return counts

    def job_runs(self, job_id: int) -> tuple[list[RunRow], float]:
        """The job's runs that have not ended, and its latest run (newest first); with the ledger's now
        (the database's clock on PostgreSQL, as heartbeats are)."""
        r = runs_t.c
        latest = select(func.max(r.started_at)).where(r.job_id == job_id).scalar_subquery()
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*(r[name] for name in RUN_COLUMNS))
                .where(r.job_id == job_id, or_(r.ended_at.is_(None), r.started_at == latest))
                .order_by(r.started_at.desc())
            ).all()
            now = time.time() if self.is_sqlite else float(
                conn.execute(select(sql_cast(extract("epoch", func.statement_timestamp()), Float))).scalar_one()
            )
        return [RunRow(*row) for row in rows], now

    def cached_count(self, job_id: int) -> int:
        """How many of the job's items hold an answer reused from another item (no request sent)."""
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "sqlite":
                return int(conn.exec_driver_sql(SQLITE_CACHED_COUNT, (job_id,)).scalar() or 0)
            return int(
                conn.execute(
                    select(func.count()).where(items_t.c.job_id == job_id, items_t.c.cached_from.is_not(None))
                ).scalar()
                or 0
            )

    def spent_usd(self, job_id: int) -> float:
        """What the job's attempts have cost so far (the sum of their ``cost_usd``): its budget's spend."""
        return self.attempt_totals(job_id).cost_usd

    def _measure(self, job_id: int, measure: str) -> tuple[Any, list[ColumnElement[bool]]]:
        """An attempt measure and the attempts it covers: clean answers for latency and TTFT, all for queue wait."""
        columns = {"latency_ms": attempts_t.c.latency_ms, "queue_wait_ms": attempts_t.c.queue_wait_ms,
                   "ttft_ms": attempts_t.c.ttft_ms}
        if measure not in columns:
            raise ValueError(f"unknown attempt measure {measure!r}")
        column = columns[measure]
        conds: list[ColumnElement[bool]] = [attempts_t.c.job_id == job_id, column.is_not(None)]
        if measure != "queue_wait_ms":
            conds.append(attempts_t.c.error_class.is_(None))
        return column, conds

    def _floor_int(self, expr: Any) -> Any:
        """``floor(expr)`` as an integer (SQLite's CAST truncates, which is floor for the non-negative values used here)."""
        return sql_cast(expr, Integer) if self.is_sqlite else sql_cast(func.floor(expr), Integer)

    def attempt_totals(self, job_id: int) -> AttemptTotals:
        """Requests sent, tokens and cost over all of the job's attempts (from ``attempt_totals``,
        which the database keeps: models.py)."""
        t = totals_t.c
        with self.engine.connect() as conn:
            row = conn.execute(
                select(
                    func.sum(t.requests), func.sum(t.clean), func.sum(t.input_tokens), func.sum(t.output_tokens),
                    func.sum(t.cached_tokens), func.sum(t.cost_usd), func.min(t.first_started_at),
                    func.max(t.last_started_at),
                ).where(t.job_id == job_id)
            ).one()
        return attempt_totals(row)

    def attempt_distribution(self, job_id: int, measure: str, percentiles: Sequence[int] = (50, 90, 99)) -> Distribution:
        """Nearest-rank percentiles of ``latency_ms``, ``queue_wait_ms`` or ``ttft_ms`` over the job's attempts.

        The count and the sum come from ``attempt_totals``; the attempts the measure covers are
        an index in the order of their values (``ix_attempts_latency``, ...), so the minimum and
        the maximum are its two ends and a percentile is one step into it from the nearer end
        (rank r of n: OFFSET r - 1 from the low end, or n - r from the high end). In one
        snapshot, so the count and the index agree.
        """
        column, conds = self._measure(job_id, measure)
        name = MEASURE_TOTALS[measure]
        with self.engine.connect() as conn:
            if not self.is_sqlite:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            n, total = conn.execute(
                select(func.sum(totals_t.c[f"{name}_n"]), func.sum(totals_t.c[f"{name}_sum"])).where(
                    totals_t.c.job_id == job_id
                )
            ).one()
            n = int(n or 0)

            def at(rank: int) -> float:
                low_end, offset = rank_step(rank, n)
                value = conn.execute(
                    select(column).where(*conds).order_by(column if low_end else column.desc()).limit(1).offset(offset)
                ).scalar()
                if value is None:  # the kept count and the attempts disagree: never, in one snapshot
                    raise LedgerError(f"job {job_id}: attempt_totals counts {n} {measure} values, the attempts fewer")
                return float(value)

            return distribution(n, total, percentiles, at)

    def answer_split(self, job_id: int, percentiles: Sequence[int] = (50, 99)) -> dict[str, Distribution]:
        """Where clean answers' time went: nearest-rank percentiles of ``queue_wait_ms`` (waiting for a
        slot), ``ttfb_ms`` (sent to the response's headers) and ``latency_ms`` (sent to the last byte).

        All three over one set of attempts, the clean answers that have a TTFB (online requests since
        migration 0010, which always have the other two); as each answer's TTFB is at most its
        latency, so is each percentile. Queue wait and latency are a step into their own index
        (``ix_attempts_queue_wait``, ``ix_attempts_latency``) from the nearer end, the set's other
        conditions checked on the way; TTFB has no index (it would cost the writer on every answer),
        so its percentiles are a sort: the report's price, not the run's. Mean and extremes are left
        out (None): the split is read for its percentiles.
        """
        a = attempts_t.c
        base = [a.job_id == job_id, a.error_class.is_(None), a.ttfb_ms.is_not(None)]
        split: dict[str, Distribution] = {}
        with self.engine.connect() as conn:
            if not self.is_sqlite:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            n = int(conn.execute(select(func.count()).where(*base)).scalar() or 0)
            for measure in ("queue_wait_ms", "ttfb_ms", "latency_ms"):
                column = a[measure]
                if not n:
                    split[measure] = Distribution(0, None, None, None, {})
                    continue
                values: dict[int, float] = {}
                for p in percentiles:
                    rank = max(1, -(-p * n // 100))
                    low_end = rank <= (n + 1) // 2
                    value = conn.execute(
                        select(column).where(*base, column.is_not(None))
                        .order_by(column if low_end else column.desc()).limit(1).offset(rank - 1 if low_end else n - rank)
                    ).scalar()
                    if value is not None:
                        values[p] = float(value)
                split[measure] = Distribution(n, None, None, None, values)
        return split

    def attempt_histogram(self, job_id: int, measure: str, low: float, width: float) -> dict[int, int]:
        """Attempts per bucket ``floor((value - low) / width)`` of a measure (values at least ``low``)."""
        column, conds = self._measure(job_id, measure)
        bucket = self._floor_int((column - float(low)) / float(width)).label("bucket")
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(bucket, func.count()).where(*conds, column >= float(low)).group_by(bucket)
            ).all()
        return {int(b): int(n) for b, n in rows}

    def succeeded_span(self, job_id: int) -> tuple[int, float | None, float | None]:
        """How many items the API answered (reused answers left out), and when the first and the last finished."""
        with self.engine.connect() as conn:
            n, first, last = conn.execute(
                select(func.count(), func.min(items_t.c.finished_at), func.max(items_t.c.finished_at)).where(
                    items_t.c.job_id == job_id,
                    items_t.c.state == ItemState.SUCCEEDED,
                    items_t.c.finished_at.is_not(None),
                    items_t.c.cached_from.is_(None),
                )
            ).one()
        return int(n), first, last

    def succeeded_per_interval(self, job_id: int, start: float, width_s: float) -> dict[int, int]:
        """Items the API answered per time bucket ``floor((finished_at - start) / width_s)`` (from ``start`` on).

        Reused answers (the response cache) are left out: they are not throughput.
        """
        bucket = self._floor_int((items_t.c.finished_at - float(start)) / float(width_s)).label("bucket")
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(bucket, func.count())
                .where(
                    items_t.c.job_id == job_id,
                    items_t.c.state == ItemState.SUCCEEDED,
                    items_t.c.finished_at >= float(start),
                    items_t.c.cached_from.is_(None),
                )
                .group_by(bucket)
            ).all()
        return {int(b): int(n) for b, n in rows}

    def errors_by_class(self, job_id: int) -> list[ErrorGroup]:
        """Per error class: failed attempts, items that ended on it (failed, invalid or rejected), one message.

        The example is an item's kept message (whole), else a failed attempt's
        (``attempts.error_message``): an item that later succeeded keeps none, but
        its attempts do. Only attempts recorded before migration 0010 have no message.
        """
        i, a = items_t.c, attempts_t.c
        with self.engine.connect() as conn:
            by_attempt: dict[Any, int] = dict(
                conn.execute(
                    select(a.error_class, func.count())
                    .where(a.job_id == job_id, a.error_class.is_not(None))
                    .group_by(a.error_class)
                ).all()
            )
            by_item_state = conn.execute(
                select(i.error_class, i.state, func.count())
                .where(
                    i.job_id == job_id,
                    i.state.in_([ItemState.FAILED, ItemState.INVALID_OUTPUT, ItemState.REJECTED]),
                    i.error_class.is_not(None),
                )
                .group_by(i.error_class, i.state)
            ).all()
            examples: dict[Any, str] = dict(
                conn.execute(
                    select(i.error_class, func.max(i.error_message))
                    .where(i.job_id == job_id, i.error_class.is_not(None), i.error_message.is_not(None))
                    .group_by(i.error_class)
                ).all()
            )
            fill_examples(examples, {key: [key] for key in by_attempt},
                          lambda key, error_class: self._attempt_example(conn, job_id, error_class))
        return class_groups(by_attempt, [(k, st, int(n)) for k, st, n in by_item_state], examples)

    @staticmethod
    def _attempt_example(conn: Any, job_id: int, error_class: str, status: Any = ANY_STATUS) -> str | None:
        """One failed attempt's message of this class (and status): a seek into ``ix_attempts_errors``
        (job, class), reading the class's rows only until one has a message (every row since 0010)."""
        a = attempts_t.c
        conds: list[ColumnElement[bool]] = [
            a.job_id == job_id, a.error_class == error_class, a.error_message.is_not(None)
        ]
        if status is not ANY_STATUS:
            conds.append(a.status_code.is_(None) if status is None else a.status_code == status)
        value = conn.execute(select(a.error_message).where(*conds).limit(1)).scalar()
        return None if value is None else str(value)

    def errors_by_status(self, job_id: int) -> list[ErrorGroup]:
        """Per HTTP error status (None: no response, e.g. a timeout or reset): failed attempts, failed items,
        one message. A 2xx is no error status: its failures (invalid output, a truncated answer) are classes.

        The example is a kept item's message, else a failed attempt's (as for :meth:`errors_by_class`).
        """
        i, a = items_t.c, attempts_t.c
        with self.engine.connect() as conn:
            by_attempt, classes = attempt_statuses(  # classes: status -> the classes its failed attempts had
                conn.execute(
                    select(a.status_code, a.error_class, func.count())
                    .where(a.job_id == job_id, a.error_class.is_not(None))
                    .group_by(a.status_code, a.error_class)
                ).all()
            )
            by_item: dict[Any, int] = dict(
                conn.execute(
                    select(i.status_code, func.count())
                    .where(i.job_id == job_id, i.state == ItemState.FAILED)
                    .group_by(i.status_code)
                ).all()
            )
            # The state is chosen inside the aggregate, not in WHERE: then only ix_items_errors (the
            # items with an error) serves the query, never the claim index's million pending items.
            kept = i.state.in_([ItemState.PENDING, ItemState.RUNNING, ItemState.FAILED, ItemState.CANCELLED])
            examples: dict[Any, str] = dict(
                conn.execute(
                    select(i.status_code, func.max(case((kept, i.error_message))))
                    .where(i.job_id == job_id, i.error_class.is_not(None), i.error_message.is_not(None))
                    .group_by(i.status_code)
                ).all()
            )
            fill_examples(examples, classes,
                          lambda status, error_class: self._attempt_example(conn, job_id, error_class, status))
        return status_groups(by_attempt, by_item, examples)

    def requests_per_item(self, job_id: int) -> dict[int, int]:
        """How many items had n requests sent (n >= 1; an attempt row is a request, 429s included),
        from ``attempt_histogram``, which the database keeps (models.py)."""
        h = histogram_t.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(h.k, func.sum(h.n)).where(h.job_id == job_id).group_by(h.k)).all()
        return {int(k): int(n) for k, n in rows if k >= 1 and n}

    @staticmethod
    def _shared_items(job_a: int, job_b: int) -> tuple[Any, Any, Any, list[ColumnElement[bool]]]:
        """A's and B's items joined on custom_id (rejected lines left out): (a, b, join, where)."""
        a, b = items_t.alias("a"), items_t.alias("b")
        # Written out, not bound, so SQLite matches the partial unique index on (job_id, custom_id).
        rejected: ColumnElement[str] = literal_column("'rejected'")
        on = and_(b.c.job_id == job_b, b.c.custom_id == a.c.custom_id, b.c.state != rejected)
        return a, b, a.join(b, on), [a.c.job_id == job_a, a.c.state != rejected]

    def shared_outputs(self, job_a: int, job_b: int) -> SharedOutputs:
        """How many custom_ids jobs A and B share, and for how many both succeeded."""
        a, b, joined, conds = self._shared_items(job_a, job_b)
        both = case((and_(a.c.state == ItemState.SUCCEEDED, b.c.state == ItemState.SUCCEEDED), 1), else_=0)
        with self.engine.connect() as conn:
            n, ok = conn.execute(select(func.count(), func.coalesce(func.sum(both), 0)).select_from(joined).where(*conds)).one()
        return SharedOutputs(shared=int(n), both_succeeded=int(ok))

    def iter_output_differences(
        self, job_a: int, job_b: int, column: str, *, chunk: int = 2000
    ) -> Iterator[tuple[str, str | None, str | None]]:
        """(custom_id, A's value, B's value) where both succeeded and ``column`` (output or parsed) differs as text.

        In A's input order, read in bounded chunks (keyset pagination on A's line).
        """
        if column not in ("output", "parsed"):
            raise ValueError(f"cannot compare items on {column!r}")
        a, b, joined, conds = self._shared_items(job_a, job_b)
        conds = [
            *conds,
            a.c.state == ItemState.SUCCEEDED,
            b.c.state == ItemState.SUCCEEDED,
            a.c[column].is_distinct_from(b.c[column]),
        ]
        last = -1
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    select(a.c.line, a.c.custom_id, a.c[column], b.c[column])
                    .select_from(joined)
                    .where(*conds, a.c.line > last)
                    .order_by(a.c.line)
                    .limit(chunk)
                ).all()
            if not rows:
                return
            for _, custom_id, value_a, value_b in rows:
                yield custom_id, value_a, value_b
            last = rows[-1][0]

    def shadowed_rejections(self, job_id: int) -> set[int]:
        """Ids of rejected items whose custom_id another line already uses.

        Output has one line per custom_id: such a rejected line is listed only
        in the errors file. Rejected lines are few, so this is a small query.
        """
        rejected = (
            select(items_t.c.id, items_t.c.line, items_t.c.custom_id)
            .where(items_t.c.job_id == job_id, items_t.c.state == ItemState.REJECTED)
            .subquery()
        )
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(rejected.c.id, rejected.c.custom_id).order_by(rejected.c.line)
            ).all()
            if not rows:
                return set()
            taken = set(
                conn.execute(
                    select(items_t.c.custom_id).where(
                        items_t.c.job_id == job_id,
                        items_t.c.state != ItemState.REJECTED,
                        items_t.c.custom_id.in_(select(rejected.c.custom_id)),
                    )
                ).scalars()
            )
        shadowed: set[int] = set()
        seen: set[str] = set()
        for item_id, custom_id in rows:
            if custom_id in taken or custom_id in seen:
                shadowed.add(item_id)
            seen.add(custom_id)
        return shadowed

    def recent_latencies(self, job_id: int, limit: int) -> list[float]:
        """Seconds taken by the job's latest clean attempts, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(attempts_t.c.latency_ms)
                .where(attempts_t.c.job_id == job_id, attempts_t.c.error_class.is_(None), attempts_t.c.latency_ms.is_not(None))
                .order_by(attempts_t.c.id.desc())
                .limit(limit)
            ).scalars()
            return [ms / 1000.0 for ms in reversed(list(rows))]

    def iter_items(self, job_id: int, *, chunk: int = 2000) -> Iterator[ItemRow]:
        """Every item of the job in input order, read in bounded chunks."""
        cols = _ITEM_ROW_COLUMNS
        if not self.is_sqlite:
            # One query through a server-side cursor: rows arrive ``chunk`` at a time. If the
            # session ends meanwhile (this process stalled mid-export past PostgreSQL's
            # idle-in-transaction timeout, or the server restarted), a new cursor carries on
            # after the last line read, once the server answers again (for up to
            # LEDGER_RETRY_SECONDS without a row read).
            last, stuck_since = -1, None
            while True:
                try:
                    with self.engine.connect() as conn:
                        result = conn.execution_options(stream_results=True, yield_per=chunk).execute(
                            select(*cols).where(items_t.c.job_id == job_id, items_t.c.line > last)
                            .order_by(items_t.c.line)
                        )
                        try:
                            for r in result:
                                row = ItemRow(*r)
                                last = row.line
                                yield row
                        finally:
                            with suppress(DBAPIError):
                                result.close()  # also when the caller stops early: the cursor goes now
                    return
                except DBAPIError as exc:
                    if not is_transient(exc):
                        raise
                    if stuck_since is None or stuck_since[0] != last:
                        stuck_since = (last, time.monotonic())
                    elif time.monotonic() - stuck_since[1] > LEDGER_RETRY_SECONDS:
                        raise
                    time.sleep(RECONNECT_PAUSE_S)
        # SQLite: keyset pages, so no read transaction stays open (and holds back the WAL) for the export.
        last = -1
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    select(*cols)
                    .where(items_t.c.job_id == job_id, items_t.c.line > last)
                    .order_by(items_t.c.line)
                    .limit(chunk)
                ).all()
            if not rows:
                return
            for r in rows:
                yield ItemRow(*r)
            last = rows[-1].line


    # -- results as they finish (batchrun.collect) -----------------------------------------

    def finished_frontier(self, job_id: int) -> int:
        """An id below which every item of the job is finished: the lowest open (pending or running)
        item's, else one past the highest id. Items stored later (an ingest still running) get higher ids.

        One index lookup per open state, and one for the highest id.
        """
        i = items_t.c
        with self.engine.connect() as conn:
            lowest = [
                conn.execute(select(func.min(i.id)).where(i.job_id == job_id, i.state == state)).scalar()
                for state in OPEN_STATES
            ]
            open_ids = [int(x) for x in lowest if x is not None]
            if open_ids:
                return min(open_ids)
            highest = conn.execute(select(func.max(i.id)).where(i.job_id == job_id)).scalar()
        return int(highest) + 1 if highest is not None else 0

    def finished_ids(self, job_id: int, from_id: int) -> list[int]:
        """Ids of the job's finished items (any of FINISHED_STATES) from ``from_id`` on, ascending.

        Read from the claim index (job, state, id) alone: the table's rows are not touched.
        """
        i = items_t.c
        with self.engine.connect() as conn:
            ids = conn.execute(
                select(i.id).where(i.job_id == job_id, i.state.in_(list(FINISHED_STATES)), i.id >= from_id)
            ).scalars().all()
        return sorted(int(x) for x in ids)

    def items_by_id(self, job_id: int, ids: Sequence[int], *, chunk: int = 500) -> list[ItemRow]:
        """The job's items with these ids, in the order they finished (then input order)."""
        rows: list[ItemRow] = []
        with self.engine.connect() as conn:
            for start in range(0, len(ids), chunk):
                part = list(ids[start : start + chunk])
                rows += [
                    ItemRow(*r)
                    for r in conn.execute(
                        select(*_ITEM_ROW_COLUMNS).where(items_t.c.job_id == job_id, items_t.c.id.in_(part))
                    )
                ]
        rows.sort(key=lambda r: (r.finished_at or 0.0, r.line))
        return rows

    # -- single items and their attempts (batchrun show) ----------------------------------

    def find_items(self, job_id: int, where: Mapping[str, Any] | None = None, *, limit: int = 20) -> list[ItemDetail]:
        """The job's first ``limit`` items in input order whose columns equal ``where``
        (keys among SHOW_FILTERS: ValueError for any other)."""
        i = items_t.c
        conds: list[ColumnElement[bool]] = [i.job_id == job_id]
        for column, value in (where or {}).items():
            if column not in SHOW_FILTERS:
                raise ValueError(f"items cannot be chosen by {column!r}: only by {', '.join(SHOW_FILTERS)}")
            conds.append(i[column] == value)
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*_ITEM_ROW_COLUMNS, i.url, i.body, i.max_tokens, i.followups)
                .where(*conds).order_by(i.line).limit(limit)
            ).all()
        n = len(_ITEM_ROW_COLUMNS)
        return [ItemDetail(ItemRow(*r[:n]), *r[n:]) for r in rows]

    def item_attempts(self, job_id: int, item_ids: Sequence[int]) -> dict[int, list[AttemptRow]]:
        """Each item's attempts, in the order they were sent (an item without any has an empty list)."""
        found: dict[int, list[AttemptRow]] = {item_id: [] for item_id in item_ids}
        if not item_ids:
            return found
        a = attempts_t.c
        with self.engine.connect() as conn:
            for r in conn.execute(
                select(*_ATTEMPT_ROW_COLUMNS).where(a.job_id == job_id, a.item_id.in_(list(item_ids)))
                .order_by(a.started_at, a.id)
            ):
                attempt = AttemptRow(*r)
                found[attempt.item_id].append(attempt)
        return found
