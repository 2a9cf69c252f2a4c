"""Stream an input file into ledger items, one bounded batch at a time.

The input is JSONL, or CSV or Parquet (by the file's suffix: :mod:`batchrun.tabular`), each
row a record. Every line (row) becomes exactly one item: a request ready to send, or a
``rejected`` item that keeps its line (row) number and the reason.
"""

from __future__ import annotations

import difflib
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from batchrun.context import CONTEXT_LENGTH, ContextGuard
from batchrun.errors import InputError, StoppedError
from batchrun.ledger import Ledger, ride_out
from batchrun.providers import Provider
from batchrun.spec import JobSpec, Template, TemplateFieldError
from batchrun.states import ItemState
from batchrun.tabular import RowProblem, input_format, read_csv, read_parquet

INSERT_BATCH = 5000
FIRST_BATCH = 500  # a run sending beside its ingest starts once these lines are stored
# An ingest beside a run this many items ahead of what the run has taken reads at a quarter of
# its speed (it sleeps 3x each batch's time), leaving the CPU (one GIL) to the sending; measured
# in bench/RESULTS.md ("send while ingesting"). Never a full pause: the input is read to its end.
AHEAD_ITEMS = 20_000
AHEAD_SLEEP_RATIO = 3.0
AHEAD_SLEEP_MAX_S = 1.0
RENEW_CHECK_LINES = 256  # lines between two looks at the clock (is a batch due for the lock's sake?)
HASH_CHUNK = 1 << 20
MAX_STRICT_ERRORS_SHOWN = 5
SEEN_IN_MEMORY = 100_000  # custom_ids a check keeps in a set before it moves them to a temporary file


@dataclass
class IngestStats:
    """What an ingest did."""

    lines: int = 0
    accepted: int = 0
    rejected: int = 0
    rejections: list[tuple[int, str]] = field(default_factory=list)  # first few, for messages
    causes: Counter[str] = field(default_factory=Counter)  # rejected lines by error class
    examples: dict[str, tuple[int, str]] = field(default_factory=dict)  # error class: its first (line, reason)

    def most_common_cause(self) -> tuple[int, int, str] | None:
        """(lines, first line, reason) of the commonest kind of rejection, if any line was rejected."""
        if not self.causes:
            return None
        error_class, n = self.causes.most_common(1)[0]
        line, reason = self.examples[error_class]
        return n, line, reason


class _BadLine(Exception):
    def __init__(self, error_class: str, reason: str) -> None:
        super().__init__(reason)
        self.error_class = error_class
        self.reason = reason


def iter_lines(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes without the line ending) — ``None`` for a line over ``max_bytes``.

    An over-long line is skipped in chunks, never held whole in memory. CRLF and
    a missing final newline are fine.
    """
    number = 0
    while True:
        raw = f.readline(max_bytes + 2)
        if not raw:
            return
        number += 1
        if not raw.endswith(b"\n") and len(raw) > max_bytes + 1:
            while True:
                rest = f.readline(HASH_CHUNK)
                if not rest or rest.endswith(b"\n"):
                    break
            yield number, None
            continue
        line = raw.rstrip(b"\n").rstrip(b"\r") if raw.endswith(b"\n") else raw
        yield number, (None if len(line) > max_bytes else line)


class RequestBuilder:
    """Turns one parsed input record into (custom_id, url, body) for the job's provider."""

    def __init__(self, spec: JobSpec, provider: Provider) -> None:
        self.spec = spec
        self.provider = provider
        system, messages = spec.user_templates()
        self.system: Template | None = system
        self.messages = messages
        self.templated = spec.has_template
        self.guard = ContextGuard(provider, model=spec.provider.model, max_input_tokens=spec.request.max_input_tokens)

    def build(self, record: Mapping[str, Any], line: int) -> tuple[str, str | None, str]:
        custom_id = _custom_id(record, line)
        if self.templated:
            try:
                rendered = [{"role": "system", "content": self.system.render(record)}] if self.system else []
                rendered += [{"role": role, "content": t.render(record)} for role, t in self.messages]
            except TemplateFieldError as exc:
                missing = str(exc.args[0])
                raise _BadLine(
                    "missing_field",
                    f"template field {missing!r} is missing from the record{_did_you_mean(record, missing)}",
                ) from None
            return custom_id, None, self._fitting(None, self.provider.render_body(rendered))
        try:
            url, body = self.provider.check_batch_line(record)
        except ValueError as exc:
            hint = "" if "body" in record or "params" in record else " (or give a SPEC with a [request] template for plain records)"
            raise _BadLine("not_a_request", f"{exc}{hint}") from None
        return custom_id, url, self._fitting(url, body)

    def _fitting(self, url: str | None, body: dict[str, Any]) -> str:
        """The body's JSON, if the request fits in its model's context window (batchrun.context)."""
        raw = orjson.dumps(body)
        text = raw.decode()
        misfit = self.guard.misfit(url, body, len(raw), text)
        if misfit is not None:
            raise _BadLine(CONTEXT_LENGTH, misfit.reason)
        return text


def _did_you_mean(record: Mapping[str, Any], missing: str) -> str:
    """A hint for a template field the record lacks: the closest of the keys it has there, else those keys."""
    *parents, name = missing.split(".")
    value: Any = record
    for key in parents:
        value = value.get(key) if isinstance(value, Mapping) else None
    if not isinstance(value, Mapping) or not value:
        return ""
    keys = [str(k) for k in value]
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {'.'.join([*parents, close[0]])!r}?)"
    shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
    return f" (it has {shown})"


def _custom_id(record: Mapping[str, Any], line: int) -> str:
    for key in ("custom_id", "id"):
        if key in record:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise _BadLine("bad_custom_id", f"{key} must be a string or an integer, got {orjson.dumps(value).decode()[:60]}")
            text = str(value)
            if not text:
                raise _BadLine("bad_custom_id", f"{key} is empty")
            return text
    return str(line)


def _parse_line(raw: bytes | None, max_bytes: int) -> dict[str, Any]:
    if raw is None:
        raise _BadLine("too_large", f"line is longer than the limit of {max_bytes} bytes ([run] max_line_bytes)")
    try:
        record = orjson.loads(raw)  # also refuses invalid UTF-8 and blank lines: told apart below
    except orjson.JSONDecodeError as exc:
        raise _refused(raw, exc) from None
    if not isinstance(record, dict):
        raise _BadLine("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    return record


def _refused(raw: bytes, exc: orjson.JSONDecodeError) -> _BadLine:
    """Why orjson refused a line: blank, not UTF-8, else not JSON."""
    if not raw.strip():
        return _BadLine("blank", "blank line")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return _BadLine("invalid_utf8", f"not valid UTF-8 at byte {bad.start}")
    return _BadLine("invalid_json", f"not valid JSON: {exc}")


def iter_records(
    path: str | os.PathLike[str], max_bytes: int, *, after: int = 0
) -> Iterator[tuple[int, dict[str, Any] | _BadLine | None]]:
    """(line, record or why it is bad) for each line of a JSONL file or row of a CSV or Parquet file.

    The JSONL lines up to ``after`` (stored by an earlier ingest) come as (line, None), unparsed.
    """
    fmt = input_format(path)
    if fmt == "jsonl":
        with _open_input(path) as f:
            for line, raw in iter_lines(f, max_bytes):
                if line <= after:
                    yield line, None
                    continue
                try:
                    record = _parse_line(raw, max_bytes)
                except _BadLine as bad:
                    yield line, bad
                else:
                    yield line, record
        return
    rows = read_csv(path, max_bytes) if fmt == "csv" else read_parquet(path)
    for line, row in rows:
        yield line, _BadLine(row.error_class, row.reason) if isinstance(row, RowProblem) else row


def _build(builder: RequestBuilder, got: dict[str, Any] | _BadLine | None, line: int) -> tuple[str, str | None, str]:
    if isinstance(got, _BadLine):
        raise got
    assert got is not None  # only lines an earlier ingest stored come unparsed, and they are skipped
    return builder.build(got, line)


class SeenIds:
    """The custom_ids met so far, in bounded memory: a set for the first ``in_memory``, then a
    private temporary SQLite file (pages spill to disk; SQLite deletes it on close), so checking
    a file of any size holds at most a few MB of them."""

    def __init__(self, in_memory: int | None = None) -> None:
        self.in_memory = in_memory if in_memory is not None else SEEN_IN_MEMORY
        self._ids: set[str] = set()
        self._db: sqlite3.Connection | None = None

    def add(self, custom_id: str) -> bool:
        """Note ``custom_id``; False if it was already met."""
        if self._db is None:
            if custom_id in self._ids:
                return False
            self._ids.add(custom_id)
            if len(self._ids) > self.in_memory:
                self._spill()
            return True
        return self._db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (custom_id,)).rowcount == 1

    def _spill(self) -> None:
        self._db = sqlite3.connect("")  # "": a private temporary database on disk
        self._db.execute("PRAGMA journal_mode = OFF")
        self._db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self._db.executemany("INSERT INTO seen VALUES (?)", ((i,) for i in self._ids))
        self._ids = set()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> SeenIds:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_input(
    path: str | os.PathLike[str],
    builder: RequestBuilder,
    on_item: Callable[[str | None, str], None] | None = None,
) -> IngestStats:
    """Read the whole input without writing anything: for ``--strict`` before a job exists, and ``--dry-run``.

    ``on_item`` gets the (url, body) of every accepted line, as ingest would store it.
    """
    stats = IngestStats()
    max_bytes = builder.spec.run.max_line_bytes
    with SeenIds() as seen_ids:
        for line, got in iter_records(path, max_bytes):
            stats.lines += 1
            try:
                custom_id, url, body = _build(builder, got, line)
                if not seen_ids.add(custom_id):
                    raise _BadLine("duplicate_custom_id", f"custom_id {custom_id!r} appears twice")
                stats.accepted += 1
                if on_item is not None:
                    on_item(url, body)
            except _BadLine as bad:
                stats.rejected += 1
                _note(stats, line, bad.reason, bad.error_class)
    return stats


def first_item_or_why(path: str | os.PathLike[str], builder: RequestBuilder) -> IngestStats | None:
    """None as soon as a line of the input would make an item; else (no line would) what the whole input held.

    Read before a job is created, so that an empty input or one whose every line is rejected
    creates none. Stops at the first good line: for a sound input, the cost of one line.
    """
    stats = IngestStats()
    for line, got in iter_records(path, builder.spec.run.max_line_bytes):
        stats.lines += 1
        try:
            _build(builder, got, line)
        except _BadLine as bad:
            stats.rejected += 1
            _note(stats, line, bad.reason, bad.error_class)
            continue
        return None
    return stats


def ingest(
    ledger: Ledger,
    job_id: int,
    path: str | os.PathLike[str],
    builder: RequestBuilder,
    *,
    run_id: str | None = None,
    on_batch: Callable[[IngestStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    first_batch: int | None = None,
) -> IngestStats:
    """Stream ``path`` into the job's items, continuing after the last line already stored.

    Each batch is one transaction, its duplicate-id rejections included, so the
    stored lines are always a prefix of the file. With ``run_id`` (the ingest's
    job lock) every batch renews the lock and is refused once another run has
    taken the job over (LockLostError); on PostgreSQL a batch cut by a lost
    connection is written again; a batch is also written after
    ``lock_stale_seconds / 4`` however few lines it has, so a slow read never lets
    the lock look stale. ``should_stop`` is asked before the first line and between
    batches: a signal stops the ingest at a clean point (StoppedError), never in
    the middle of a write. ``first_batch``: lines in the first batch (a run
    sending beside the ingest starts on it).
    """
    stats = IngestStats()
    max_bytes = builder.spec.run.max_line_bytes
    renew_every = builder.spec.run.lock_stale_seconds / 4
    start_after = ledger.last_ingested_line(job_id)
    batch: list[dict[str, Any]] = []
    batch_size = first_batch or INSERT_BATCH
    written_at = time.monotonic()

    def stop_if_asked(where: str) -> None:
        if should_stop and should_stop():
            raise StoppedError(f"stopped while reading {path} {where}; run the same command again to carry on")

    def flush() -> None:
        nonlocal written_at, batch_size
        # A batch written again after a lost connection changes nothing more (each line is stored once).
        taken = ride_out(ledger, lambda: ledger.insert_items(job_id, batch, run_id=run_id), what="ingest")
        written_at = time.monotonic()
        stats.accepted -= len(taken)
        stats.rejected += len(taken)
        for row, first in taken:
            _note(stats, row["line"], f"custom_id {row['custom_id']!r} was already used on line {first}",
                  "duplicate_custom_id")
        batch.clear()
        batch_size = INSERT_BATCH
        if on_batch:
            on_batch(stats)

    stop_if_asked("before its first line")
    for line, got in iter_records(path, max_bytes, after=start_after):
        stats.lines += 1
        if line <= start_after:
            continue
        try:
            custom_id, url, body = _build(builder, got, line)
            batch.append({"line": line, "custom_id": custom_id, "url": url, "body": body, "state": ItemState.PENDING})
            stats.accepted += 1
        except _BadLine as bad:
            custom_id = _fallback_custom_id(got, line)
            batch.append(
                {
                    "line": line,
                    "custom_id": custom_id,
                    "state": ItemState.REJECTED,
                    "error_class": bad.error_class,
                    "error_message": bad.reason,
                }
            )
            stats.rejected += 1
            _note(stats, line, bad.reason, bad.error_class)
        if len(batch) >= batch_size or (
            line % RENEW_CHECK_LINES == 0 and time.monotonic() - written_at > renew_every
        ):
            flush()
            stop_if_asked(f"at line {line}")
    flush()
    return stats


def _note(stats: IngestStats, line: int, reason: str, error_class: str) -> None:
    if len(stats.rejections) < MAX_STRICT_ERRORS_SHOWN:
        stats.rejections.append((line, reason))
    stats.causes[error_class] += 1
    stats.examples.setdefault(error_class, (line, reason))


def _fallback_custom_id(got: dict[str, Any] | _BadLine | None, line: int) -> str:
    """The key of a rejected line: its own custom_id/id when it has a usable one, else its line number."""
    if isinstance(got, dict):
        try:
            return _custom_id(got, line)
        except _BadLine:
            pass
    return str(line)


class BackgroundIngest:
    """The rest of a job's ingest on a thread of its own, beside the run that sends its items.

    :meth:`start` is given the run's id: the run holds the job lock, and every batch is
    written under it (fenced: a run that lost the job writes nothing more). Each batch's
    items are workable once it is committed; ``on_batch`` says so (from the ingest's
    thread). ``done`` once the whole input is stored and the job marked so
    (``ingest_done``); ``error`` is what stopped it otherwise (a stop asked by
    ``should_stop`` included: StoppedError).
    """

    def __init__(self, ledger: Ledger, job_id: int, path: str | os.PathLike[str], builder: RequestBuilder) -> None:
        self.ledger = ledger
        self.job_id = job_id
        self.path = path
        self.builder = builder
        self.stats: IngestStats | None = None
        self.error: BaseException | None = None
        self.done = False
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()  # set before the last on_batch, so the run sees it when woken

    @property
    def ended(self) -> bool:
        """Whether the ingest has ended (done, or stopped by ``error``)."""
        return self._ended.is_set()

    def start(
        self,
        run_id: str,
        on_batch: Callable[[int], None],
        should_stop: Callable[[], bool],
        taken: Callable[[], int],
    ) -> None:
        """Start reading on a thread; ``on_batch(accepted)`` after each committed batch and once at the end.

        ``taken()``: how many items the run has claimed so far; while the ingest is far
        ahead of it (AHEAD_ITEMS), it slows down so the run has the CPU.
        """
        self._thread = threading.Thread(
            target=self._main, args=(run_id, on_batch, should_stop, taken), name="batchrun-ingest", daemon=True
        )
        self._thread.start()

    def _main(
        self, run_id: str, on_batch: Callable[[int], None], should_stop: Callable[[], bool], taken: Callable[[], int]
    ) -> None:
        told = 0
        since = time.monotonic()

        def batch_in(stats: IngestStats) -> None:
            nonlocal told, since
            on_batch(stats.accepted - told)
            told = stats.accepted
            took = time.monotonic() - since
            if stats.accepted - taken() > AHEAD_ITEMS and not should_stop():
                time.sleep(min(AHEAD_SLEEP_MAX_S, took * AHEAD_SLEEP_RATIO))
            since = time.monotonic()

        try:
            self.stats = ingest(
                self.ledger, self.job_id, self.path, self.builder, run_id=run_id, on_batch=batch_in,
                should_stop=should_stop, first_batch=min(FIRST_BATCH, INSERT_BATCH),
            )
            ride_out(self.ledger, lambda: self.ledger.finish_ingest(self.job_id, run_id=run_id), what="ingest")
            self.done = True
        except BaseException as exc:  # the run stops with it
            self.error = exc
        finally:
            self._ended.set()
            on_batch(0)  # the run looks again: the ingest has ended

    def join(self) -> None:
        """Wait for the thread to end (it stops at its next batch once ``should_stop`` says so)."""
        if self._thread is not None:
            self._thread.join()


def _open_input(path: str | os.PathLike[str]) -> BinaryIO:
    try:
        return open(Path(path), "rb", buffering=HASH_CHUNK)
    except FileNotFoundError:
        raise InputError(f"{path}: no such input file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read input: {exc.strerror or exc}") from exc


def read_request(path: str | os.PathLike[str], builder: RequestBuilder, line: int) -> tuple[str, str | None, str]:
    """(custom_id, url, body) of one input line, as submit would build it (``batchrun check``).

    InputError names the file, the line and what is wrong with it.
    """
    max_bytes = builder.spec.run.max_line_bytes
    for number, got in iter_records(path, max_bytes):
        if number == line:
            try:
                return _build(builder, got, line)
            except _BadLine as bad:
                raise InputError(f"{path}:{line}: {bad.reason}") from None
    raise InputError(f"{path}: has no line {line}")
