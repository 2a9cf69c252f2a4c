"""Batch mode's side of the ledger: shards (one provider batch each) and the items they hold.

A shard's row and its items (``pending`` -> ``submitted``, ``items.shard_id``) are
committed in one transaction before the provider is asked to create the batch, so
a crash at any point leaves a shard that knows exactly which items it holds. Every
write is fenced by the job lock, like an exclusive run's claims: a run that stalled
and was taken over writes nothing more (LockLostError). A results line lands only
on an item still ``submitted`` in that shard, and its attempt row is written only
when it lands, so collecting a shard twice (a crash during write-back, a replayed
transaction) charges nothing twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import bindparam, case, func, insert, select, update

from batchrun.ledger.models import attempts as attempts_t
from batchrun.ledger.models import items as items_t
from batchrun.ledger.models import shards as shards_t
from batchrun.ledger.records import ShardRecord as ShardRecord  # where batch mode has found it
from batchrun.ledger.records import answered_routes, shard_record, turnaround_seconds
from batchrun.ledger.store import AttemptRecord, Ledger, Outcome, _no_nul
from batchrun.states import OPEN_SHARD_STATES, ItemState, ShardState

# What a shard's row may be updated with after it is made (ShardLedger.update).
_MUTABLE = frozenset({
    "state", "run_id", "input_file_id", "batch_id", "output_file_id", "error_file_id", "provider_status", "counts",
    "create_sent_at", "provider_created_at", "in_progress_at", "ended_at", "expires_at", "collected_at",
    "cancel_reason", "error",
})
# What a results line writes on the item it answers (a final state; or, going back, the last error).
_LANDED = (
    "state", "status_code", "response", "output", "parsed", "validation_errors", "request_id", "error_class",
    "error_message", "input_tokens", "output_tokens", "latency_ms", "finished_at", "cost_usd", "request_hash",
    "followups",
)
_BACK = ("status_code", "error_class", "error_message", "followups")
# A collected shard's ``error`` while its files are still at the provider (ShardLedger.close).
FILES_LEFT = "its files are still at the provider: the next run deletes them"


@dataclass(frozen=True)
class ShardItem:
    """What building an item's line of a request file needs."""

    id: int
    custom_id: str
    url: str | None
    body: str
    attempts: int
    max_tokens: int | None = None
    followups: str | None = None  # JSON [[invalid answer, feedback], ...]: re-asks so far

    @property
    def followup_pairs(self) -> list[tuple[str, str]]:
        """The re-asks so far as (invalid answer, feedback) pairs."""
        return [(str(a), str(n)) for a, n in orjson.loads(self.followups)] if self.followups else []


@dataclass
class ShardPlan:
    """The items chosen for a new shard, and what they add up to."""

    token: str
    kind: str
    endpoint: str | None
    model: str | None
    own_ids: bool
    item_ids: list[int] = field(default_factory=list)
    bytes: int = 0
    prompt_tokens: int = 0
    worst_usd: float | None = None


_SHARD_ITEM_COLUMNS = (
    items_t.c.id, items_t.c.custom_id, items_t.c.url, items_t.c.body, items_t.c.attempts, items_t.c.max_tokens,
    items_t.c.followups,
)


class ShardLedger:
    """The shard side of a :class:`~batchrun.ledger.store.Ledger` (same engine, same fences)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.engine = ledger.engine

    # -- reading ----------------------------------------------------------------

    def shards(self, job_id: int, *, open_only: bool = False) -> list[ShardRecord]:
        """The job's shards, oldest first (only those whose items are still submitted, with ``open_only``)."""
        stmt = select(shards_t).where(shards_t.c.job_id == job_id).order_by(shards_t.c.id)
        if open_only:
            stmt = stmt.where(shards_t.c.state.in_(list(OPEN_SHARD_STATES)))
        with self.engine.connect() as conn:
            return [shard_record(row._mapping) for row in conn.execute(stmt)]

    def get(self, shard_id: int) -> ShardRecord:
        with self.engine.connect() as conn:
            return shard_record(conn.execute(select(shards_t).where(shards_t.c.id == shard_id)).one()._mapping)

    def pending_items(self, job_id: int, *, after_id: int = 0, limit: int = 2000) -> list[ShardItem]:
        """Pending items of the job in input order, from ``after_id`` on: the candidates for a new shard."""
        return self._items(
            select(*_SHARD_ITEM_COLUMNS).where(
                items_t.c.job_id == job_id, items_t.c.state == ItemState.PENDING, items_t.c.id > after_id
            ).order_by(items_t.c.id).limit(limit)
        )

    def shard_items(self, shard_id: int, *, after_id: int = 0, limit: int = 2000) -> list[ShardItem]:
        """The items a shard holds (still submitted), in input order, from ``after_id`` on."""
        return self._items(
            select(*_SHARD_ITEM_COLUMNS).where(
                items_t.c.shard_id == shard_id, items_t.c.state == ItemState.SUBMITTED, items_t.c.id > after_id
            ).order_by(items_t.c.id).limit(limit)
        )

    def holds(self, shard_id: int) -> int:
        """How many items the shard still holds (submitted)."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).where(
                items_t.c.shard_id == shard_id, items_t.c.state == ItemState.SUBMITTED)).scalar() or 0)

    def iter_shard_items(self, shard_id: int, *, chunk: int = 2000) -> Iterator[ShardItem]:
        after = 0
        while True:
            rows = self.shard_items(shard_id, after_id=after, limit=chunk)
            yield from rows
            if len(rows) < chunk:
                return
            after = rows[-1].id

    def _items(self, stmt: Any) -> list[ShardItem]:
        with self.engine.connect() as conn:
            return [ShardItem(*row) for row in conn.execute(stmt)]

    def items_by_line_id(self, shard: ShardRecord, line_ids: Sequence[str]) -> dict[str, ShardItem]:
        """The shard's submitted items that these results lines answer, by the custom_id their line carried."""
        if not line_ids:
            return {}
        cond = [items_t.c.shard_id == shard.id, items_t.c.state == ItemState.SUBMITTED]
        if shard.own_ids:
            cond += [items_t.c.job_id == shard.job_id, items_t.c.custom_id.in_(list(line_ids))]
        else:
            cond.append(items_t.c.id.in_([i for i in map(shard.item_of, line_ids) if i is not None]))
        found = self._items(select(*_SHARD_ITEM_COLUMNS).where(*cond))
        return {shard.line_id(item.id, item.custom_id): item for item in found}

    def answered_by_route(self, job_id: int) -> dict[str, int]:
        """The job's succeeded items by how they were answered: ``batch`` (a shard's results),
        ``online``, or ``cache`` (an answer reused from the response cache: nothing was sent)."""
        i = items_t.c
        route = case((i.cached_from.is_not(None), "cache"), (i.shard_id.is_not(None), "batch"), else_="online")
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(route, func.count())
                .where(i.job_id == job_id, i.state == ItemState.SUCCEEDED)
                .group_by(route)
            ).all()
        return answered_routes(rows)

    def turnarounds(self, kind: str, limit: int = 200) -> list[float]:
        """Seconds from created to ended of this ledger's latest ended shards of a provider kind."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(shards_t.c.ended_at - func.coalesce(shards_t.c.provider_created_at, shards_t.c.created_at))
                .where(shards_t.c.kind == kind, shards_t.c.ended_at.is_not(None))
                .order_by(shards_t.c.id.desc()).limit(limit)
            ).scalars().all()
        return turnaround_seconds(rows)

    def now(self) -> float:
        """Now, by the clock shard times are kept in (the database's on PostgreSQL)."""
        with self.engine.connect() as conn:
            return self.ledger._now(conn)

    def deadline_passed(self, job_id: int, seconds: float) -> bool:
        """Whether the job's first shard was made more than ``seconds`` ago (``[batch] deadline``)."""
        with self.engine.connect() as conn:
            first = conn.execute(select(func.min(shards_t.c.created_at)).where(shards_t.c.job_id == job_id)).scalar()
            return first is not None and self.ledger._now(conn) - float(first) > seconds

    def known_batch_ids(self, kind: str) -> set[str]:
        """The provider batch ids every shard of this ledger has recorded (of any job)."""
        with self.engine.connect() as conn:
            return {
                str(b) for b in conn.execute(
                    select(shards_t.c.batch_id).where(shards_t.c.kind == kind, shards_t.c.batch_id.is_not(None))
                ).scalars()
            }

    # -- writing (fenced by the job lock) -----------------------------------------

    def add(self, job_id: int, run_id: str, plan: ShardPlan) -> ShardRecord:
        """Make a shard of ``plan``'s items in one transaction: the row, and its items pending -> submitted.

        Only items still pending are taken (the shard's counts are those it really holds).
        """
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, job_id, run_id)
            # A transaction replayed after its acknowledgement was lost (PostgreSQL ride-out) finds its shard.
            made = conn.execute(select(shards_t).where(shards_t.c.token == plan.token)).one_or_none()
            if made is not None:
                return shard_record(made._mapping)
            now = self.ledger._now(conn)
            inserted = conn.execute(
                insert(shards_t).values(
                    job_id=job_id, token=plan.token, kind=plan.kind, state=ShardState.PREPARING, run_id=run_id,
                    endpoint=plan.endpoint, model=plan.model, own_ids=plan.own_ids, requests=len(plan.item_ids),
                    bytes=plan.bytes, prompt_tokens=plan.prompt_tokens, worst_usd=plan.worst_usd, created_at=now,
                )
            )
            shard_id = int(inserted.inserted_primary_key[0])  # type: ignore[index]
            taken = 0
            for start in range(0, len(plan.item_ids), 1000):
                chunk = plan.item_ids[start:start + 1000]
                taken += conn.execute(
                    update(items_t)
                    .where(items_t.c.id.in_(chunk), items_t.c.job_id == job_id, items_t.c.state == ItemState.PENDING)
                    .values(state=ItemState.SUBMITTED, shard_id=shard_id)
                ).rowcount
            if taken != len(plan.item_ids):
                conn.execute(update(shards_t).where(shards_t.c.id == shard_id).values(requests=taken))
            row = conn.execute(select(shards_t).where(shards_t.c.id == shard_id)).one()
        return shard_record(row._mapping)

    def update(self, shard: ShardRecord, holder: str, /, **values: Any) -> ShardRecord:
        """Record what the provider said of a shard (ids, status, counts, times); the row as it is now.

        ``holder`` is the run that holds the job lock (the fence).
        """
        unknown = set(values) - _MUTABLE
        if unknown:
            raise ValueError(f"not a shard field that changes: {', '.join(sorted(unknown))}")
        if "counts" in values and values["counts"] is not None:
            values["counts"] = orjson.dumps(values["counts"]).decode()
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, shard.job_id, holder)
            conn.execute(update(shards_t).where(shards_t.c.id == shard.id).values(**values))
            row = conn.execute(select(shards_t).where(shards_t.c.id == shard.id)).one()
        return shard_record(row._mapping)

    def sending_create(self, shard: ShardRecord, holder: str) -> ShardRecord:
        """The create call is about to go out: the shard is ``creating`` (whether the batch exists is
        unknown from here until reconciled), by ``holder``, sent now by the ledger's clock, counted."""
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, shard.job_id, holder)
            conn.execute(
                update(shards_t).where(shards_t.c.id == shard.id).values(
                    state=ShardState.CREATING, run_id=holder, create_sent_at=self.ledger._now(conn),
                    creates=shards_t.c.creates + 1,
                )
            )
            row = conn.execute(select(shards_t).where(shards_t.c.id == shard.id)).one()
        return shard_record(row._mapping)

    def refuse(
        self, shard: ShardRecord, run_id: str, reason: str, failed: Mapping[int, str] | None = None,
        *, left: ItemState = ItemState.PENDING,
    ) -> int:
        """The provider refused the shard (validation, a token limit) or no longer has it: its items go
        back to ``left`` (pending; cancelled when the user cancelled it), except those ``failed`` names
        (item id -> why), which fail for good. Nothing is charged."""
        failed = failed or {}
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, shard.job_id, run_id)
            for item_id, message in failed.items():
                conn.execute(
                    update(items_t)
                    .where(items_t.c.id == item_id, items_t.c.shard_id == shard.id,
                           items_t.c.state == ItemState.SUBMITTED)
                    .values(state=ItemState.FAILED, error_class="batch_refused", error_message=_no_nul(message),
                            finished_at=self.ledger._now(conn))
                )
            back = conn.execute(
                update(items_t)
                .where(items_t.c.shard_id == shard.id, items_t.c.state == ItemState.SUBMITTED)
                .values(state=left, shard_id=None if left == ItemState.PENDING else shard.id)
            ).rowcount
            conn.execute(
                update(shards_t).where(shards_t.c.id == shard.id).values(
                    state=ShardState.FAILED, error=_no_nul(reason), collected_at=self.ledger._now(conn),
                )
            )
        return int(back)

    def record_results(
        self, shard: ShardRecord, run_id: str, outcomes: Sequence[Outcome], attempts: Sequence[AttemptRecord]
    ) -> int:
        """Write a batch of a shard's results lines in one transaction (one statement per kind of
        write, executemany); how many landed.

        An outcome lands only on an item still submitted in this shard; the attempt
        of the same item is written (and charged) only when its outcome lands.
        """
        by_item = {a.item_id: a for a in attempts}
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, shard.job_id, run_id)
            held = (items_t.c.shard_id == shard.id) & (items_t.c.state == ItemState.SUBMITTED)
            ids = [o.item_id for o in outcomes]
            still: set[int] = set()
            for start in range(0, len(ids), 1000):
                query = select(items_t.c.id).where(items_t.c.id.in_(ids[start:start + 1000]), held)
                if not self.ledger.is_sqlite:
                    query = query.with_for_update()
                still.update(int(i) for i in conn.execute(query).scalars())
            landing = [o for o in outcomes if o.item_id in still]
            clean: Callable[[Any], Any] = _as_is if self.ledger.is_sqlite else _no_nul
            for columns, fixed, batch in (
                (_BACK, {"state": ItemState.PENDING, "shard_id": None},
                 [o for o in landing if o.state == ItemState.PENDING]),
                (_LANDED, {}, [o for o in landing if o.state != ItemState.PENDING]),
            ):
                if not batch:
                    continue
                values: dict[str, Any] = {c: bindparam(f"b_{c}") for c in columns}
                conn.execute(
                    update(items_t).where((items_t.c.id == bindparam("b_id")) & held)
                    .values(**values, **fixed, attempts=items_t.c.attempts + bindparam("b_charge")),
                    [{"b_id": o.item_id, "b_charge": _charge(by_item.get(o.item_id)),
                      **{f"b_{c}": clean(getattr(o, c)) for c in columns}} for o in batch],
                )
            rows = [_attempt_row(a, self.ledger.is_sqlite) for o in landing if (a := by_item.get(o.item_id))]
            if rows:
                conn.execute(insert(attempts_t), rows)
        return len(landing)

    def close(
        self, shard: ShardRecord, run_id: str, *, left: ItemState = ItemState.PENDING, files_left: bool = False
    ) -> int:
        """The shard's results are all in: what it still holds (lines missing from the results) goes back
        to ``left`` (pending, uncharged; cancelled when the user cancelled it), and the shard is collected.

        ``files_left``: its files are still at the provider, to be deleted — marked (``error`` is
        :data:`FILES_LEFT`) in the same transaction, so a crash before they are deleted leaves a shard
        that a later run deletes them for (:meth:`files_left`); cleared once they are gone."""
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, shard.job_id, run_id)
            back = conn.execute(
                update(items_t)
                .where(items_t.c.shard_id == shard.id, items_t.c.state == ItemState.SUBMITTED)
                .values(state=left, shard_id=None if left == ItemState.PENDING else shard.id,
                        finished_at=None if left == ItemState.PENDING else self.ledger._now(conn))
            ).rowcount
            conn.execute(
                update(shards_t).where(shards_t.c.id == shard.id).values(
                    state=ShardState.COLLECTED, collected_at=self.ledger._now(conn),
                    **({"error": FILES_LEFT} if files_left else {}),
                )
            )
        return int(back)

    def files_left(self, job_id: int) -> list[ShardRecord]:
        """The job's collected shards whose files are still to be deleted at the provider."""
        with self.engine.connect() as conn:
            return [shard_record(row._mapping) for row in conn.execute(
                select(shards_t).where(shards_t.c.job_id == job_id, shards_t.c.state == ShardState.COLLECTED,
                                       shards_t.c.error == FILES_LEFT).order_by(shards_t.c.id)
            )]

    def fail_items(self, job_id: int, run_id: str, failures: Mapping[int, tuple[str, str]]) -> None:
        """Fail pending items that cannot be put in any batch (item id -> (error class, message))."""
        if not failures:
            return
        with self.ledger._write() as conn:
            self.ledger._renew_lock(conn, job_id, run_id)
            for item_id, (error_class, message) in failures.items():
                conn.execute(
                    update(items_t)
                    .where(items_t.c.id == item_id, items_t.c.state == ItemState.PENDING)
                    .values(state=ItemState.FAILED, error_class=error_class, error_message=_no_nul(message),
                            finished_at=time.time())
                )

    def cancel_requested(self, job_id: int) -> list[ShardRecord]:
        """Mark the job's live shards cancelled by the user (``batchrun cancel``), unfenced: the command
        holds no lock. Their finished lines are still collected; the rest become cancelled."""
        with self.ledger._write() as conn:
            conn.execute(
                update(shards_t)
                .where(shards_t.c.job_id == job_id, shards_t.c.state.in_(list(OPEN_SHARD_STATES)),
                       shards_t.c.cancel_reason.is_(None))
                .values(cancel_reason="user")
            )
            rows = conn.execute(
                select(shards_t).where(shards_t.c.job_id == job_id, shards_t.c.state.in_(list(OPEN_SHARD_STATES)))
            ).all()
        return [shard_record(r._mapping) for r in rows]


def _as_is(value: Any) -> Any:
    return value


def _charge(attempt: AttemptRecord | None) -> int:
    """What an outcome adds to its item's attempts: 1 for an attempt that counts (an unworked line does not)."""
    return 1 if attempt is not None and attempt.counted else 0


def _attempt_row(attempt: AttemptRecord, is_sqlite: bool) -> dict[str, Any]:
    values = {k: v for k, v in attempt.__dict__.items() if k != "counted"}
    return values if is_sqlite else {k: _no_nul(v) for k, v in values.items()}
