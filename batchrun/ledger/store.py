"""The Ledger: the write side of the job database, behind intention-named methods.

Jobs, ingest, runs and the job lock, leases (claim, heartbeat, sweeps), outcomes
and attempts (record), the response cache's look-up, the user's retry and cancel,
exports. The read-only questions status, report and export ask are
:class:`~batchrun.ledger.queries.LedgerQueries`, over the same engine; the three a
run asks (counts, spend so far, recent latencies) the Ledger answers too, so a run
needs nothing but a :class:`~batchrun.ledger.protocol.RunLedger`. Calling either
from the event loop goes through :class:`~batchrun.ledger.facade.AsyncLedger`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Float,
    bindparam,
    delete,
    exists,
    extract,
    func,
    insert,
    literal,
    or_,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import OperationalError
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.sqlite import insert as _sqlite_insert

from batchrun.errors import JobLockedError, LedgerBusyError, LockLostError
from batchrun.hints import command
from batchrun.redact import redact
from batchrun.ledger.basics import RETRY_FILTERS
from batchrun.ledger.engine import SQLITE_BUSY_TIMEOUT_MS, WRITE_OPTION, open_engine
from batchrun.ledger.models import attempts as attempts_t
from batchrun.ledger.models import exports as exports_t
from batchrun.ledger.models import item_columns
from batchrun.ledger.models import item_counts as counts_t
from batchrun.ledger.models import items as items_t
from batchrun.ledger.models import jobs as jobs_t
from batchrun.ledger.models import rate_buckets as buckets_t
from batchrun.ledger.models import runs as runs_t
from batchrun.ledger.models import shards as shards_t
from batchrun.ledger.queries import LedgerQueries
from batchrun.ledger.records import JobRecord, job_not_found, job_record, pid_alive
from batchrun.spec import JobSpec
from batchrun.states import OPEN_SHARD_STATES, ItemState, no_counts


_FOLD_LOCK_KEY = 0x636F756E  # "coun": the PostgreSQL advisory lock (with the job id) around a fold of its counts
_TOTALS = ("requests", "clean", "input_tokens", "output_tokens", "cached_tokens", "cost_usd", "latency_n", "latency_sum",
           "queue_wait_n", "queue_wait_sum", "ttft_n", "ttft_sum")
_FOLDS = (
    "WITH gone AS (DELETE FROM item_counts WHERE job_id = :job RETURNING state, n) "
    "INSERT INTO item_counts (job_id, state, n) SELECT :job, state, sum(n) FROM gone GROUP BY state",
    "WITH gone AS (DELETE FROM attempt_histogram WHERE job_id = :job RETURNING k, n) "
    "INSERT INTO attempt_histogram (job_id, k, n) SELECT :job, k, sum(n) FROM gone GROUP BY k",
    f"WITH gone AS (DELETE FROM attempt_totals WHERE job_id = :job RETURNING *) "
    f"INSERT INTO attempt_totals (job_id, {', '.join(_TOTALS)}, first_started_at, last_started_at) "
    f"SELECT :job, {', '.join(f'sum({c})' for c in _TOTALS)}, min(first_started_at), max(last_started_at) "
    "FROM gone HAVING count(*) > 0",
)

# An ``exports`` row with this hash is not a file written but where the job is to be written
# (Ledger.set_export_target); ERRORS_TARGET is the format of its errors file's row.
TARGET_SHA = ""
ERRORS_TARGET = "errors"


@dataclass(frozen=True)
class LockHolder:
    run_id: str
    pid: int
    host: str
    since: float
    heartbeat: float


@dataclass(frozen=True)
class ClaimedItem:
    """An item leased to a run: what is needed to send it."""

    id: int
    custom_id: str
    url: str | None
    body: str
    attempts: int
    max_tokens: int | None = None
    followups: str | None = None  # JSON [[invalid answer, feedback], ...]: re-asks a killed run committed
    claim: int = 0  # the run's number for the claim that leased it; its outcomes carry it


@dataclass(frozen=True)
class CachedAnswer:
    """A succeeded item's answer, as a later item reuses it (the response cache, batchrun/cache.py)."""

    item_id: int  # the item that paid for the answer (never itself a reused one)
    status_code: int | None
    response: str | None
    output: str | None
    parsed: str | None
    request_id: str | None
    input_tokens: int | None
    output_tokens: int | None


@dataclass
class Outcome:
    """The result of working an item, written back in a batch."""

    item_id: int
    state: str
    attempts: int
    status_code: int | None = None
    response: str | None = None
    output: str | None = None
    parsed: str | None = None
    validation_errors: str | None = None
    request_id: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    latency_ms: float | None = None
    finished_at: float | None = None
    cost_usd: float | None = None
    request_hash: str | None = None  # the response cache's key of the item's first request
    cached_from: int | None = None  # the item whose answer was reused (no request was sent)
    followups: str | None = None  # state RUNNING: the re-asks so far (JSON), kept for a resume
    claim: int = 0  # the claim of the item it answers: it lands only on that claim (see ClaimedItem)


@dataclass
class AttemptRecord:
    """One HTTP request for an item."""

    job_id: int
    item_id: int
    run_id: str
    number: int
    started_at: float
    queue_wait_ms: float | None
    latency_ms: float | None
    status_code: int | None
    error_class: str | None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    cost_usd: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    counted: bool = True  # counts against max_attempts (not a 429, an auth refusal or an outage)
    seq: int | None = None  # the run's own number for it (unique per run): a replayed write adds it once
    shard_id: int | None = None  # batch mode: the shard whose results line it is (None: an online request)
    error_message: str | None = None  # a failed attempt's message: use :func:`attempt_message`
    ttfb_ms: float | None = None  # time to the response's headers (an online request that got one)


ATTEMPT_MESSAGE_CHARS = 500  # what an attempt row keeps of its error's message (the item keeps it whole)


def attempt_message(message: str | None) -> str | None:
    """A failed attempt's message as its row keeps it: secrets masked, at most ATTEMPT_MESSAGE_CHARS."""
    if message is None:
        return None
    message = redact(message)
    return message if len(message) <= ATTEMPT_MESSAGE_CHARS else message[: ATTEMPT_MESSAGE_CHARS - 1] + "…"


_ITEM_INSERT_COLUMNS = (
    "job_id", "line", "custom_id", "url", "body", "state", "attempts", "error_class", "error_message",
)
# PostgreSQL ingest: COPY into a per-connection temporary table, then one INSERT ... SELECT
# that skips taken custom_ids (COPY itself cannot ON CONFLICT).
_PG_STAGE_ITEMS = (
    "CREATE TEMPORARY TABLE IF NOT EXISTS batchrun_items_in (job_id bigint, line integer, custom_id text, "
    "url text, body text, state varchar(16), attempts integer, error_class varchar(64), error_message text) "
    "ON COMMIT DELETE ROWS"
)
_PG_INSERT_STAGED = (
    f"INSERT INTO items ({', '.join(_ITEM_INSERT_COLUMNS)}) "
    f"SELECT {', '.join(_ITEM_INSERT_COLUMNS)} FROM batchrun_items_in ORDER BY line "
    "ON CONFLICT DO NOTHING RETURNING line"
)
_SQLITE_INSERT_ITEMS = (
    f"INSERT INTO items ({', '.join(_ITEM_INSERT_COLUMNS)}) VALUES ({', '.join('?' * len(_ITEM_INSERT_COLUMNS))}) "
    "ON CONFLICT DO NOTHING"
)

# What a final outcome writes, and what going back to pending keeps of the last attempt.
FINAL_COLUMNS = (
    "state", "status_code", "response", "output", "parsed", "validation_errors", "request_id", "error_class",
    "error_message", "input_tokens", "output_tokens", "latency_ms", "finished_at", "cost_usd", "request_hash",
    "cached_from", "followups",
)
BACK_COLUMNS = ("status_code", "error_class", "error_message")
_NOT_FINAL = (ItemState.PENDING, ItemState.RUNNING)  # outcomes that leave the item unanswered
# States in which an item has no answer: a success may land there, whoever holds the item.
# A cancelled item too: an answer in flight when the user cancelled was paid for, and is kept.
UNANSWERED = (
    ItemState.PENDING, ItemState.RUNNING, ItemState.SUBMITTED, ItemState.FAILED, ItemState.INVALID_OUTPUT,
    ItemState.CANCELLED,
)
_ATTEMPT_COLUMNS = tuple(f.name for f in dataclasses.fields(AttemptRecord) if f.name != "counted")
# The writer's hot path on SQLite goes straight to the driver's executemany (as ingest does):
# SQLAlchemy's per-row parameter processing cost about as much as the writes themselves.
_SQLITE_INSERT_ATTEMPTS = (
    f"INSERT INTO attempts ({', '.join(_ATTEMPT_COLUMNS)}) VALUES ({', '.join('?' * len(_ATTEMPT_COLUMNS))})"
)
_SQLITE_CHARGE_ATTEMPTS = "UPDATE items SET attempts = attempts + ? WHERE id = ?"
_SQLITE_HELD = "WHERE id = ? AND lease_owner = ? AND lease_claim = ? AND state = 'running'"
# A success lands on an item that has no answer yet, whoever holds it (the first committed answer wins).
_SQLITE_UNANSWERED = f"WHERE id = ? AND state IN ({', '.join(repr(str(s)) for s in UNANSWERED)})"
_SQLITE_SET_FINAL = (
    f"UPDATE items SET {', '.join(f'{c} = ?' for c in FINAL_COLUMNS)}, lease_owner = NULL, lease_expires = NULL, "
    "lease_claim = NULL "
)
_SQLITE_FINISH = _SQLITE_SET_FINAL + _SQLITE_HELD
_SQLITE_LAND = _SQLITE_SET_FINAL + _SQLITE_UNANSWERED
_SQLITE_PUT_BACK = (
    f"UPDATE items SET {', '.join(f'{c} = ?' for c in BACK_COLUMNS)}, state = 'pending', lease_owner = NULL, "
    "lease_expires = NULL, lease_claim = NULL " + _SQLITE_HELD
)


_CLAIMED_COLUMNS = item_columns(ClaimedItem, {"claim": "lease_claim"})
_SQLITE_PROGRESS = "UPDATE items SET followups = ? " + _SQLITE_HELD


def _no_nul(value: Any) -> Any:
    """PostgreSQL text cannot hold NUL: store U+FFFD instead (model output can contain it)."""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) and "\x00" in value else value


def _any_nul(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether any text of an ingest batch holds a NUL (rare: only from a decoded JSON string)."""
    return any(
        "\x00" in "\x01".join(r.get(key) or "" for r in rows)
        for key in ("custom_id", "url", "body", "error_class", "error_message")
    )


def _same_job(conn: Any, spec: JobSpec, input_hash: str) -> tuple[int, bool] | None:
    """The newest job with this spec's identity and this input content, one that reads its key where
    ``spec`` does first: (its id, whether its stored hash is the current one).

    A job whose stored hash is of an earlier version (one that counted where the key is read
    from) is found by its stored spec's hash; the jobs of one input are few. The caller stores
    the current hash on a job found that way (:func:`_rehash`).
    """
    spec_hash = spec.identity_hash()
    key_source = (spec.provider.api_key_env, spec.provider.api_key_file)
    same: list[tuple[int, bool, bool]] = []  # (job, reads its key where spec does, stored hash is current)
    for job_id, stored_hash, spec_json in conn.execute(
        select(jobs_t.c.id, jobs_t.c.spec_hash, jobs_t.c.spec_json)
        .where(jobs_t.c.input_hash == input_hash).order_by(jobs_t.c.id.desc())
    ):
        try:
            stored = JobSpec.from_dict(orjson.loads(spec_json))
        except (ValueError, TypeError):  # a spec this version cannot read is no job it would find
            continue
        if stored_hash == spec_hash or stored.identity_hash() == spec_hash:
            same_key = (stored.provider.api_key_env, stored.provider.api_key_file) == key_source
            same.append((int(job_id), same_key, stored_hash == spec_hash))
    if not same:
        return None
    job_id, _, current = next((job for job in same if job[1]), same[0])
    return job_id, current


def _rehash(conn: Any, job_id: int, spec: JobSpec) -> None:
    """Store the current identity hash on a job found by its stored spec: the next lookup is a plain one."""
    conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(spec_hash=spec.identity_hash()))


def _bind(outcome: Outcome) -> dict[str, Any]:
    """An outcome as bind parameters (``b_`` names: SQLAlchemy reserves the column names)."""
    params = {f"b_{k}": v for k, v in outcome.__dict__.items()}
    params["b_id"] = params.pop("b_item_id")
    return params


def job_locked(job_id: int, holder: LockHolder, ledger_url: str | None = None) -> JobLockedError:
    """The job is another live run's: whose, since when; and (knowing the ledger) the command to try again."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.since))
    again = f": {command(ledger_url, 'resume', job_id)}" if ledger_url else ""
    return JobLockedError(
        f"job {job_id} is being worked by run {holder.run_id} "
        f"(pid {holder.pid} on {holder.host}, since {since}); try again later{again}"
    )


def lock_lost(job_id: int, run_id: str, holder: LockHolder | None) -> LockLostError:
    """``run_id`` no longer holds the job lock: who took it over (``holder``, None once that run ended)."""
    by = f"run {holder.run_id} (pid {holder.pid} on {holder.host})" if holder else "another run, since ended,"
    return LockLostError(
        f"job {job_id} was taken over by {by} while this run ({run_id}) was stalled past the lock's "
        "staleness; this run stopped sending and wrote nothing more"
    )


class Ledger:
    """The job database. Open with :meth:`open`; close with :meth:`close` or ``with``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        self.url = engine.url.render_as_string(hide_password=True)
        # SQLite checkpoints the whole WAL and deletes it when the *last* connection to the
        # file closes. One idle connection held open keeps the WAL in place whatever the
        # pool has open; SQLite checkpoints it as it fills.
        self._keeper = engine.raw_connection() if self.is_sqlite else None
        self._queries = LedgerQueries(engine)

    @classmethod
    def open(cls, db: str | os.PathLike[str] | None) -> Ledger:
        """Open the ledger at ``db`` (URL or SQLite path), upgrading its schema to head."""
        return cls(open_engine(db))

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        self.engine.dispose()

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite; reads stay deferred and never block).

        On SQLite, a file that stays locked past the busy timeout (another process
        stalled in the middle of a write: SIGSTOP, a suspended laptop) is a
        LedgerBusyError (exit 75): nothing was written, try again later.
        """
        try:
            with self.engine.connect() as conn:
                conn.execution_options(**{WRITE_OPTION: True})
                with conn.begin():
                    yield conn
        except OperationalError as exc:
            if self.is_sqlite and "database is locked" in str(exc.orig):
                raise LedgerBusyError(
                    f"the ledger {self.url} stayed locked by another process for "
                    f"{SQLITE_BUSY_TIMEOUT_MS // 1000} s (a run stalled in the middle of a write?); "
                    "nothing was changed, try again later"
                ) from exc
            raise

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def reconnects(self) -> bool:
        """Whether a call cut by a lost connection is worth retrying whole: PostgreSQL (a SQLite file's errors
        are local, retrying them cannot help)."""
        return not self.is_sqlite

    @property
    def shares_rate_budgets(self) -> bool:
        """Whether the job's ``rpm``/``tpm`` budgets are kept here, one for all its runs: PostgreSQL (workers on
        several hosts); a SQLite ledger's one run per job keeps its own."""
        return not self.is_sqlite

    # -- what a run reads (LedgerQueries' answers) -----------------------------

    def counts(self, job_id: int) -> dict[str, int]:
        """How many of the job's items are in each state (every state present)."""
        return self._queries.counts(job_id)

    def spent_usd(self, job_id: int) -> float:
        """What the job's budget counts as used: what its attempts cost, plus what its open provider
        batches (batch mode) reserved for their worst case until their results are in."""
        with self.engine.connect() as conn:
            reserved = conn.execute(
                select(func.coalesce(func.sum(shards_t.c.worst_usd), 0.0)).where(
                    shards_t.c.job_id == job_id, shards_t.c.state.in_(list(OPEN_SHARD_STATES))
                )
            ).scalar_one()
        return self._queries.spent_usd(job_id) + float(reserved)

    def recent_latencies(self, job_id: int, limit: int) -> list[float]:
        """Seconds taken by the job's latest ``limit`` clean attempts, oldest first."""
        return self._queries.recent_latencies(job_id, limit)

    # -- jobs ---------------------------------------------------------------

    def create_job(self, spec: JobSpec, *, input_path: str, input_hash: str) -> int:
        with self._write() as conn:
            return self._insert_job(conn, spec, input_path, input_hash)

    def find_or_create_job(self, spec: JobSpec, *, input_path: str, input_hash: str, new: bool) -> tuple[int, bool]:
        """The job for this spec and input content, created if there is none (or ``new``): (id, created).

        Atomic: two overlapping submits of the same job find one job, never two.
        """
        spec_hash = spec.identity_hash()
        with self._write() as conn:
            if not self.is_sqlite:  # SQLite's BEGIN IMMEDIATE already serialises this
                key = int(hashlib.sha256(f"{spec_hash}{input_hash}".encode()).hexdigest()[:15], 16)
                conn.execute(select(func.pg_advisory_xact_lock(key)))
            if not new:
                found = _same_job(conn, spec, input_hash)
                if found is not None:
                    job_id, current = found
                    if not current:
                        _rehash(conn, job_id, spec)
                    return job_id, False
            return self._insert_job(conn, spec, input_path, input_hash), True

    @staticmethod
    def _insert_job(conn: Any, spec: JobSpec, input_path: str, input_hash: str) -> int:
        result = conn.execute(
            insert(jobs_t).values(
                name=spec.name,
                created_at=time.time(),
                spec_source=spec.source,
                spec_json=orjson.dumps(spec.to_dict()).decode(),
                spec_hash=spec.identity_hash(),
                input_path=input_path,
                input_hash=input_hash,
                ingest_done=False,
                total=0,
            )
        )
        return int(result.inserted_primary_key[0])

    def find_job(self, spec: JobSpec, input_hash: str) -> int | None:
        """The newest job with this spec and input content, if any (:func:`_same_job`); one found by
        its stored spec is stored under the current hash."""
        with self.engine.connect() as conn:  # a read: a write only for a job found by its stored spec
            found = _same_job(conn, spec, input_hash)
        if found is None:
            return None
        job_id, current = found
        if not current:
            with self._write() as conn:
                _rehash(conn, job_id, spec)
        return job_id

    def set_key_source(self, job_id: int, api_key_env: str, api_key_file: str | None) -> None:
        """Where job ``job_id`` reads its API key from from now on (a re-submitted spec's choice)."""
        with self._write() as conn:
            stored = conn.execute(select(jobs_t.c.spec_json).where(jobs_t.c.id == job_id)).scalar_one()
            data = orjson.loads(stored)
            data.setdefault("provider", {}).update(api_key_env=api_key_env, api_key_file=api_key_file)
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(spec_json=orjson.dumps(data).decode()))

    def get_job(self, job_id: int) -> JobRecord:
        with self.engine.connect() as conn:
            row = conn.execute(select(jobs_t).where(jobs_t.c.id == job_id)).one_or_none()
        if row is None:
            raise job_not_found(job_id, self.url)
        return job_record(row._mapping)

    def list_jobs(self) -> list[tuple[JobRecord, dict[str, int]]]:
        with self.engine.connect() as conn:
            ids = conn.execute(select(jobs_t.c.id).order_by(jobs_t.c.id)).scalars().all()
            counts: dict[int, dict[str, int]] = {i: no_counts() for i in ids}
            for job_id, state, n in conn.execute(
                select(counts_t.c.job_id, counts_t.c.state, func.sum(counts_t.c.n))
                .group_by(counts_t.c.job_id, counts_t.c.state)
            ):
                if job_id in counts and n:
                    counts[job_id][state] = int(n)
        return [(self.get_job(i), counts[i]) for i in ids]

    # -- ingest -------------------------------------------------------------

    def last_ingested_line(self, job_id: int) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(func.max(items_t.c.line)).where(items_t.c.job_id == job_id)).scalar() or 0

    def insert_items(
        self, job_id: int, rows: Sequence[dict[str, Any]], *, run_id: str | None = None
    ) -> list[tuple[dict[str, Any], int]]:
        """Store one batch of input lines in one transaction; return the rows whose custom_id was taken.

        Rows carry ``line``, ``custom_id``, ``url``, ``body``, ``state`` and for rejected
        lines ``error_class`` and ``error_message``. A row whose custom_id an earlier line
        holds is stored, in the same transaction, as a ``rejected`` line
        (``duplicate_custom_id``) and returned with the line that holds it: a crash can
        never leave a line of a batch unstored. A line already stored is left as it is
        (each line is stored once). With ``run_id`` (ingest), the job lock must be
        this run's: it is renewed, else LockLostError and nothing is written.
        """
        if not rows:
            return []
        # In _ITEM_INSERT_COLUMNS order.
        values = [
            (job_id, r["line"], r["custom_id"], r.get("url"), r.get("body"), r["state"], 0,
             r.get("error_class"), r.get("error_message"))
            for r in rows
        ]
        if not self.is_sqlite and _any_nul(rows):
            values = [tuple(_no_nul(v) for v in row) for row in values]
            rows = [{k: _no_nul(v) for k, v in row.items()} for row in rows]
        lo, hi = rows[0]["line"], rows[-1]["line"]
        with self._write() as conn:
            if run_id is not None:
                self._renew_lock(conn, job_id, run_id)
                # An ingest's batches are its heartbeat: status sees the run at work while it reads.
                conn.execute(update(runs_t).where(runs_t.c.id == run_id).values(heartbeat_at=self._db_now()))
            # Read after the lock's row is written: a cancel (which writes the job's row first) is
            # either committed and seen here, or waits for this batch and then cancels its lines.
            if conn.execute(select(jobs_t.c.cancelled_at).where(jobs_t.c.id == job_id)).scalar() is not None:
                values = [v[:5] + (ItemState.CANCELLED,) + v[6:] if v[5] == ItemState.PENDING else v for v in values]
            if self._insert_values(conn, values):
                return []  # nothing was a duplicate: no need to read the batch back
            stored = set(
                conn.execute(
                    select(items_t.c.line).where(items_t.c.job_id == job_id, items_t.c.line.between(lo, hi))
                ).scalars()
            )
            dupes = [r for r in rows if r["line"] not in stored]
            if not dupes:
                return []
            first_lines = dict(
                conn.execute(
                    select(items_t.c.custom_id, items_t.c.line).where(
                        items_t.c.job_id == job_id,
                        items_t.c.state != ItemState.REJECTED,
                        items_t.c.custom_id.in_({r["custom_id"] for r in dupes}),
                    )
                ).all()
            )
            taken = [(r, int(first_lines.get(r["custom_id"], 0))) for r in dupes]
            self._insert_values(
                conn,
                [
                    (job_id, r["line"], r["custom_id"], None, None, ItemState.REJECTED, 0, "duplicate_custom_id",
                     f"custom_id {r['custom_id']!r} was already used on line {first}")
                    for r, first in taken
                ],
            )
        return taken

    def _insert_values(self, conn: Connection, values: Sequence[tuple[Any, ...]]) -> bool:
        """Insert item rows, skipping taken lines and custom_ids; True when every row went in."""
        if self.is_sqlite:
            # The hot path of a big ingest: straight to the driver's executemany,
            # about 2x faster than SQLAlchemy's per-row parameter processing.
            # The driver sums the rows each INSERT added.
            return bool(conn.exec_driver_sql(_SQLITE_INSERT_ITEMS, values).rowcount == len(values))
        return self._copy_items(conn, values)

    @staticmethod
    def _copy_items(conn: Connection, values: Sequence[tuple[Any, ...]]) -> bool:
        """PostgreSQL: COPY a batch in (several times faster than a multi-row INSERT); True if all went in.

        The usual batch takes no stored line or custom_id: it is COPYed straight into
        ``items`` (about 1.6x faster than going through the staging table). Otherwise
        (a custom_id repeated within the batch, or taken by an earlier line: the unique
        indexes say so) it is COPYed into a temporary table and inserted with
        ON CONFLICT DO NOTHING; the caller reads back which lines were stored.
        """
        from psycopg.errors import UniqueViolation

        raw: Any = conn.connection.driver_connection  # the psycopg 3 connection, in this transaction

        def copy_into(table: str) -> None:
            with raw.cursor() as cur:
                with cur.copy(f"COPY {table} ({', '.join(_ITEM_INSERT_COLUMNS)}) FROM STDIN") as copy:
                    for v in values:
                        copy.write_row(v)

        keys = [v[2] for v in values if v[5] != ItemState.REJECTED]
        if len(set(keys)) == len(keys):
            try:
                with conn.begin_nested():
                    copy_into("items")
                return True
            except UniqueViolation:
                pass  # a taken line or custom_id: take the careful path
        conn.exec_driver_sql(_PG_STAGE_ITEMS)
        copy_into("batchrun_items_in")
        conn.exec_driver_sql(_PG_INSERT_STAGED)
        return False

    def finish_ingest(self, job_id: int, *, run_id: str | None = None) -> int:
        """Mark the job's input as wholly stored (with ``run_id``: only while this run holds the job lock)."""
        with self._write() as conn:
            if run_id is not None:
                self._renew_lock(conn, job_id, run_id)
            total = conn.execute(select(func.sum(counts_t.c.n)).where(counts_t.c.job_id == job_id)).scalar() or 0
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(ingest_done=True, total=total))
        self.fold_counts(job_id)
        return int(total)

    def fold_counts(self, job_id: int) -> None:
        """PostgreSQL: fold the job's rows of ``item_counts`` (one per state), ``attempt_totals`` (one)
        and ``attempt_histogram`` (one per k): the triggers append a row per statement (models.py).
        Skipped while another fold of the job runs. SQLite keeps them folded already."""
        if self.is_sqlite:
            return
        with self._write() as conn:
            if not conn.execute(
                text("SELECT pg_try_advisory_xact_lock(:key, :job)"), {"key": _FOLD_LOCK_KEY, "job": job_id % 2**31}
            ).scalar():
                return
            for fold in _FOLDS:
                conn.execute(text(fold), {"job": job_id})

    # -- runs and the job lock ---------------------------------------------
    #
    # The lock is a row field, fenced: every write an exclusive run makes on the
    # strength of it (an ingest batch, a claim, a heartbeat) checks in the same
    # transaction that the lock is still its own, so a run that stalled past the
    # lock's staleness (SIGSTOP, a suspended laptop, a long outage) and was taken
    # over writes nothing more and learns so (LockLostError). Times are the
    # database's clock on PostgreSQL (one clock for every host).

    def _now(self, conn: Connection) -> float:
        """Now, in UNIX seconds, read in this transaction: the database's clock on PostgreSQL."""
        if self.is_sqlite:
            return time.time()
        return float(conn.execute(select(self._db_now())).scalar_one())

    def _holder(self, conn: Connection, job_id: int, *, lock: bool = False) -> LockHolder | None:
        stmt = select(
            jobs_t.c.lock_run_id, jobs_t.c.lock_pid, jobs_t.c.lock_host, jobs_t.c.lock_since, jobs_t.c.lock_heartbeat
        ).where(jobs_t.c.id == job_id)
        if lock:
            stmt = stmt.with_for_update()
        row = conn.execute(stmt).one_or_none()
        if row is None:
            raise job_not_found(job_id, self.url)
        if row.lock_run_id is None:
            return None
        return LockHolder(row.lock_run_id, row.lock_pid, row.lock_host, row.lock_since, row.lock_heartbeat)

    def _renew_lock(self, conn: Connection, job_id: int, run_id: str) -> None:
        """Renew the job lock's heartbeat in this transaction; LockLostError if it is not ``run_id``'s any more."""
        result = conn.execute(
            update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.lock_run_id == run_id).values(lock_heartbeat=self._db_now())
        )
        if result.rowcount == 0:
            raise self._lock_lost(conn, job_id, run_id)

    def _lock_lost(self, conn: Connection, job_id: int, run_id: str) -> LockLostError:
        return lock_lost(job_id, run_id, self._holder(conn, job_id))

    def start_run(
        self, job_id: int, command: str, *, exclusive: bool, stale_after: float = 60.0, run_id: str | None = None
    ) -> str:
        """Register a run (``run_id``, else a new id); with ``exclusive``, take the job lock or raise JobLockedError.

        A lock is taken over when its holder is a dead process on this host, or its
        heartbeat is older than ``stale_after`` seconds (the database's clock). A call
        replayed after a lost acknowledgement (the same ``run_id``) finds the lock its
        own and the run registered, and carries on.
        """
        run_id = run_id or os.urandom(8).hex()
        pid, host = os.getpid(), socket.gethostname()
        with self._write() as conn:
            now = self._now(conn)
            if exclusive:
                holder = self._holder(conn, job_id, lock=True)
                if holder is not None and holder.run_id != run_id:
                    dead = holder.host == host and not pid_alive(holder.pid)
                    stale = now - holder.heartbeat > stale_after
                    if not (dead or stale):
                        raise job_locked(job_id, holder, self.url)
                conn.execute(
                    update(jobs_t)
                    .where(jobs_t.c.id == job_id)
                    .values(lock_run_id=run_id, lock_pid=pid, lock_host=host, lock_since=now, lock_heartbeat=now)
                )
            conn.execute(
                (_sqlite_insert if self.is_sqlite else postgresql.insert)(runs_t)
                .values(id=run_id, job_id=job_id, command=command, pid=pid, host=host, started_at=now, heartbeat_at=now)
                .on_conflict_do_nothing(index_elements=[runs_t.c.id])
            )
        return run_id

    def heartbeat(
        self, job_id: int, run_id: str, lease_seconds: float, *, exclusive: bool = False
    ) -> dict[int, int]:
        """Show the run is alive and extend the leases of the items it holds; return them (id: claim).

        With ``exclusive``, the job lock must still be this run's: LockLostError
        otherwise, and nothing is extended. An item the run believes it holds under
        a claim that is not returned was taken from it (its lease lapsed and it was
        swept; the run may have claimed it again since, under another claim).
        """
        now = self._db_now()
        with self._write() as conn:
            conn.execute(update(runs_t).where(runs_t.c.id == run_id).values(heartbeat_at=now))
            if exclusive:
                self._renew_lock(conn, job_id, run_id)
            held = conn.execute(
                update(items_t)
                .where(items_t.c.job_id == job_id, items_t.c.state == ItemState.RUNNING, items_t.c.lease_owner == run_id)
                .values(lease_expires=now + lease_seconds)
                .returning(items_t.c.id, items_t.c.lease_claim)
            ).all()
        self.fold_counts(job_id)
        return {int(item_id): int(claim or 0) for item_id, claim in held}

    def cancelled_since(self, job_id: int, since: float) -> bool:
        """Whether ``batchrun cancel`` cancelled the job at or after ``since`` (a run watches for it)."""
        with self.engine.connect() as conn:
            at = conn.execute(select(jobs_t.c.cancelled_at).where(jobs_t.c.id == job_id)).scalar()
            return at is not None and float(at) >= since

    def end_run(self, job_id: int, run_id: str, exit_code: int) -> None:
        with self._write() as conn:
            conn.execute(
                update(runs_t).where(runs_t.c.id == run_id).values(ended_at=self._db_now(), exit_code=exit_code)
            )
            conn.execute(
                update(jobs_t)
                .where(jobs_t.c.id == job_id, jobs_t.c.lock_run_id == run_id)
                .values(lock_run_id=None, lock_pid=None, lock_host=None, lock_since=None, lock_heartbeat=None)
            )

    # -- the hot path -------------------------------------------------------

    def requeue_orphans(self, job_id: int, run_id: str) -> int:
        """Put back to pending every running item not leased to ``run_id`` nor to a live worker.

        Only while ``run_id`` holds the job lock (checked in the same transaction:
        LockLostError otherwise): any other exclusive holder is then gone, or stalled
        past the lock's staleness and fenced. ``batchrun worker`` runs take no lock;
        their items stay theirs until the worker ends or their lease expires (the
        database's clock).
        """
        live_workers = select(runs_t.c.id).where(
            runs_t.c.job_id == job_id, runs_t.c.command == "worker", runs_t.c.ended_at.is_(None)
        )
        with self._write() as conn:
            self._renew_lock(conn, job_id, run_id)
            result = conn.execute(
                update(items_t)
                .where(
                    items_t.c.job_id == job_id,
                    items_t.c.state == ItemState.RUNNING,
                    items_t.c.lease_owner.is_(None)
                    | (
                        (items_t.c.lease_owner != run_id)
                        & (items_t.c.lease_owner.not_in(live_workers) | (items_t.c.lease_expires < self._db_now()))
                    ),
                )
                .values(state=ItemState.PENDING, lease_owner=None, lease_expires=None, lease_claim=None)
            )
            return int(result.rowcount)

    def requeue_expired(self, job_id: int) -> int:
        """Put back to pending the running items whose lease has expired (the database's clock)."""
        return self.requeue_expired_jobs([job_id])

    def requeue_expired_jobs(self, job_ids: Sequence[int] | None = None) -> int:
        """:meth:`requeue_expired` for several jobs at once (every job when None): a worker's sweep."""
        ids = list(job_ids) if job_ids is not None else None
        with self._write() as conn:
            if ids is None:
                ids = list(conn.execute(select(jobs_t.c.id)).scalars())
            if not ids:
                return 0
            result = conn.execute(
                update(items_t)
                .where(
                    items_t.c.job_id.in_(ids),
                    items_t.c.state == ItemState.RUNNING,
                    items_t.c.lease_expires < self._db_now(),
                )
                .values(state=ItemState.PENDING, lease_owner=None, lease_expires=None, lease_claim=None)
            )
            return int(result.rowcount)

    def open_jobs(self, job_ids: Sequence[int] | None = None) -> list[tuple[int, bool]]:
        """Jobs (of ``job_ids``, else all) with items pending or running: (id, has pending items), oldest first.

        One index probe per job (``ix_items_claim``), so polling it is cheap however big the jobs are.
        """
        pending = exists().where(items_t.c.job_id == jobs_t.c.id, items_t.c.state == ItemState.PENDING)
        running = exists().where(items_t.c.job_id == jobs_t.c.id, items_t.c.state == ItemState.RUNNING)
        stmt = select(jobs_t.c.id, pending).where(pending | running).order_by(jobs_t.c.id)
        if job_ids is not None:
            stmt = stmt.where(jobs_t.c.id.in_(list(job_ids)))
        with self.engine.connect() as conn:
            return [(int(job_id), bool(has_pending)) for job_id, has_pending in conn.execute(stmt)]

    # -- job-wide rate budgets ------------------------------------------------

    def _db_now(self) -> Any:
        """Now, in UNIX seconds: the database's clock on PostgreSQL (one clock for every host)."""
        if self.is_sqlite:
            return literal(time.time(), Float)
        return sql_cast(extract("epoch", func.statement_timestamp()), Float)

    def set_rate_budget(self, job_id: int, kind: str, per_second: float, capacity: float) -> None:
        """Create the job's ``kind`` bucket (full), or set its rate and size: the newest run's limit wins."""
        now = self._db_now()
        stmt = (postgresql.insert if not self.is_sqlite else _sqlite_insert)(buckets_t).values(
            job_id=job_id, kind=kind, level=capacity, rate=per_second, capacity=capacity, updated_at=now
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[buckets_t.c.job_id, buckets_t.c.kind],
            set_={"rate": per_second, "capacity": capacity},
        )
        with self._write() as conn:
            conn.execute(stmt)

    def take_rate_budget(self, job_id: int, kind: str, amount: float) -> float:
        """Take ``amount`` from the job's ``kind`` bucket; the seconds to wait before spending it.

        One atomic UPDATE ... RETURNING: the refill since the last take is computed
        in the statement from the row it updates, so concurrent takers (row-locked
        one after another) never spend the same budget twice. The level may go
        negative (a reservation): the taker then waits until it has been refilled.
        """
        b = buckets_t.c
        now = self._db_now()
        least, greatest = (func.min, func.max) if self.is_sqlite else (func.least, func.greatest)
        available = least(b.capacity, b.level + greatest(0.0, now - b.updated_at) * b.rate)
        stmt = (
            update(buckets_t)
            .where(b.job_id == job_id, b.kind == kind)
            .values(level=available - amount, updated_at=greatest(b.updated_at, now))
            .returning(b.level, b.rate)
        )
        with self._write() as conn:
            row = conn.execute(stmt).one_or_none()
        if row is None or row.rate <= 0:
            return 0.0
        return max(0.0, -float(row.level) / float(row.rate))

    def claim(
        self, job_id: int, run_id: str, limit: int, lease_seconds: float, *, exclusive: bool = False, token: int = 0
    ) -> list[ClaimedItem]:
        """Lease up to ``limit`` pending items to ``run_id`` under its claim number ``token``, in input order.

        With ``exclusive``, only while the job lock is this run's (LockLostError otherwise).
        A claim replayed after a lost acknowledgement (the same ``token``) returns the
        items the first one leased instead of leasing more.
        """
        pick = (
            select(items_t.c.id)
            .where(items_t.c.job_id == job_id, items_t.c.state == ItemState.PENDING)
            .order_by(items_t.c.id)
            .limit(limit)
        )
        if not self.is_sqlite:
            pick = pick.with_for_update(skip_locked=True)
        stmt = (
            update(items_t)
            .where(items_t.c.id.in_(pick.scalar_subquery()))
            .values(
                state=ItemState.RUNNING, lease_owner=run_id, lease_claim=token,
                lease_expires=self._db_now() + lease_seconds,
            )
            .returning(*_CLAIMED_COLUMNS)
        )
        with self._write() as conn:
            if exclusive:
                self._renew_lock(conn, job_id, run_id)
            rows: Sequence[Any] = ()
            if token:
                rows = conn.execute(
                    select(*_CLAIMED_COLUMNS).where(
                        items_t.c.job_id == job_id, items_t.c.state == ItemState.RUNNING,
                        items_t.c.lease_owner == run_id, items_t.c.lease_claim == token,
                    )
                ).all()
            if not rows:
                rows = conn.execute(stmt).all()
        return sorted((ClaimedItem(*r) for r in rows), key=lambda c: c.id)

    def record(self, run_id: str, outcomes: Sequence[Outcome], attempts: Sequence[AttemptRecord]) -> None:
        """Write a batch of outcomes and attempts in one transaction.

        A success lands on an item that has no answer yet, whoever holds it now
        (a run whose lease lapsed while it waited for the answer: the first
        committed answer wins, and nothing paid for is thrown away); any other
        outcome only on an item this run still holds. Idempotent, so a write
        replayed after a lost acknowledgement changes nothing more: attempts are
        keyed by ``(run_id, seq)`` and charged once, outcomes are guarded by state.
        """
        if not outcomes and not attempts:
            return
        if self.is_sqlite:
            self._record_sqlite(run_id, outcomes, attempts)
            return
        with self._write() as conn:
            if attempts:
                rows = [{k: _no_nul(v) for k, v in a.__dict__.items() if k != "counted"} for a in attempts]
                added = set(
                    conn.execute(
                        postgresql.insert(attempts_t)
                        .on_conflict_do_nothing(index_elements=[attempts_t.c.run_id, attempts_t.c.seq])
                        .returning(attempts_t.c.seq),
                        rows,
                    ).scalars()
                )
                # The attempt budget lives here, so it holds across restarts and kills.
                charged = Counter(a.item_id for a in attempts if a.counted and a.seq in added)
                if charged:
                    conn.execute(
                        update(items_t)
                        .where(items_t.c.id == bindparam("b_id"))
                        .values(attempts=items_t.c.attempts + bindparam("b_n")),
                        [{"b_id": item_id, "b_n": n} for item_id, n in charged.items()],
                    )
            held = (
                (items_t.c.lease_owner == run_id)
                & (items_t.c.lease_claim == bindparam("b_claim"))
                & (items_t.c.state == ItemState.RUNNING)
            )
            # (no IN list: an expanding parameter cannot go through executemany)
            unanswered = or_(*(items_t.c.state == state for state in UNANSWERED))
            cleared = {"lease_owner": None, "lease_expires": None, "lease_claim": None}
            # Re-ask progress before put-backs: an item can have both in one batch (a stop
            # came right after its re-ask was noted), and the put-back ends the claim.
            for columns, guard, fixed, batch in (
                (FINAL_COLUMNS, unanswered, cleared, [o for o in outcomes if o.state == ItemState.SUCCEEDED]),
                (FINAL_COLUMNS, held, cleared,
                 [o for o in outcomes if o.state not in _NOT_FINAL and o.state != ItemState.SUCCEEDED]),
                (("followups",), held, {}, [o for o in outcomes if o.state == ItemState.RUNNING]),
                (BACK_COLUMNS, held, {"state": ItemState.PENDING, **cleared},
                 [o for o in outcomes if o.state == ItemState.PENDING]),
            ):
                if batch:
                    values: dict[str, Any] = {c: bindparam(f"b_{c}") for c in columns}
                    conn.execute(
                        update(items_t).where((items_t.c.id == bindparam("b_id")) & guard).values(**values, **fixed),
                        [{k: _no_nul(v) for k, v in _bind(o).items()} for o in batch],
                    )

    def _record_sqlite(self, run_id: str, outcomes: Sequence[Outcome], attempts: Sequence[AttemptRecord]) -> None:
        """:meth:`record` for SQLite, with the same statements written for its driver (never replayed)."""
        with self._write() as conn:
            if attempts:
                conn.exec_driver_sql(
                    _SQLITE_INSERT_ATTEMPTS, [tuple(getattr(a, c) for c in _ATTEMPT_COLUMNS) for a in attempts]
                )
                charged = Counter(a.item_id for a in attempts if a.counted)
                if charged:
                    conn.exec_driver_sql(_SQLITE_CHARGE_ATTEMPTS, [(n, item_id) for item_id, n in charged.items()])
            landed = [o for o in outcomes if o.state == ItemState.SUCCEEDED]
            if landed:
                conn.exec_driver_sql(
                    _SQLITE_LAND, [(*(getattr(o, c) for c in FINAL_COLUMNS), o.item_id) for o in landed]
                )
            finished = [o for o in outcomes if o.state not in _NOT_FINAL and o.state != ItemState.SUCCEEDED]
            if finished:
                conn.exec_driver_sql(
                    _SQLITE_FINISH,
                    [(*(getattr(o, c) for c in FINAL_COLUMNS), o.item_id, run_id, o.claim) for o in finished],
                )
            # Re-ask progress before put-backs (the put-back ends the claim; both can be in one batch).
            progress = [o for o in outcomes if o.state == ItemState.RUNNING]
            if progress:
                conn.exec_driver_sql(_SQLITE_PROGRESS, [(o.followups, o.item_id, run_id, o.claim) for o in progress])
            back = [o for o in outcomes if o.state == ItemState.PENDING]
            if back:
                conn.exec_driver_sql(
                    _SQLITE_PUT_BACK,
                    [(*(getattr(o, c) for c in BACK_COLUMNS), o.item_id, run_id, o.claim) for o in back],
                )

    def find_cached(self, keys: Collection[str]) -> dict[str, CachedAnswer]:
        """The newest succeeded answer in any job for each of these request keys (one query).

        A reused answer names the item that paid for it, so copies of copies
        still point at the original.
        """
        if not keys:
            return {}
        i = items_t.c
        # Written out, not bound, so SQLite matches the partial index on succeeded items.
        succeeded: ColumnElement[str] = literal_column("'succeeded'")
        newest = (
            select(func.max(i.id)).where(i.request_hash.in_(list(keys)), i.state == succeeded).group_by(i.request_hash)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(
                    i.request_hash, func.coalesce(i.cached_from, i.id), i.status_code, i.response, i.output,
                    i.parsed, i.request_id, i.input_tokens, i.output_tokens,
                ).where(i.id.in_(newest.scalar_subquery()))
            ).all()
        return {
            key: CachedAnswer(
                item_id=int(origin), status_code=status, response=response, output=output, parsed=parsed,
                request_id=request_id, input_tokens=tokens_in, output_tokens=tokens_out,
            )
            for key, origin, status, response, output, parsed, request_id, tokens_in, tokens_out in rows
        }

    def release_held(self, job_id: int, run_id: str) -> int:
        """Give back every item still leased to ``run_id`` (a run's end: nothing it claimed stays running)."""
        with self._write() as conn:
            result = conn.execute(
                update(items_t)
                .where(items_t.c.job_id == job_id, items_t.c.state == ItemState.RUNNING, items_t.c.lease_owner == run_id)
                .values(state=ItemState.PENDING, lease_owner=None, lease_expires=None, lease_claim=None)
            )
            return int(result.rowcount)

    # -- user actions -------------------------------------------------------

    def retry(
        self, job_id: int, states: Sequence[str], where: dict[str, Any] | None = None, *, max_tokens: int | None = None
    ) -> int:
        """Send finished items in ``states`` back to pending with a fresh attempt budget.

        ``max_tokens`` is recorded on those items and replaces the spec's limit
        for them (the job's spec stays as submitted). ``where`` narrows them by
        the columns of RETRY_FILTERS (ValueError for any other).
        """
        cond = [items_t.c.job_id == job_id, items_t.c.state.in_(list(states))]
        for column, value in (where or {}).items():
            if column not in RETRY_FILTERS:
                raise ValueError(f"items cannot be chosen for a retry by {column!r}: only by {', '.join(RETRY_FILTERS)}")
            cond.append(items_t.c[column] == value)
        values: dict[str, Any] = {
            "state": ItemState.PENDING,
            "attempts": 0,
            "error_class": None,
            "error_message": None,
            "status_code": None,
            "finished_at": None,
            "followups": None,
        }
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        with self._write() as conn:
            if ItemState.CANCELLED in states:  # un-cancelled: the rest of its input comes in pending again
                conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(cancelled_at=None))
            result = conn.execute(update(items_t).where(*cond).values(**values))
            return int(result.rowcount)

    def set_verdicts(self, changes: Sequence[tuple[int, str, str | None, str | None, str | None, str | None]]) -> None:
        """Apply offline revalidation: (item id, state, parsed, error class, error message, validation errors)."""
        if not changes:
            return
        with self._write() as conn:
            conn.execute(
                update(items_t)
                .where(items_t.c.id == bindparam("b_id"))
                .values(
                    state=bindparam("b_state"),
                    parsed=bindparam("b_parsed"),
                    error_class=bindparam("b_error_class"),
                    error_message=bindparam("b_error_message"),
                    validation_errors=bindparam("b_validation_errors"),
                ),
                [
                    {
                        "b_id": c[0],
                        "b_state": c[1],
                        "b_parsed": c[2],
                        "b_error_class": c[3],
                        "b_error_message": c[4],
                        "b_validation_errors": c[5],
                    }
                    for c in changes
                ],
            )

    def cancel(self, job_id: int) -> int:
        """Cancel every pending or running item of the job, and the lines its ingest stores from now on."""
        with self._write() as conn:
            now = time.time()
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(cancelled_at=now))
            result = conn.execute(
                update(items_t)
                .where(items_t.c.job_id == job_id, items_t.c.state.in_([ItemState.PENDING, ItemState.RUNNING]))
                .values(state=ItemState.CANCELLED, lease_owner=None, lease_expires=None, lease_claim=None, finished_at=now)
            )
            return int(result.rowcount)

    # -- exports ------------------------------------------------------------

    def record_export(self, job_id: int, path: str, fmt: str, sha256: str, lines: int) -> None:
        with self._write() as conn:
            conn.execute(
                insert(exports_t).values(
                    job_id=job_id, path=path, format=fmt, sha256=sha256, lines=lines, created_at=time.time()
                )
            )

    def set_export_target(self, job_id: int, path: str, fmt: str, errors: str | None) -> None:
        """Remember where the job is to be exported (``submit`` / ``resume --output``), so a later
        ``resume JOB`` writes the same files. Kept in ``exports`` as rows with no content hash
        (:data:`TARGET_SHA`: never a file's hash); the newest such row is the target."""
        now = time.time()
        rows = [{"job_id": job_id, "path": path, "format": fmt, "sha256": TARGET_SHA, "lines": 0, "created_at": now}]
        if errors:
            rows.append({"job_id": job_id, "path": errors, "format": ERRORS_TARGET, "sha256": TARGET_SHA, "lines": 0,
                         "created_at": now})
        with self._write() as conn:
            conn.execute(
                delete(exports_t).where(exports_t.c.job_id == job_id, exports_t.c.sha256 == TARGET_SHA)
            )
            conn.execute(insert(exports_t), rows)

    def export_target(self, job_id: int) -> tuple[str, str, str | None] | None:
        """Where the job is to be exported: (output, format, errors file or None); None if never said."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(exports_t.c.path, exports_t.c.format)
                .where(exports_t.c.job_id == job_id, exports_t.c.sha256 == TARGET_SHA)
                .order_by(exports_t.c.id)
            ).all()
        output = next(((path, fmt) for path, fmt in rows if fmt != ERRORS_TARGET), None)
        if output is None:
            return None
        errors = next((path for path, fmt in rows if fmt == ERRORS_TARGET), None)
        return output[0], output[1], errors

    def is_export_of(self, job_id: int, sha256: str) -> bool:
        """Whether a file with this content is one of this job's own exports."""
        with self.engine.connect() as conn:
            return (
                conn.execute(
                    select(exports_t.c.id).where(exports_t.c.job_id == job_id, exports_t.c.sha256 == sha256).limit(1)
                ).first()
                is not None
            )
