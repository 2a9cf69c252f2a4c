"""What the ledger's reads return, with no SQLAlchemy: the rows ``status``, ``report`` and ``list`` are
built from, and the few steps that turn query results into them.

Both readers of a ledger build these: :class:`~batchrun.ledger.queries.LedgerQueries` and
:class:`~batchrun.ledger.store.Ledger` (SQLAlchemy, any database), and
:class:`~batchrun.ledger.quick.QuickReader` (the stdlib's ``sqlite3``, read-only, for a
command that only reads a SQLite ledger and should not pay SQLAlchemy's import). What
their queries return is folded into rows here, in one place, so the two cannot differ.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from batchrun.errors import JobNotFoundError
from batchrun.spec import JobSpec
from batchrun.states import OPEN_SHARD_STATES, ItemState

@dataclass(frozen=True)
class JobRecord:
    """A job as stored."""

    id: int
    name: str | None
    created_at: float
    spec: JobSpec
    spec_hash: str
    input_path: str
    input_hash: str
    ingest_done: bool
    total: int


@dataclass(frozen=True)
class AttemptTotals:
    """What a job's attempts add up to (every HTTP request, clean or not)."""

    requests: int
    clean: int  # answered without a transport or HTTP error
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    cost_usd: float
    first_started_at: float | None
    last_started_at: float | None


@dataclass(frozen=True)
class Distribution:
    """Count, mean, extremes and nearest-rank percentiles of one attempt measure, in ms."""

    count: int
    mean: float | None
    minimum: float | None
    maximum: float | None
    percentiles: dict[int, float]  # {50: ..., 90: ..., 99: ...}; empty when count is 0


@dataclass(frozen=True)
class ErrorGroup:
    """Errors sharing a class or an HTTP status: failed attempts, items that ended on it, one message."""

    key: str | int | None
    attempts: int
    items: int
    example: str | None
    retried: int = 0  # failed attempts that were sent again (not an item's last)


@dataclass(frozen=True)
class RunRow:
    """A run of a job, as its process last reported: who, where, and its heartbeat (the ledger's clock)."""

    id: str
    command: str
    pid: int
    host: str
    started_at: float
    heartbeat_at: float
    ended_at: float | None
    exit_code: int | None


@dataclass(frozen=True)
class ShardRecord:
    """A shard as stored."""

    id: int
    job_id: int
    token: str
    kind: str
    state: str
    run_id: str | None
    endpoint: str | None
    model: str | None
    own_ids: bool
    requests: int
    bytes: int
    prompt_tokens: int
    worst_usd: float | None
    input_file_id: str | None
    batch_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    provider_status: str | None
    counts: Mapping[str, int]
    created_at: float
    create_sent_at: float | None
    creates: int
    provider_created_at: float | None
    in_progress_at: float | None
    ended_at: float | None
    expires_at: float | None
    collected_at: float | None
    cancel_reason: str | None
    error: str | None

    @property
    def is_open(self) -> bool:
        """Its items are still submitted."""
        return self.state in OPEN_SHARD_STATES

    @property
    def tag(self) -> str:
        """The random part of the shard's token: what its own line ids start with."""
        return self.token.rpartition("-")[2]

    def line_id(self, item_id: int, custom_id: str) -> str:
        """The custom_id an item's line carries in this shard's request file: the item's own, or one
        naming the shard ("<tag>_<item id>") where the API needs the lines to say whose they are."""
        return custom_id if self.own_ids else f"{self.tag}_{item_id}"

    def item_of(self, line_id: str) -> int | None:
        """The item a line id of this shard names (a shard-named id; None for any other)."""
        tag, _, item = line_id.partition("_")
        return int(item) if not self.own_ids and tag == self.tag and item.isdigit() else None


# The runs columns behind RunRow, in its order.
RUN_COLUMNS = ("id", "command", "pid", "host", "started_at", "heartbeat_at", "ended_at", "exit_code")


def pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The jobs columns a JobRecord is made from.
JOB_COLUMNS = ("id", "name", "created_at", "spec_source", "spec_json", "spec_hash", "input_path", "input_hash",
               "ingest_done", "total")


def job_record(row: Mapping[Any, Any]) -> JobRecord:
    """A jobs row as a :class:`JobRecord` (its spec parsed)."""
    return JobRecord(
        id=row["id"],
        name=row["name"],
        created_at=row["created_at"],
        spec=JobSpec.from_dict(orjson.loads(row["spec_json"]), source=row["spec_source"]),
        spec_hash=row["spec_hash"],
        input_path=row["input_path"],
        input_hash=row["input_hash"],
        ingest_done=bool(row["ingest_done"]),
        total=row["total"],
    )


def job_not_found(job_id: int, url: str) -> JobNotFoundError:
    return JobNotFoundError(f"no job {job_id} in ledger {url} (see `batchrun list`)")


def shard_record(row: Mapping[Any, Any]) -> ShardRecord:
    """A shards row as a :class:`ShardRecord` (its provider counts parsed)."""
    values = dict(row)
    values["counts"] = orjson.loads(values["counts"]) if values["counts"] else {}
    values["own_ids"] = bool(values["own_ids"])
    return ShardRecord(**values)


def answered_routes(rows: Iterable[tuple[Any, Any]]) -> dict[str, int]:
    """(route, count) rows as ``answered_by_route``'s {batch, online, cache}."""
    by = {"batch": 0, "online": 0, "cache": 0}
    for name, n in rows:
        by[str(name)] += int(n)
    return by


def turnaround_seconds(rows: Iterable[Any]) -> list[float]:
    """Shard turnarounds (ended - created), ascending, without the missing or negative ones."""
    return sorted(float(r) for r in rows if r is not None and r >= 0)


# -- distributions: nearest rank, one step into an index ----------------------------

MEASURE_TOTALS = {"latency_ms": "latency", "queue_wait_ms": "queue_wait", "ttft_ms": "ttft"}  # attempt_totals' prefix


def percentile_ranks(n: int, percentiles: Sequence[int]) -> dict[int, int]:
    """The nearest rank (1..n) of each percentile among ``n`` values."""
    return {p: max(1, -(-p * n // 100)) for p in percentiles}


def rank_step(rank: int, n: int) -> tuple[bool, int]:
    """How to reach rank ``rank`` of ``n`` values in an ordered index: (ascending?, OFFSET) from the nearer end."""
    low_end = rank <= (n + 1) // 2
    return low_end, (rank - 1 if low_end else n - rank)


def distribution(n: int, total: Any, percentiles: Sequence[int], value_at: Any) -> Distribution:
    """The :class:`Distribution` of ``n`` values summing to ``total``; ``value_at(rank)`` reads one value
    (ranks 1 and n, and each percentile's)."""
    if not n:
        return Distribution(0, None, None, None, {})
    ranks = percentile_ranks(n, percentiles)
    at_rank = {r: float(value_at(r)) for r in sorted(set(ranks.values()) | {1, n})}
    return Distribution(
        count=n, mean=float(total) / n, minimum=at_rank[1], maximum=at_rank[n],
        percentiles={p: at_rank[r] for p, r in ranks.items()},
    )


def attempt_totals(row: Sequence[Any]) -> AttemptTotals:
    """The sums over a job's attempt_totals rows (requests, clean, tokens x3, cost, first, last) as AttemptTotals."""
    return AttemptTotals(
        requests=int(row[0] or 0), clean=int(row[1] or 0), input_tokens=int(row[2] or 0),
        output_tokens=int(row[3] or 0), cached_tokens=int(row[4] or 0), cost_usd=float(row[5] or 0.0),
        first_started_at=row[6], last_started_at=row[7],
    )


# -- errors: by class, by HTTP status --------------------------------------------------


def attempt_statuses(rows: Iterable[tuple[Any, Any, int]]) -> tuple[dict[Any, int], dict[Any, list[str]]]:
    """Failed attempts per status, and the classes each status had, from (status, class, count) rows."""
    by_attempt: dict[Any, int] = {}
    classes: dict[Any, list[str]] = {}
    for status, error_class, n in rows:
        by_attempt[status] = by_attempt.get(status, 0) + int(n)
        classes.setdefault(status, []).append(error_class)
    return by_attempt, classes


ANY_STATUS = object()  # an attempt example of any status code

# The reused answers of a job, on SQLite. Without planner statistics SQLite may take any index on
# job_id, and in a ledger whose indexes were made by the migrations it took uq_items_job_line:
# every item of the job read (0.22 s on 1,000,000) where the partial index holds only the reused.
SQLITE_CACHED_COUNT = "SELECT count(*) FROM items INDEXED BY ix_items_reused WHERE job_id = ? AND cached_from IS NOT NULL"


def fill_examples(
    examples: dict[Any, str],
    wanted: Mapping[Any, Iterable[str]],
    attempt_example: Callable[[Any, str], str | None],
) -> None:
    """Give each key of ``wanted`` without an item's message one from a failed attempt: an item that
    later succeeded keeps no message, its attempts do (since migration 0010). ``wanted`` maps a key
    (a class, or a status) to the classes to look in; ``attempt_example(key, class)`` finds one.
    A 2xx status is no error status: none is looked for."""
    for key, error_classes in wanted.items():
        if examples.get(key) is not None or (isinstance(key, int) and 200 <= key < 300):
            continue
        for error_class in sorted(error_classes):
            example = attempt_example(key, error_class)
            if example is not None:
                examples[key] = example
                break


def class_groups(
    by_attempt: Mapping[Any, int], by_item_state: Iterable[tuple[Any, str, int]], examples: Mapping[Any, str]
) -> list[ErrorGroup]:
    """``errors_by_class`` from failed attempts per class, finished items per (class, state), one message per class."""
    by_item: dict[Any, int] = {}
    ended_after_a_request: dict[Any, int] = {}  # failed or invalid: their last attempt was not retried
    for key, state, n in by_item_state:
        by_item[key] = by_item.get(key, 0) + n
        if state != ItemState.REJECTED:
            ended_after_a_request[key] = ended_after_a_request.get(key, 0) + n
    return sorted(
        (
            ErrorGroup(str(key), int(by_attempt.get(key, 0)), int(by_item.get(key, 0)), examples.get(key),
                       max(0, int(by_attempt.get(key, 0)) - int(ended_after_a_request.get(key, 0))))
            for key in set(by_attempt) | set(by_item)
        ),
        key=lambda g: (-(g.attempts + g.items), str(g.key)),
    )


def status_groups(
    by_attempt: Mapping[Any, int], by_item: Mapping[Any, int], examples: Mapping[Any, str]
) -> list[ErrorGroup]:
    """``errors_by_status`` from failed attempts and failed items per status, one message per status.
    A 2xx is no error status: its failures (invalid output, a truncated answer) are classes."""
    return sorted(
        (
            ErrorGroup(key, int(by_attempt.get(key, 0)), int(by_item.get(key, 0)), examples.get(key))
            for key in set(by_attempt) | set(by_item)
            if not (isinstance(key, int) and 200 <= key < 300)
        ),
        key=lambda g: (-(g.attempts + g.items), g.key if isinstance(g.key, int) else 0),
    )
