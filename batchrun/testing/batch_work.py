"""How the fake server works its provider batches: each batch's clock, answering its lines with the
same fake model as the online routes, and ending it (completed, expired, cancelled).

A batch answers its lines evenly between ``answer_from`` and ``answer_until`` (wall clock,
frozen at creation), in a shuffled order unless told otherwise, so a batch cancelled or expired
part-way keeps a random part of its answers. A worker task ticks every few milliseconds while a
batch is live; each answered line is written to the batch's journal and logged as a
:class:`RequestRecord` (``api`` ``"batch:<api>"``) in the same step, so it is billed exactly
once, across restarts too. What differs between OpenAI and Anthropic (validation, the shape of a
result line, the files written at the end) is a :class:`Kind`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from array import array
from collections.abc import Iterable
from typing import Any, Protocol

import orjson

from batchrun.testing.anthropic import MessagesApi
from batchrun.testing.api import Api
from batchrun.testing.batch_store import BatchRecord, BatchStore
from batchrun.testing.faults import BatchFaults, Faults, content_fault
from batchrun.testing.openai import ChatApi, ResponsesApi
from batchrun.testing.request_log import RECORD_FIELDS, RequestRecord, new_record
from batchrun.testing.wire import Headers

log = logging.getLogger(__name__)

APIS: dict[str, Api] = {"chat": ChatApi(), "responses": ResponsesApi(), "messages": MessagesApi()}
# A batch line carries no headers of its own; the Messages version header is the batch's.
_LINE_HEADERS = Headers(None, None, b"2023-06-01")
_TICK_S = 0.02
_DAY_S = 86_400  # a batch's completion window, unless BatchFaults.expire_after_s says otherwise
_LINES_PER_STEP = 500  # then the worker yields to the event loop
LIVE = ("validating", "in_progress", "finalizing", "cancelling")
UNFINISHED = ("in_progress", "finalizing", "cancelling")  # validated, not ended: tokens enqueued


class Host(Protocol):
    """What the worker needs of the server that runs it."""

    faults: Faults
    batch_faults: BatchFaults
    api_key: str | None

    def next_seq(self) -> int: ...

    def key_for(self, api: Api | None, body: dict[str, Any]) -> str | None: ...

    def record(self, rec: RequestRecord) -> None: ...


class Batch:
    """One batch: its stored record and its progress (rebuilt from its journal at load)."""

    def __init__(self, rec: BatchRecord) -> None:
        self.rec = rec
        self.done = 0  # lines answered
        self.succeeded = 0  # ... with a 200
        self.failed = 0  # ... with an error status
        self.input_tokens = 0  # usage of the 200s
        self.output_tokens = 0
        self._order: list[int] | None = None
        self._index: array[int] | None = None

    def count(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.status == 200:
            self.succeeded += 1
            self.input_tokens += rec.prompt_tokens
            self.output_tokens += rec.completion_tokens
        else:
            self.failed += 1

    def order(self) -> list[int]:
        """The order its lines are answered in (a permutation of the input lines)."""
        if self._order is None:
            order = list(range(self.rec.total))
            if self.rec.shuffle:
                random.Random(self.rec.seed).shuffle(order)
            self._order = order
        return self._order

    def due(self, t: float) -> int:
        """How many lines should be answered by time ``t``."""
        r = self.rec
        if t < r.answer_from:
            return 0
        span = r.answer_until - r.answer_from
        if span <= 0 or t >= r.answer_until:
            return r.total
        return min(r.total, math.ceil(r.total * (t - r.answer_from) / span))

    def lines(self, store: BatchStore, which: list[int]) -> Iterable[Any]:
        """The parsed input lines ``which`` (indices into the batch's lines)."""
        if not which:  # a batch cancelled while validating has no lines (nor index)
            return
        if self._index is None:
            self._index = store.read_index(self.rec.id)
        index = self._index
        with open(store.requests_path(self.rec.id), "rb") as f:
            for i in which:
                f.seek(index[2 * i])
                yield orjson.loads(f.read(index[2 * i + 1] - index[2 * i]))


class Kind(Protocol):
    """What one batch API does its own way."""

    name: str  # "openai" | "anthropic"

    def validate(self, batch: Batch, worker: BatchWorker, now: float) -> None:
        """Validate a "validating" batch: it becomes "in_progress" (lines indexed) or "failed"."""

    def request(self, line: Any) -> tuple[str, Any]:
        """(custom_id, request body) of one of the batch's lines."""

    def result(self, batch: Batch, custom_id: str, status: int, body: bytes) -> bytes:
        """The result line of an answered line (``body``: the answer or error body)."""

    def end(self, batch: Batch, worker: BatchWorker, how: str, unanswered: list[str]) -> None:
        """Write what an ended batch leaves (output / error files, results)."""


class BatchWorker:
    """Every batch of the server, and the task that works them."""

    def __init__(self, host: Host, store: BatchStore, kinds: dict[str, Kind]) -> None:
        self.host = host
        self.store = store
        self.kinds = kinds
        self.batches: dict[str, Batch] = {}
        self._wake: asyncio.Event | None = None

    # ------------------------------------------------------------------ state

    def load(self) -> list[RequestRecord]:
        """Read every stored batch and its journal; returns the records of the answered lines."""
        records: list[RequestRecord] = []
        for rec in self.store.load_batches():
            batch = Batch(rec)
            for entry in self.store.read_answered(rec.id):
                line = RequestRecord(*entry["r"])
                batch.count(line)
                records.append(line)
            self.batches[rec.id] = batch
        records.sort(key=lambda r: r.seq)
        return records

    def create(self, batch_id: str, kind: str, api: str, seed: int, phases: bool,
               **fields: Any) -> Batch:
        """Save and start working a new batch, its clock set from the current BatchFaults:
        with ``phases`` (OpenAI), validating first and finalizing last."""
        bf = self.host.batch_faults
        now = time.time()
        validating = min(bf.validating_s, bf.turnaround_s) if phases else 0.0
        finalizing = bf.finalizing_s if phases else 0.0
        batch = Batch(BatchRecord(
            id=batch_id, kind=kind, api=api, order=self.next_order(), created_at=now,
            answer_from=now + validating,
            answer_until=now + max(bf.turnaround_s - finalizing, validating),
            ends_at=now + bf.turnaround_s,
            expires_at=now + (bf.expire_after_s if bf.expire_after_s is not None else _DAY_S),
            cancel_s=bf.cancel_s, seed=seed, shuffle=bf.shuffle, **fields))
        self.save(batch)
        self.batches[batch_id] = batch
        self._log_created(batch)
        self.wake()
        return batch

    def _log_created(self, batch: Batch) -> None:
        """Append the new batch to the store's created log, with the key of each request it holds."""
        r = batch.rec
        kind, api = self.kinds[r.kind], APIS[r.api]
        keys: list[str | None] = []
        custom_ids: list[Any] = []
        with open(self.store.requests_path(r.id), "rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                try:
                    custom_id, body = kind.request(orjson.loads(raw))
                except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                    custom_id, body = None, None
                custom_ids.append(custom_id)
                keys.append(self.host.key_for(api, body) if isinstance(body, dict) else None)
        self.store.append_created({"id": r.id, "kind": r.kind, "created_at": r.created_at,
                                   "input_file_id": r.input_file_id, "metadata": r.metadata,
                                   "total": len(keys), "custom_ids": custom_ids, "keys": keys})

    def save(self, batch: Batch) -> None:
        self.store.save_batch(batch.rec)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def find(self, kind: str, batch_id: str) -> Batch | None:
        batch = self.batches.get(batch_id)
        return batch if batch is not None and batch.rec.kind == kind else None

    def newest_first(self, kind: str) -> list[Batch]:
        return sorted((b for b in self.batches.values() if b.rec.kind == kind),
                      key=lambda b: b.rec.order, reverse=True)

    def next_order(self) -> int:
        return max((b.rec.order for b in self.batches.values()), default=0) + 1

    def enqueued_tokens(self, model: str | None) -> int:
        """Estimated prompt tokens of the unfinished batches of ``model``."""
        return sum(b.rec.tokens for b in self.batches.values()
                   if b.rec.kind == "openai" and b.rec.model == model and b.rec.status in UNFINISHED)

    def cancel(self, batch: Batch, now: float) -> None:
        """Start cancelling a live batch: no line is answered from now on."""
        if batch.rec.status in ("validating", "in_progress", "finalizing"):
            batch.rec.status = "cancelling"
            batch.rec.cancelling_at = now
            self.save(batch)
            self.wake()

    # ------------------------------------------------------------------ the task

    async def run(self) -> None:
        """Tick while any batch is live; sleep until woken when none is."""
        self._wake = wake = asyncio.Event()
        while True:
            try:
                more = self.tick(time.time())
            except Exception:  # keep serving; the test that made it fail sees it in the log
                log.exception("fake server: working the batches failed")
                more = False
                await asyncio.sleep(1.0)
            if more:
                await asyncio.sleep(0)
                continue
            if not any(b.rec.status in LIVE for b in self.batches.values()):
                wake.clear()
                await wake.wait()
                continue
            await asyncio.sleep(_TICK_S)

    def tick(self, now: float) -> bool:
        """Move every live batch on to ``now``; returns whether lines are still due (the step
        answered as many as it may)."""
        budget = _LINES_PER_STEP
        for batch in list(self.batches.values()):
            r = batch.rec
            if r.status == "validating":
                if now < r.answer_from:
                    continue
                self.kinds[r.kind].validate(batch, self, now)
                self.save(batch)
            if r.status in ("in_progress", "finalizing"):
                expiring = now >= r.expires_at
                budget -= self._answer(batch, batch.due(r.expires_at if expiring else now), budget)
                if budget <= 0:
                    return True
                if expiring:
                    self._end(batch, "expired", now)
                elif batch.done >= r.total:
                    if r.status == "in_progress" and now >= r.answer_until:
                        r.status, r.finalizing_at = "finalizing", now
                        self.save(batch)
                    if now >= r.ends_at:
                        self._end(batch, "completed", now)
            elif r.status == "cancelling":
                assert r.cancelling_at is not None
                if now >= r.cancelling_at + r.cancel_s:
                    self._end(batch, "cancelled", now)
        return False

    def _answer(self, batch: Batch, due: int, budget: int) -> int:
        """Answer the batch's lines up to ``due`` (at most ``budget``); returns how many."""
        start = batch.done
        stop = min(due, start + budget)
        if stop <= start:
            return 0
        kind = self.kinds[batch.rec.kind]
        now = time.time()
        journal: list[bytes] = []
        records: list[RequestRecord] = []
        order = batch.order()
        for n, line in enumerate(batch.lines(self.store, order[start:stop])):
            custom_id, body = kind.request(line)
            rec, result = self._answer_line(batch, kind, order[start + n], custom_id, body, now)
            journal.append(b'{"r":%s,"o":%s}\n' % (
                orjson.dumps([getattr(rec, f) for f in RECORD_FIELDS]), result))
            records.append(rec)
        # the journal first: a line is answered once it is there (a restart never answers it again)
        self.store.append_answered(batch.rec.id, b"".join(journal))
        for rec in records:
            batch.count(rec)
            self.host.record(rec)
        return stop - start

    def _answer_line(self, batch: Batch, kind: Kind, i: int, custom_id: str, body: Any,
                     now: float) -> tuple[RequestRecord, bytes]:
        """Answer line ``i`` as the online route would, with the batch's own per-line draws."""
        host = self.host
        f, bf = host.faults, host.batch_faults
        api = APIS[batch.rec.api]
        rng = random.Random(batch.rec.seed * 1_000_003 + i)
        u, v = rng.random(), rng.random()
        seq = host.next_seq()
        key: str | None = None
        prompt = completion = 0
        fault: str | None = None
        err: str | None = None
        if not isinstance(body, dict):
            outcome, status, err = "bad_request", 400, "The request body must be a JSON object."
        else:
            key = host.key_for(api, body)
            prompt = api.prompt_tokens(body)
            if (err := api.validate(body, _LINE_HEADERS)) is not None:
                outcome, status = "bad_request", 400
            elif u < bf.p_line_500:
                outcome, status = "500", 500
            elif u < bf.p_line_500 + bf.p_line_400:
                outcome, status = "400", 400
            else:
                outcome, status = "ok", 200
        if status == 200:
            assert isinstance(body, dict)
            if api.structured(body) and (f.output_faults_on_reask or not api.is_reask(body)):
                fault = content_fault(f, v)
            ans = api.answer(body, key, fault)
            completion = ans.tokens
            answer = api.render(body, seq, prompt, ans)
        else:
            answer = api.error_body(status, err, b"%d" % seq)
        rec = new_record(seq, now, now, "POST", batch.rec.endpoint, key, outcome, status, prompt,
                         completion, fault, "batch:" + api.name, False, batch.rec.id, custom_id)
        return rec, kind.result(batch, custom_id, status, answer)

    def _end(self, batch: Batch, how: str, now: float) -> None:
        r = batch.rec
        unanswered: list[str] = []
        if how != "completed":
            rest = batch.order()[batch.done:]
            kind = self.kinds[r.kind]
            unanswered = [kind.request(line)[0] for line in batch.lines(self.store, rest)]
        self.kinds[r.kind].end(batch, self, how, unanswered)
        r.unanswered = len(unanswered)
        r.status = how
        if how == "completed":
            r.completed_at = now
        elif how == "expired":
            r.expired_at = now
        else:
            r.cancelled_at = now
        self.save(batch)

    def journal(self, batch: Batch) -> Iterable[Any]:
        """The result lines of the batch's answered lines, in the order they were answered."""
        for entry in self.store.read_answered(batch.rec.id):
            yield entry["o"]
