"""An in-memory ledger for tests: :class:`InMemoryLedger`, a :class:`~batchrun.ledger.RunLedger`.

It keeps what a run relies on the way the real :class:`~batchrun.ledger.Ledger` does:
the job lock (a stale one is taken over; a run that lost it gets LockLostError from
every fenced call), claims with leases and claim tokens (a replayed claim returns what
the first one leased), outcomes fenced as ``record`` fences them (a success lands on any
item without an answer, the first committed one wins; any other outcome only on the
claim it answers), heartbeats that return the items still held, the lease sweeps, the
response cache's look-up, the job's rate buckets, and the spend, latencies and counts a
run reads. tests/integration/test_ledger_contract.py runs the same scenarios on it and on
SQLite and PostgreSQL.

Where it differs, on purpose: every run is this process's, so a lock is taken over
only when stale (the real ledger also takes one whose holder is a dead local process);
times come from ``clock`` (a test may pass its own and move it on); no call is ever cut,
so nothing is replayed (``reconnects`` is False). Each call is one transaction: calls
are serialised by a lock (a runner calls from two threads), and a call that raises
changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from batchrun.errors import JobNotFoundError
from batchrun.ledger import AttemptRecord, CachedAnswer, ClaimedItem, ItemRow, JobRecord, Outcome, RunLedger
from batchrun.ledger.models import items as items_t
from batchrun.ledger.store import BACK_COLUMNS, FINAL_COLUMNS, UNANSWERED, LockHolder, job_locked, lock_lost
from batchrun.spec import JobSpec
from batchrun.states import ItemState, no_counts


T = TypeVar("T")

# An item is a row of the real items table: its columns by name.
_Item = dict[str, Any]
_COLUMNS = tuple(c.name for c in items_t.columns)


def _as(row_type: type[T], item: _Item, renamed: Mapping[str, str]) -> T:
    """``item`` as ``row_type``, field by field (a field is its column, or the one ``renamed`` names)."""
    return row_type(**{f.name: item[renamed.get(f.name, f.name)] for f in dataclasses.fields(row_type)})  # type: ignore[arg-type]


def _held_by(item: _Item, run_id: str, claim: int) -> bool:
    return bool(item["state"] == ItemState.RUNNING and item["lease_owner"] == run_id and item["lease_claim"] == claim)


def _lapsed(item: _Item, now: float) -> bool:
    return item["lease_expires"] is not None and bool(item["lease_expires"] < now)


def _write(item: _Item, outcome: Outcome, columns: Sequence[str], **fixed: Any) -> None:
    item.update({c: getattr(outcome, c) for c in columns}, lease_owner=None, lease_expires=None, lease_claim=None)
    item.update(fixed)


def _put_back(item: _Item) -> None:
    item.update(state=ItemState.PENDING, lease_owner=None, lease_expires=None, lease_claim=None)


@dataclass
class _Job:
    record: JobRecord
    items: list[_Item] = field(default_factory=list)
    lock: LockHolder | None = None


@dataclass
class _Run:
    job_id: int
    command: str
    ended_at: float | None = None


@dataclass
class _Bucket:
    level: float
    rate: float
    capacity: float
    updated_at: float


class InMemoryLedger:
    """A ledger in this process's memory (see the module docstring). Add jobs with :meth:`add_job`;
    read them back with :meth:`items` (as export reads them), :meth:`rows` and :meth:`attempts`."""

    reconnects = False  # nothing to lose a connection to

    def __init__(self, *, clock: Callable[[], float] = time.time, shares_rate_budgets: bool = False) -> None:
        self.clock = clock
        self.shares_rate_budgets = shares_rate_budgets
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._items: dict[int, _Item] = {}
        self._runs: dict[str, _Run] = {}
        self._attempts: list[AttemptRecord] = []
        self._attempt_keys: set[tuple[str, int]] = set()
        self._buckets: dict[tuple[int, str], _Bucket] = {}

    # -- for tests ------------------------------------------------------------

    def add_job(self, spec: JobSpec, bodies: Iterable[str | Mapping[str, Any]], *, url: str | None = None) -> int:
        """A job whose input is ``bodies`` (request bodies, as JSON text or objects), wholly ingested: its id.

        Item ``n`` (from 1) is line ``n`` with custom_id ``c<n>``.
        """
        with self._lock:
            job_id = len(self._jobs) + 1
            job = _Job(JobRecord(
                id=job_id, name=spec.name, created_at=self.clock(), spec=spec, spec_hash=spec.identity_hash(),
                input_path="<memory>", input_hash=f"memory-{job_id}", ingest_done=True, total=0,
            ))
            for line, body in enumerate(bodies, start=1):
                item_id = len(self._items) + 1
                item: _Item = dict.fromkeys(_COLUMNS)
                item.update(
                    id=item_id, job_id=job_id, line=line, custom_id=f"c{line}", url=url,
                    body=body if isinstance(body, str) else orjson.dumps(body).decode(),
                    state=ItemState.PENDING, attempts=0,
                )
                job.items.append(item)
                self._items[item_id] = item
            job.record = dataclasses.replace(job.record, total=len(job.items))
            self._jobs[job_id] = job
            return job_id

    def items(self, job_id: int) -> list[ItemRow]:
        """Every item of the job in input order, as export reads it."""
        with self._lock:
            return [_as(ItemRow, item, {"item_id": "id"}) for item in self._job(job_id).items]

    def rows(self, job_id: int) -> list[dict[str, Any]]:
        """Every column of the job's items in input order (copies): what export does not show too
        (``followups``, the lease)."""
        with self._lock:
            return [dict(item) for item in self._job(job_id).items]

    def attempts(self, job_id: int) -> list[AttemptRecord]:
        """The job's attempt rows, in the order they were recorded."""
        with self._lock:
            return [dataclasses.replace(a) for a in self._attempts if a.job_id == job_id]

    # -- the job and the run ------------------------------------------------

    def _job(self, job_id: int) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id} in the in-memory ledger")
        return job

    def _renew_lock(self, job_id: int, run_id: str) -> None:
        job = self._job(job_id)
        if job.lock is None or job.lock.run_id != run_id:
            raise lock_lost(job_id, run_id, job.lock)
        job.lock = dataclasses.replace(job.lock, heartbeat=self.clock())

    def get_job(self, job_id: int) -> JobRecord:
        with self._lock:
            return self._job(job_id).record

    def start_run(
        self, job_id: int, command: str, *, exclusive: bool, stale_after: float = 60.0, run_id: str | None = None
    ) -> str:
        run_id = run_id or os.urandom(8).hex()
        with self._lock:
            job, now = self._job(job_id), self.clock()
            if exclusive:
                holder = job.lock
                if holder is not None and holder.run_id != run_id and now - holder.heartbeat <= stale_after:
                    raise job_locked(job_id, holder)
                job.lock = LockHolder(run_id, os.getpid(), socket.gethostname(), now, now)
            self._runs.setdefault(run_id, _Run(job_id, command))
        return run_id

    def end_run(self, job_id: int, run_id: str, exit_code: int) -> None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is not None:
                run.ended_at = self.clock()
            job = self._jobs.get(job_id)
            if job is not None and job.lock is not None and job.lock.run_id == run_id:
                job.lock = None

    def counts(self, job_id: int) -> dict[str, int]:
        with self._lock:
            counts = no_counts()
            for item in self._jobs[job_id].items if job_id in self._jobs else ():
                counts[item["state"]] += 1
            return counts

    # -- the spend so far, the pace, the rate budgets -------------------------

    def spent_usd(self, job_id: int) -> float:
        with self._lock:
            return sum(a.cost_usd or 0.0 for a in self._attempts if a.job_id == job_id)

    def recent_latencies(self, job_id: int, limit: int) -> list[float]:
        with self._lock:
            clean = [
                a.latency_ms for a in self._attempts
                if a.job_id == job_id and a.error_class is None and a.latency_ms is not None
            ]
            return [ms / 1000.0 for ms in clean[max(0, len(clean) - limit):]]

    def set_rate_budget(self, job_id: int, kind: str, per_second: float, capacity: float) -> None:
        with self._lock:
            bucket = self._buckets.get((job_id, kind))
            if bucket is None:
                self._buckets[(job_id, kind)] = _Bucket(capacity, per_second, capacity, self.clock())
            else:
                bucket.rate, bucket.capacity = per_second, capacity

    def take_rate_budget(self, job_id: int, kind: str, amount: float) -> float:
        with self._lock:
            bucket = self._buckets.get((job_id, kind))
            if bucket is None:
                return 0.0
            now = self.clock()
            available = min(bucket.capacity, bucket.level + max(0.0, now - bucket.updated_at) * bucket.rate)
            bucket.level, bucket.updated_at = available - amount, max(bucket.updated_at, now)
            if bucket.rate <= 0:
                return 0.0
            return max(0.0, -bucket.level / bucket.rate)

    # -- leases ---------------------------------------------------------------

    def _running(self, job_id: int) -> list[_Item]:
        job = self._jobs.get(job_id)
        return [i for i in job.items if i["state"] == ItemState.RUNNING] if job is not None else []

    def requeue_orphans(self, job_id: int, run_id: str) -> int:
        with self._lock:
            self._renew_lock(job_id, run_id)
            now = self.clock()
            live_workers = {
                rid for rid, run in self._runs.items()
                if run.job_id == job_id and run.command == "worker" and run.ended_at is None
            }
            orphans = [
                i for i in self._running(job_id)
                if i["lease_owner"] is None or (
                    i["lease_owner"] != run_id
                    and (i["lease_owner"] not in live_workers or _lapsed(i, now))
                )
            ]
            for item in orphans:
                _put_back(item)
            return len(orphans)

    def requeue_expired(self, job_id: int) -> int:
        with self._lock:
            now = self.clock()
            expired = [i for i in self._running(job_id) if _lapsed(i, now)]
            for item in expired:
                _put_back(item)
            return len(expired)

    def claim(
        self, job_id: int, run_id: str, limit: int, lease_seconds: float, *, exclusive: bool = False, token: int = 0
    ) -> list[ClaimedItem]:
        with self._lock:
            if exclusive:
                self._renew_lock(job_id, run_id)
            job = self._jobs.get(job_id)
            items = job.items if job is not None else []
            picked = [i for i in items if token and _held_by(i, run_id, token)]  # a replay: what the first leased
            if not picked:
                picked = [i for i in items if i["state"] == ItemState.PENDING][: max(0, limit)]
                for item in picked:
                    item.update(
                        state=ItemState.RUNNING, lease_owner=run_id, lease_claim=token,
                        lease_expires=self.clock() + lease_seconds,
                    )
            return [_as(ClaimedItem, item, {"claim": "lease_claim"}) for item in picked]

    def heartbeat(self, job_id: int, run_id: str, lease_seconds: float, *, exclusive: bool = False) -> dict[int, int]:
        with self._lock:
            if exclusive:
                self._renew_lock(job_id, run_id)
            held: dict[int, int] = {}
            for item in self._running(job_id):
                if item["lease_owner"] == run_id:
                    item["lease_expires"] = self.clock() + lease_seconds
                    held[item["id"]] = item["lease_claim"] or 0
            return held

    def cancelled_since(self, job_id: int, since: float) -> bool:
        with self._lock:
            return any(item["state"] == ItemState.CANCELLED and (item["finished_at"] or 0.0) >= since
                       for item in self._job(job_id).items)

    def release_held(self, job_id: int, run_id: str) -> int:
        with self._lock:
            mine = [i for i in self._running(job_id) if i["lease_owner"] == run_id]
            for item in mine:
                _put_back(item)
            return len(mine)

    # -- outcomes ---------------------------------------------------------------

    def find_cached(self, keys: Collection[str]) -> dict[str, CachedAnswer]:
        with self._lock:
            newest: dict[str, _Item] = {}
            for item in self._items.values():  # in id order: the last one seen is the newest
                if item["state"] == ItemState.SUCCEEDED and item["request_hash"] in keys:
                    newest[item["request_hash"]] = item
            return {
                key: CachedAnswer(
                    item_id=i["id"] if i["cached_from"] is None else i["cached_from"], status_code=i["status_code"],
                    response=i["response"], output=i["output"], parsed=i["parsed"], request_id=i["request_id"],
                    input_tokens=i["input_tokens"], output_tokens=i["output_tokens"],
                )
                for key, i in newest.items()
            }

    def record(self, run_id: str, outcomes: Sequence[Outcome], attempts: Sequence[AttemptRecord]) -> None:
        with self._lock:
            for attempt in attempts:
                if attempt.seq is not None:
                    if (attempt.run_id, attempt.seq) in self._attempt_keys:
                        continue  # a replayed write adds it once
                    self._attempt_keys.add((attempt.run_id, attempt.seq))
                self._attempts.append(dataclasses.replace(attempt))  # as written: the caller may change its own
                if attempt.counted:
                    self._items[attempt.item_id]["attempts"] += 1
            # In the real ledger's order: landed answers, other final outcomes, re-ask progress, put-backs.
            for o in outcomes:
                if o.state == ItemState.SUCCEEDED and self._items[o.item_id]["state"] in UNANSWERED:
                    _write(self._items[o.item_id], o, FINAL_COLUMNS)
            for o in outcomes:
                final = o.state not in (ItemState.PENDING, ItemState.RUNNING, ItemState.SUCCEEDED)
                if final and _held_by(self._items[o.item_id], run_id, o.claim):
                    _write(self._items[o.item_id], o, FINAL_COLUMNS)
            for o in outcomes:
                if o.state == ItemState.RUNNING and _held_by(self._items[o.item_id], run_id, o.claim):
                    self._items[o.item_id]["followups"] = o.followups
            for o in outcomes:
                if o.state == ItemState.PENDING and _held_by(self._items[o.item_id], run_id, o.claim):
                    _write(self._items[o.item_id], o, BACK_COLUMNS, state=ItemState.PENDING)


if TYPE_CHECKING:  # mypy holds the stand-in to the Protocol here
    _stand_in: RunLedger = InMemoryLedger()
