"""Batch mode: a job worked through its provider's batch API, in shards (one provider batch each).

The loop, in one place. Every step is a short ledger transaction fenced by the job
lock, and every provider call is made only once the ledger says what it is for:

1. **Plan** a shard: pending items in input order, as many as fit the provider's
   limits (requests, bytes; one endpoint and one model per OpenAI file), ``[batch]``
   ``max_requests``/``max_bytes``, the enqueued-token limit (estimated prompt tokens
   of every unfinished shard together) and the budget (each shard reserves its worst
   case at the batch price). Commit the shard row and its items (``submitted``).
2. **Submit** it: build the request file on disk from the shard's items, upload it
   (OpenAI), mark the shard ``creating`` (committed), create the batch (OpenAI with
   ``metadata`` naming the shard), record its id (``live``).
3. **Reconcile** a ``creating`` shard whose create answer was lost (a crash, a 5xx, a
   timeout: the batch may exist): list the provider's batches and adopt the one made
   for it (OpenAI: by its metadata or input file; Anthropic: by its results' line ids,
   which name the shard); only when two listings a few seconds apart find none, and no
   create of it can still be on its way, is it sent again.
4. **Poll** live shards, backing off (429/5xx on a poll are not errors).
5. **Collect** an ended shard: stream its results from disk, match each line to its
   item by custom_id, judge it as an online answer is judged (usage, batch-rate cost,
   schema, error class), write back in batches; lines never worked (expired,
   cancelled) and items missing from the results go back to pending, uncharged.
   Then delete the shard's files at the provider (``[batch] keep_files`` keeps them); the shard is
   marked until they are gone, so a run that died first leaves the next one to delete them.

It stops when nothing is left, when told to (signal, deadline), or — without
``wait`` — once all it can do now is wait for the provider (``StopReason.AT_PROVIDER``:
a later run collects). Past ``[batch] deadline`` (from the job's first shard) it
makes no more shards, cancels the live ones, collects what they finished and
reports that the rest should go online (:attr:`BatchResult.go_online`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from batchrun.budget import ROUNDING_MARGIN, usd, worst_case_rate
from batchrun.cache import cache_scope, request_key, reusable
from batchrun.errors import AuthError, LockLostError, OutputInvalidError, PermanentError, ProviderError, RetryableError
from batchrun.hints import command
from batchrun.ledger import LEDGER_RETRY_SECONDS, AsyncLedger, AttemptRecord, JobRecord, Ledger, Outcome
from batchrun.ledger.store import attempt_message
from batchrun.ledger.shards import ShardItem, ShardLedger, ShardPlan, ShardRecord
from batchrun.pricing import Price, price_for
from batchrun.providers import Provider, batch_api_for, provider_for
from batchrun.providers.base import PreparedRequest
from batchrun.providers.batches import BatchApi, BatchRefusedError, FileFormat, RemoteBatch, ResultLine, spooled
from batchrun.spec import BATCH_DISCOUNT, JobSpec
from batchrun.states import ItemState, ShardState, StopReason
from batchrun.validate import OutputValidator, feedback

log = logging.getLogger(__name__)

ID_MARGIN = 40  # bytes a line may grow by when its custom_id is replaced by one naming the shard
RESULTS_CHUNK = 500  # results lines written back per transaction
MAX_REFUSALS = 5  # shards the provider refuses in a row before the run stops
MAX_CREATES = 3  # create calls for one shard never seen at the provider before the run stops
CREATE_MARGIN_S = 5.0  # at least this long past a create's timeout before its batch is taken for never made
CANCELLING = frozenset({"cancelling", "cancelled", "canceling", "ended"})  # a cancel is under way or moot


@dataclass(frozen=True)
class BatchOptions:
    """How a batch-mode run behaves, beyond the spec."""

    command: str = "submit"
    wait: bool = True  # wait for the shards to end; else stop once all that is left is waiting (exit 75)
    create: bool = True  # make new shards (False: only collect what is at the provider)
    heartbeat_interval: float = 10.0
    reconcile_wait: float = 5.0  # between the two listings that find a lost create never happened
    ledger_retry_seconds: float = LEDGER_RETRY_SECONDS
    api_retry_seconds: float = 300.0  # how long a provider call that fails transiently is retried
    transport: httpx.AsyncBaseTransport | None = None  # tests: the batch API's HTTP transport
    on_event: Callable[[str], None] | None = None  # hears what the shards do (created, polled, collected)


@dataclass
class BatchStats:
    """What a batch-mode run did, for progress and the closing line."""

    started_at: float = field(default_factory=time.time)
    shards_created: int = 0
    shards_collected: int = 0
    done: dict[str, int] = field(default_factory=dict)  # items settled by results lines, by state
    back: int = 0  # items a shard gave back to pending (expired, cancelled, missing, refused)
    reused: int = 0  # items finished with an answer from the response cache (no request)


@dataclass(frozen=True)
class BatchResult:
    run_id: str
    stop_reason: StopReason | None
    stop_message: str | None
    at_provider: int = 0  # items left in live shards
    go_online: bool = False  # the deadline passed: what is left goes online


class RequestFile:
    """A shard's request file on disk, written entry by entry in its API's framing."""

    def __init__(self, path: Path, fmt: FileFormat) -> None:
        self.fmt = fmt
        self.entries = 0
        self._out = path.open("wb")
        self._out.write(fmt.head)

    def add(self, entry: bytes) -> None:
        if self.entries:
            self._out.write(self.fmt.separator)
        self._out.write(entry)
        self.entries += 1

    def close(self) -> None:
        if not self._out.closed:
            self._out.write(self.fmt.tail)
            self._out.close()


class BatchRunner:
    """Works one job through its provider's batch API until nothing is left or it stops."""

    def __init__(
        self,
        ledger: Ledger,
        job: JobRecord,
        spec: JobSpec,
        options: BatchOptions | None = None,
    ) -> None:
        self.ledger = ledger
        self.job = job
        # A batch line is one plain request: never streamed.
        self.spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, stream=False))
        self.options = options or BatchOptions()
        self.provider: Provider = provider_for(self.spec)
        self.api: BatchApi = batch_api_for(
            self.spec, self.provider, transport=self.options.transport, retry_seconds=self.options.api_retry_seconds
        )
        self.shards = ShardLedger(ledger)
        self.stats = BatchStats()
        self.run_id = ""
        self._on_event = self.options.on_event
        self._db = AsyncLedger(ledger, ride_out_seconds=self.options.ledger_retry_seconds, thread_name="batchrun-batch")
        self._stop = asyncio.Event()
        self._stop_reason: StopReason | None = None
        self._stop_message: str | None = None
        self.validator = OutputValidator(spec.output.schema) if spec.output.schema is not None else None
        self.price = self.spec.batch_price()
        self._model_prices: dict[str, Price | None] = {}
        self._scope = cache_scope(spec.provider)
        # The job lock goes stale after lease_seconds / 2: beat well inside it.
        self._heartbeat_every = min(self.options.heartbeat_interval, self.spec.run.lease_seconds / 4)
        self._ledger_ahead = 0.0  # the ledger's clock minus this host's (the database's on PostgreSQL)
        self._next_poll: dict[int, float] = {}
        self._poll_every: dict[int, float] = {}
        self._missing_since: dict[int, float] = {}  # a creating shard not found at the provider, since
        self._answered: set[int] = set()  # shards whose create this run sent and the provider answered (any status)
        self._parked: set[int] = set()  # creating shards that wait on the provider (look-alikes, a create in flight)
        self._refusals = 0
        self._token_cap: int | None = None  # learnt from token_limit_exceeded: enqueued tokens that fit
        self._size_cap: int | None = None  # learnt from a batch refused as a whole: requests that may fit
        self._go_online = False
        self._cancel_sent: set[int] = set()  # shards this run asked the provider to cancel
        self._uploaded: set[int] = set()  # shards whose file this run sent (or tried to)

    # -- control ------------------------------------------------------------

    def request_stop(self, reason: StopReason, message: str | None = None) -> None:
        """Stop at the next step (first reason wins); what is at the provider stays there."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_message = message
            log.info("stopping batch run: %s", message or reason, extra={"job": self.job.id})
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _event(self, message: str) -> None:
        log.info("%s", message, extra={"job": self.job.id})
        if self._on_event is not None:
            self._on_event(message)

    async def _ledger(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self._db.call(lambda: fn(*args, **kwargs))

    # -- the run ------------------------------------------------------------

    async def run(self) -> BatchResult:
        """Work the job; how the run ended. Raises JobLockedError if another run holds it."""
        run_id = os.urandom(8).hex()
        try:
            self.run_id = await self._ledger(
                self.ledger.start_run, self.job.id, self.options.command, exclusive=True,
                stale_after=self.spec.run.lock_stale_seconds, run_id=run_id,
            )
            self._ledger_ahead = await self._ledger(self.shards.now) - time.time()
            orphans = await self._ledger(self.ledger.requeue_orphans, self.job.id, self.run_id)
            if orphans:
                log.info("put %d items left running by an earlier run back to pending", orphans)
            beat = asyncio.create_task(self._heartbeat(), name="batchrun-batch-heartbeat")
            deadline = None
            if self.spec.run.max_runtime > 0:
                deadline = asyncio.get_running_loop().call_later(
                    self.spec.run.max_runtime, self.request_stop, StopReason.DEADLINE,
                    f"--max-runtime of {self.spec.run.max_runtime:g} s reached",
                )
            try:
                await self._loop()
            except LockLostError as lost:
                self.request_stop(StopReason.LOCK_LOST, lost.message)
            except AuthError as exc:
                self.request_stop(StopReason.AUTH, f"authentication refused: {exc.message}")
            finally:
                if deadline is not None:
                    deadline.cancel()
                beat.cancel()
                await asyncio.gather(beat, return_exceptions=True)
            left = sum(s.requests for s in await self._ledger(self.shards.shards, self.job.id, open_only=True))
        finally:
            await self.api.aclose()
            self._db.close()
        return BatchResult(self.run_id, self._stop_reason, self._stop_message, at_provider=left,
                           go_online=self._go_online)

    async def _loop(self) -> None:
        if not self.spec.batch.keep_files:  # an earlier run collected these, and died before deleting their files
            for shard in await self._ledger(self.shards.files_left, self.job.id):
                if self.stopping:
                    return
                await self._discard(shard)
        while not self.stopping:
            shards = await self._ledger(self.shards.shards, self.job.id, open_only=True)
            for shard in shards:
                if self.stopping:
                    return
                await self._advance(shard)
            await self._check_deadline(shards)
            if not self._go_online and self.options.create:
                while not self.stopping and await self._new_shard():
                    pass
            shards = await self._ledger(self.shards.shards, self.job.id, open_only=True)
            if not shards:
                # Nothing at the provider: what is pending (if anything) cannot go in a batch now.
                if self.spec.batch.reask == "online" and await self._ledger(self._has_pending):
                    self._go_online = True  # the re-asks ([batch] reask = "online")
                return
            if not self.options.wait and all(s.state == ShardState.LIVE or s.id in self._parked for s in shards):
                self.request_stop(
                    StopReason.AT_PROVIDER,
                    f"{sum(s.requests for s in shards)} items at the provider in {len(shards)} batches; "
                    f"`{command(self.ledger.url, 'resume', self.job.id)}` collects them",
                )
                return
            await self._sleep(self._until_next(shards))

    async def _advance(self, shard: ShardRecord) -> None:
        """One step of a shard, by its state (once it is due: a shard backs off after a failed step)."""
        due = time.monotonic() >= self._next_poll.get(shard.id, 0.0)
        if shard.cancel_reason == "user" and shard.state == ShardState.PREPARING:
            back = await self._ledger(self.shards.close, shard, self.run_id, left=ItemState.CANCELLED)
            self._event(f"shard {shard.id}: cancelled before it reached the provider ({_n(back, 'item')} cancelled)")
            return
        if shard.state == ShardState.LIVE and shard.cancel_reason and shard.id not in self._cancel_sent \
                and shard.provider_status not in CANCELLING:
            await self._cancel_live([shard], shard.cancel_reason)
        if not due:
            return
        if shard.state == ShardState.PREPARING:
            await self._guarded(shard, self._submit(shard))
        elif shard.state == ShardState.CREATING:
            await self._guarded(shard, self._reconcile(shard))
        elif shard.state == ShardState.LIVE:
            await self._guarded(shard, self._poll(shard))
        elif shard.state == ShardState.ENDED:
            await self._guarded(shard, self._collect(shard))

    async def _guarded(self, shard: ShardRecord, step: Coroutine[Any, Any, None]) -> None:
        """A shard's step, its provider errors judged: a transient one is tried again later, one that
        waiting cannot mend stops the run; a refused key or a lost lock is raised.

        A stop (signal, --max-runtime) gives a step under way ``grace_seconds`` to end (a provider
        call being retried can take minutes), then cancels it: every step leaves its shard in a
        state the next run carries on from (a create cut off is reconciled).
        """
        task = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait([task], timeout=self.spec.run.grace_seconds)
            if not task.done():
                task.cancel()
                log.warning("shard %d (%s): step cut off by the stop", shard.id, shard.state)
                await asyncio.gather(task, return_exceptions=True)
                return
            task.result()
        except (AuthError, LockLostError):
            raise
        except RetryableError as exc:
            log.warning("shard %d (%s): %s; trying again later", shard.id, shard.state, exc.message)
            self._back_off(shard)
        except ProviderError as exc:
            self.request_stop(StopReason.ERROR, f"shard {shard.id} ({shard.batch_id or shard.state}): {exc.message}")
        finally:
            stop.cancel()

    # -- planning and submitting ---------------------------------------------

    async def _new_shard(self) -> bool:
        """Plan and commit one more shard, and submit it; False when none can be made now."""
        open_shards = await self._ledger(self.shards.shards, self.job.id, open_only=True)
        with spooled(f"batchrun-{self.job.id}-") as path:
            plan, failures = await self._db.call(self._plan, open_shards, path)
            if failures:
                await self._ledger(self.shards.fail_items, self.job.id, self.run_id, failures)
            if plan is None:
                return bool(failures)
            shard = await self._ledger(self.shards.add, self.job.id, self.run_id, plan)
            self.stats.shards_created += 1
            # The file was written as the items were chosen, each line under its own custom_id;
            # a shard that must name its lines otherwise (or took fewer items) is written again.
            built = path if shard.own_ids and shard.requests == len(plan.item_ids) else None
            await self._guarded(shard, self._submit(shard, built))
        return True

    def _plan(
        self, open_shards: list[ShardRecord], path: Path
    ) -> tuple[ShardPlan | None, dict[int, tuple[str, str]]]:
        """The next shard's items, its request file written to ``path`` as they are chosen (on the
        ledger's thread: it reads items and builds each request); and the items no batch can take."""
        api, batch = self.api, self.spec.batch
        max_requests = min(api.max_requests, batch.max_requests or api.max_requests, self._size_cap or api.max_requests)
        fmt = api.file_format
        max_bytes = min(api.max_bytes, batch.max_bytes or api.max_bytes) - len(fmt.head) - len(fmt.tail)
        queued = sum(s.prompt_tokens for s in open_shards)
        caps = [cap for cap in (batch.enqueued_tokens or None, self._token_cap) if cap is not None]
        token_room = min(caps) - queued if caps else None
        usd_room = None
        rate = worst_case_rate(self.price) if self.price is not None else 0.0
        if self.spec.run.budget_usd > 0:  # what was spent, and what the open shards reserved
            usd_room = self.spec.run.budget_usd * (1.0 - ROUNDING_MARGIN) - self.ledger.spent_usd(self.job.id)
        plan: ShardPlan | None = None
        failures: dict[int, tuple[str, str]] = {}
        over_budget: float | None = None
        after = 0
        out = RequestFile(path, fmt)
        try:
            while over_budget is None:
                items = self.shards.pending_items(self.job.id, after_id=after)
                reused = self._reuse_answers(items) if self.spec.run.cache else set()
                for item in items:
                    after = item.id
                    if item.id in reused or (item.followups and self.spec.batch.reask == "online"):
                        continue  # answered from the cache; a re-ask that goes online
                    try:
                        request = self._prepare(item)
                    except ValueError as exc:
                        failures[item.id] = ("bad_request", f"cannot build the request: {exc}")
                        continue
                    endpoint = api.endpoint_of(item.url)
                    model = self._model_of(request)
                    line = api.line(item.custom_id, endpoint, request)
                    size = len(line) + ID_MARGIN + len(fmt.separator)
                    estimate = self.provider.estimate_tokens(request)
                    worst = estimate.total * rate / 1e6 if usd_room is not None else None
                    if plan is None:
                        if size > max_bytes:
                            failures[item.id] = ("too_large", f"its request ({size:,} bytes) is over a batch's "
                                                 f"{max_bytes:,}-byte limit")
                            continue
                        if token_room is not None and estimate.prompt > token_room:
                            if not open_shards:
                                failures[item.id] = ("too_large", f"its prompt (~{estimate.prompt:,} tokens) alone "
                                                     "is over the enqueued-token limit")
                                continue
                            return None, failures  # wait for the unfinished shards to end
                        if worst is not None and usd_room is not None and worst > usd_room:
                            over_budget = worst
                            break
                        plan = ShardPlan(
                            token=f"{self.job.id}-{secrets.token_hex(8)}", kind=self.spec.provider.kind,
                            endpoint=endpoint, model=model, own_ids=True,
                            worst_usd=0.0 if usd_room is not None else None,
                        )
                    elif endpoint != plan.endpoint or model != plan.model:
                        continue  # one endpoint and one model per batch: it waits for a shard of its own
                    elif (len(plan.item_ids) >= max_requests or plan.bytes + size > max_bytes
                          or (token_room is not None and plan.prompt_tokens + estimate.prompt > token_room)
                          or (worst is not None and usd_room is not None
                              and (plan.worst_usd or 0.0) + worst > usd_room)):
                        return plan, failures
                    out.add(line)
                    plan.item_ids.append(item.id)
                    plan.bytes += size
                    plan.prompt_tokens += estimate.prompt
                    if worst is not None:
                        plan.worst_usd = (plan.worst_usd or 0.0) + worst
                    plan.own_ids = plan.own_ids and api.accepts_custom_id(item.custom_id)
                if len(items) < 2000:
                    break
        finally:
            out.close()
        if plan is None and over_budget is not None and not open_shards:
            self.request_stop(
                StopReason.BUDGET,
                f"budget of {usd(self.spec.run.budget_usd)} reached: the next request may cost up to "
                f"{usd(over_budget)} at the batch price; the rest stays pending",
            )
        return plan, failures

    def _reuse_answers(self, items: list[ShardItem]) -> set[int]:
        """Finish the items whose request another job already got an answer to (the response cache):
        succeeded, nothing sent, no cost. The ids of those finished. On the ledger's thread."""
        keys: dict[str, list[ShardItem]] = {}
        for item in items:
            if item.followups:
                continue  # a re-ask asks something else
            key = self._key(item)
            if key is not None:
                keys.setdefault(key, []).append(item)
        found = self.ledger.find_cached(keys) if keys else {}
        outcomes: list[Outcome] = []
        for key, answer in found.items():
            ok, parsed = reusable(answer, self.validator, self.provider)
            if not ok:
                continue
            for item in keys[key]:
                outcomes.append(Outcome(
                    item_id=item.id, state=ItemState.SUCCEEDED, attempts=item.attempts,
                    status_code=answer.status_code, response=answer.response, output=answer.output, parsed=parsed,
                    request_id=answer.request_id, input_tokens=answer.input_tokens,
                    output_tokens=answer.output_tokens, finished_at=time.time(), cost_usd=0.0, request_hash=key,
                    cached_from=answer.item_id,
                ))
        if outcomes:
            self.ledger.record(self.run_id, outcomes, [])  # a success lands on an item with no answer yet
            self.stats.done[ItemState.SUCCEEDED] = self.stats.done.get(ItemState.SUCCEEDED, 0) + len(outcomes)
            self.stats.reused += len(outcomes)
        return {o.item_id for o in outcomes}

    def _has_pending(self) -> bool:
        return bool(self.shards.pending_items(self.job.id, limit=1))

    def _prepare(self, item: ShardItem) -> PreparedRequest:
        return self.provider.prepare(item.url, item.body, max_tokens=item.max_tokens, followups=item.followup_pairs)

    def _model_of(self, request: PreparedRequest) -> str | None:
        if self.spec.provider.model:
            return self.spec.provider.model
        model = orjson.loads(request.content).get("model")
        return model if isinstance(model, str) else None

    def _write_file(self, shard: ShardRecord, path: Path) -> int:
        """The shard's request file, from its items (on the ledger's thread); the requests written."""
        out = RequestFile(path, self.api.file_format)
        try:
            for item in self.shards.iter_shard_items(shard.id):
                out.add(self.api.line(shard.line_id(item.id, item.custom_id), shard.endpoint, self._prepare(item)))
        finally:
            out.close()
        return out.entries

    async def _submit(self, shard: ShardRecord, built: Path | None = None) -> None:
        """Upload a prepared shard's file and create its batch; the create's fate recorded first.

        ``built`` is its request file when already written; else it is written from the shard's items.
        """
        with spooled(f"batchrun-{shard.token}-") as spool:
            path = built or spool
            if built is None and await self._db.call(self._write_file, shard, path) == 0:
                await self._ledger(self.shards.close, shard, self.run_id)  # its items went elsewhere meanwhile
                return
            if shard.input_file_id is None:
                # An upload whose answer was lost (a crash, a 5xx after storing it) left the file there.
                tried = shard.run_id != self.run_id or shard.id in self._uploaded
                found = await self.api.find_upload(shard) if tried else None
                self._uploaded.add(shard.id)
                file_id = found or await self.api.upload(shard, path)
                if file_id is not None:
                    shard = await self._ledger(self.shards.update, shard, self.run_id, input_file_id=file_id)
            # The create must go out before create_timeout has passed since the fence below (a run frozen
            # in between sends nothing once it wakes): a run that takes this shard over waits that long
            # before it concludes that no create is on its way.
            timeout = self._create_timeout(shard)
            send_by = asyncio.get_running_loop().time() + timeout
            shard = await self._ledger(self.shards.sending_create, shard, self.run_id)
            try:
                async with asyncio.timeout_at(send_by):
                    batch = await self.api.create(shard, path, timeout)
            except BatchRefusedError as exc:
                lines = {exc.line: exc.message} if exc.line else {}
                await self._refused(shard, f"the provider refused to create it: {exc.message}", lines)
                return
            except AuthError:
                raise
            except (ProviderError, TimeoutError) as exc:
                if isinstance(exc, ProviderError) and _create_refused(exc.status_code):
                    self._answered.add(shard.id)  # the provider turned it away: it is done with the create
                self._missing_since.pop(shard.id, None)
                what = exc.message if isinstance(exc, ProviderError) else f"no answer within {timeout:g} s"
                self._event(f"shard {shard.id}: create of {_n(shard.requests, 'request')} failed ({what}); "
                            "it may exist at the provider: reconciling before anything is sent again")
                return
        try:
            await self._adopt(shard, batch, how="created")
        except LockLostError:
            # Taken over while the create was on its way: the run that holds the job now may send this
            # shard again, so the batch only this run knows of is cancelled (what it ran meanwhile is paid).
            with contextlib.suppress(ProviderError):
                await self.api.cancel(batch.id)
            raise

    def _create_timeout(self, shard: ShardRecord) -> float:
        """Seconds a create of the shard may take: ``[batch] create_timeout``, else the provider's default."""
        return self.spec.batch.create_timeout or self.api.create_timeout(shard.bytes)

    async def _adopt(self, shard: ShardRecord, batch: RemoteBatch, *, how: str) -> None:
        shard = await self._ledger(
            self.shards.update, shard, self.run_id, state=ShardState.LIVE, batch_id=batch.id,
            provider_status=batch.status, counts=dict(batch.counts), provider_created_at=batch.created_at,
            expires_at=batch.expires_at,
        )
        self._refusals = 0
        self._missing_since.pop(shard.id, None)
        self._parked.discard(shard.id)
        self._next_poll[shard.id] = time.monotonic() + self.spec.batch.poll_interval
        self._poll_every[shard.id] = self.spec.batch.poll_interval
        self._event(f"shard {shard.id}: {_n(shard.requests, 'request')} {how} as {batch.id}")
        if batch.ended:
            await self._ended(shard, batch)

    async def _reconcile(self, shard: ShardRecord) -> None:
        """A shard whose create was sent but never recorded: adopt its batch, or find it never was.

        A batch carrying the shard's name (OpenAI: metadata, its input file) is its own. A batch
        that only looks alike (Anthropic: created around the create call, as many requests) is
        adopted once it has ended and its results carry the shard's own line ids; until then
        the shard waits. Only when two listings ``reconcile_wait`` apart find none, and no create
        of it can still be on its way, is it sent again — at most MAX_CREATES times.
        """
        self._next_poll[shard.id] = time.monotonic() + self.options.reconcile_wait
        known = await self._ledger(self.shards.known_batch_ids, shard.kind)
        sent = (shard.create_sent_at or shard.created_at) - self._ledger_ahead  # by this host's clock
        timeout = self._create_timeout(shard)
        candidates = [c for c in await self.api.candidates(shard, sent, timeout) if c.batch.id not in known]
        certain = [c.batch for c in candidates if c.certain]
        if certain:
            await self._adopt(shard, certain[0], how="found at the provider")
            for extra in certain[1:]:  # created twice (a run frozen mid-create, woken late): keep one
                log.error("shard %d: batch %s also carries its name; cancelling it", shard.id, extra.id)
                with contextlib.suppress(ProviderError):
                    await self.api.cancel(extra.id)
            return
        if candidates:
            chosen = await self._tell_apart(shard, [c.batch for c in candidates])
            if chosen is not None:
                await self._adopt(shard, chosen, how="found at the provider (by its results)")
            elif any(not c.batch.ended for c in candidates):
                self._parked.add(shard.id)  # a look-alike still running may be its own: wait for it to end
                return
        # None is its own. Only conclude "never created" once no create of it can still be on its way and a
        # second listing agrees. A create the provider never answered may still be made there — its sender
        # killed or timed out after the body went out, whether that sender is alive or not — so it is waited
        # out: until its timeout and a margin have passed since it was sent (the ledger's clock).
        if shard.id not in self._answered:
            left = (shard.create_sent_at or shard.created_at) + timeout + create_margin(timeout) - (
                time.time() + self._ledger_ahead)
            if left > 0:
                if shard.id not in self._parked:
                    self._event(f"shard {shard.id}: its create got no answer and may still be made at the provider; "
                                f"looking for it for up to {left:.0f} s before sending it again")
                self._parked.add(shard.id)
                self._next_poll[shard.id] = time.monotonic() + min(left, self.options.reconcile_wait)
                return
        first = self._missing_since.setdefault(shard.id, time.monotonic())
        if time.monotonic() - first < self.options.reconcile_wait:
            return
        self._missing_since.pop(shard.id, None)
        self._answered.discard(shard.id)
        self._parked.discard(shard.id)
        if shard.creates >= MAX_CREATES:
            await self._refused(shard, f"created {shard.creates} times and never found at the provider "
                                       "(is the base URL or the key another account's?)")
            self.request_stop(StopReason.ERROR, f"shard {shard.id}: sent {shard.creates} times and never seen at the "
                                                "provider; its items are pending again")
            return
        self._event(f"shard {shard.id}: not at the provider; sending it again")
        await self._ledger(self.shards.update, shard, self.run_id, state=ShardState.PREPARING)

    async def _tell_apart(self, shard: ShardRecord, batches: list[RemoteBatch]) -> RemoteBatch | None:
        """Of look-alike batches that have ended, the one whose first results are this shard's lines."""
        for batch in batches:
            if not batch.ended:
                continue
            ids: list[str] = []
            async for line in self.api.results(batch, shard):
                ids.append(line.custom_id)
                if len(ids) >= 20:
                    break
            if ids and all(shard.item_of(i) is not None for i in ids):
                mine = await self._ledger(self.shards.items_by_line_id, shard, ids)
                if mine:
                    return batch
        return None

    async def _refused(
        self, shard: ShardRecord, reason: str, lines: Mapping[int, str] | None = None, *, count: bool = True
    ) -> None:
        """The provider refused the shard: the lines it names (1-based line -> why) fail, the rest go back
        (to pending; cancelled if the user cancelled it). Refused as a whole, the next shard is half its
        size; ``count``: it counts towards the MAX_REFUSALS that stop the run."""
        failed: dict[int, str] = {}
        if lines:
            items = await self._db.call(lambda: list(self.shards.iter_shard_items(shard.id)))
            failed = {item.id: lines[n] for n, item in enumerate(items, 1) if n in lines}
        elif count:
            self._size_cap = max(1, shard.requests // 2)
        left = ItemState.CANCELLED if shard.cancel_reason == "user" else ItemState.PENDING
        back = await self._ledger(self.shards.refuse, shard, self.run_id, reason, failed, left=left)
        self.stats.back += back
        self._parked.discard(shard.id)
        self._event(f"shard {shard.id}: refused by the provider: {reason}; {_n(back, 'item')} back to {left}")
        if not self.spec.batch.keep_files:
            with contextlib.suppress(ProviderError):
                await self.api.discard(await self._ledger(self.shards.get, shard.id))
        if count:
            self._refusals += 1
            if self._refusals >= MAX_REFUSALS:
                self.request_stop(StopReason.ERROR, f"the provider refused {self._refusals} batches in a row: {reason}")

    # -- polling --------------------------------------------------------------

    async def _poll(self, shard: ShardRecord) -> None:
        assert shard.batch_id is not None
        try:
            batch = await self.api.get(shard.batch_id)
        except PermanentError as exc:
            if exc.status_code == 404:
                await self._gone(shard, exc)
                return
            raise
        every = self._poll_every.get(shard.id, self.spec.batch.poll_interval)
        self._poll_every[shard.id] = min(self.spec.batch.poll_max, every * 1.5)
        self._next_poll[shard.id] = time.monotonic() + every
        if batch.status != shard.provider_status or dict(batch.counts) != dict(shard.counts):
            shard = await self._ledger(
                self.shards.update, shard, self.run_id, provider_status=batch.status, counts=dict(batch.counts),
                in_progress_at=batch.in_progress_at, expires_at=batch.expires_at,
            )
            self._event(f"shard {shard.id}: {batch.status} {_counts_text(batch)}")
        if batch.ended:
            await self._ended(shard, batch)

    async def _gone(self, shard: ShardRecord, exc: ProviderError) -> None:
        """The provider no longer has the shard's batch or results (deleted, or past its retention):
        nothing of it can be collected, so its items go back (uncharged) to be sent again."""
        await self._refused(shard, f"the provider no longer has batch {shard.batch_id} ({exc.message}): deleted, "
                                   "or past its retention; its items are sent again", count=False)

    async def _ended(self, shard: ShardRecord, batch: RemoteBatch) -> None:
        if batch.refused:
            await self._refused_batch(shard, batch)
            return
        shard = await self._ledger(
            self.shards.update, shard, self.run_id, state=ShardState.ENDED, provider_status=batch.status,
            counts=dict(batch.counts), ended_at=batch.ended_at or time.time(),
            output_file_id=batch.output_file_id, error_file_id=batch.error_file_id,
        )
        await self._collect(shard, batch)

    async def _refused_batch(self, shard: ShardRecord, batch: RemoteBatch) -> None:
        """A batch that failed before any line was worked: over the enqueued-token limit (it waits for
        the shards ahead of it, or goes smaller), or refused (the lines it names fail; the rest go back)."""
        reason = "; ".join(
            f"{e.code}: {e.message}" + (f" (line {e.line})" if e.line else "") for e in batch.errors[:3]
        ) or f"batch {batch.status}"
        if "token_limit_exceeded" in {e.code for e in batch.errors}:
            others = [s for s in await self._ledger(self.shards.shards, self.job.id, open_only=True)
                      if s.id != shard.id and s.state in (ShardState.LIVE, ShardState.ENDED)]
            # What fits is at most what was queued with it; with nothing else queued, half this shard.
            self._token_cap = max(1, sum(s.prompt_tokens for s in others) if others else shard.prompt_tokens // 2)
            await self._refused(shard, f"{reason}; it waits for a smaller shard (at most ~{self._token_cap:,} "
                                       "tokens queued)", count=False)
            if shard.requests <= 1 and not others:
                self.request_stop(StopReason.ERROR, f"the provider's enqueued-token limit refuses even one request: {reason}")
            return
        await self._refused(shard, reason, {e.line: e.message for e in batch.errors if e.line})

    # -- collecting -----------------------------------------------------------

    async def _collect(self, shard: ShardRecord, batch: RemoteBatch | None = None) -> None:
        """Write an ended shard's results back, settle what it did not answer, and clear it at the provider."""
        chunk: list[ResultLine] = []
        unknown = landed = 0
        settled: collections.Counter[str] = collections.Counter()
        try:
            if batch is None:
                assert shard.batch_id is not None
                batch = await self.api.get(shard.batch_id)
            async for line in self.api.results(batch, shard):
                chunk.append(line)
                if len(chunk) >= RESULTS_CHUNK:
                    unknown += await self._write_back(shard, chunk, settled)
                    chunk = []
        except PermanentError as exc:
            if exc.status_code == 404:
                await self._gone(shard, exc)
                return
            raise
        if chunk:
            unknown += await self._write_back(shard, chunk, settled)
        landed = sum(settled.values())
        if unknown:
            log.warning("shard %d: %d results lines landed on no item of it (written back already by an earlier "
                        "run, or not its lines)", shard.id, unknown)
        left = ItemState.CANCELLED if shard.cancel_reason == "user" else ItemState.PENDING
        # None of the results are its items (and none still submitted landed): not its batch, so not its files.
        foreign = bool(unknown) and not landed and await self._ledger(self.shards.holds, shard.id) == shard.requests
        discard = not foreign and not self.spec.batch.keep_files
        back = await self._ledger(self.shards.close, shard, self.run_id, left=left, files_left=discard)
        self.stats.back += back
        self.stats.shards_collected += 1
        self._next_poll.pop(shard.id, None)
        settled[left] += back
        told = ", ".join(f"{n} {'again' if state == ItemState.PENDING else state}" for state, n in settled.items() if n)
        self._event(f"shard {shard.id}: collected ({batch.status}): {told or 'nothing in it'}")
        if foreign:
            log.error("shard %d: none of batch %s's results are its items: its files are left at the provider",
                      shard.id, shard.batch_id)
        elif discard:
            await self._discard(await self._ledger(self.shards.get, shard.id))

    async def _discard(self, shard: ShardRecord) -> None:
        """Delete a collected shard's files at the provider, then clear its mark; a failure leaves the
        mark, and the next run tries again."""
        try:
            await self.api.discard(shard)
        except ProviderError as exc:
            log.warning("shard %d: its files could not be deleted at the provider (the next run tries again): %s",
                        shard.id, exc.message)
            return
        await self._ledger(self.shards.update, shard, self.run_id, error=None)

    async def _write_back(self, shard: ShardRecord, lines: list[ResultLine], settled: collections.Counter[str]) -> int:
        """Judge and record one chunk of results lines, counting the items' new states into ``settled``;
        how many lines named no item of the shard still submitted."""
        items = await self._ledger(self.shards.items_by_line_id, shard, [line.custom_id for line in lines])
        outcomes: list[Outcome] = []
        attempts: list[AttemptRecord] = []
        unknown = 0
        for line in lines:
            item = items.pop(line.custom_id, None)  # a line repeated in both files counts once
            if item is None:
                unknown += 1
                continue
            outcome, attempt = self._judge(shard, item, line)
            outcomes.append(outcome)
            attempts.append(attempt)
        if outcomes:
            await self._ledger(self.shards.record_results, shard, self.run_id, outcomes, attempts)
            for outcome in outcomes:
                self.stats.done[outcome.state] = self.stats.done.get(outcome.state, 0) + 1
                settled[outcome.state] += 1
        return unknown

    def _judge(self, shard: ShardRecord, item: ShardItem, line: ResultLine) -> tuple[Outcome, AttemptRecord]:
        """What one results line makes of its item: judged exactly as an online answer is. In a shard
        the user cancelled, what would go again (expired, retryable, a re-ask) is cancelled instead."""
        outcome, attempt = self._verdict(shard, item, line)
        if shard.cancel_reason == "user" and outcome.state == ItemState.PENDING:
            outcome.state, outcome.finished_at = ItemState.CANCELLED, time.time()
        return outcome, attempt

    def _verdict(self, shard: ShardRecord, item: ShardItem, line: ResultLine) -> tuple[Outcome, AttemptRecord]:
        followups = item.followup_pairs
        attempt = AttemptRecord(
            job_id=self.job.id, item_id=item.id, run_id=self.run_id, number=item.attempts + 1,
            started_at=(shard.create_sent_at or shard.created_at) - self._ledger_ahead, queue_wait_ms=None,
            latency_ms=None, status_code=line.status_code, error_class=None, shard_id=shard.id,
        )
        if line.unworked is not None:
            attempt.counted = False
            attempt.number = item.attempts
            attempt.error_class = f"batch_{line.unworked}"
            attempt.error_message = f"the batch {line.unworked} before this line was worked"
            outcome = Outcome(
                item.id, ItemState.PENDING, item.attempts, error_class=attempt.error_class,
                error_message=attempt.error_message, followups=item.followups,
            )
            return outcome, attempt
        attempts = item.attempts + 1
        try:
            reply = self.provider.parse(line.status_code or 500, httpx.Headers(), line.body or b"", latency_ms=0.0)
        except ProviderError as error:
            attempt.error_class, attempt.error_message = error.error_class, attempt_message(error.message)
            retry = isinstance(error, RetryableError) and attempts - len(followups) < self.spec.run.max_attempts
            outcome = Outcome(
                item.id, ItemState.PENDING if retry else ItemState.FAILED, attempts,
                status_code=error.status_code, response=error.body, error_class=error.error_class,
                error_message=error.message, followups=item.followups,
                finished_at=None if retry else time.time(),
            )
            return outcome, attempt
        cost = self._cost(reply)
        attempt.input_tokens, attempt.output_tokens = reply.input_tokens, reply.output_tokens
        attempt.cached_tokens, attempt.cost_usd = reply.cached_tokens, cost
        outcome = Outcome(
            item.id, ItemState.SUCCEEDED, attempts, status_code=reply.status_code, response=reply.body,
            output=reply.output, request_id=reply.request_id or line.request_id, input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens, cost_usd=cost, finished_at=time.time(),
        )
        if self.validator is not None:
            try:
                verdict = self.validator.check(reply.output, finish_reason=reply.finish_reason, refusal=reply.refusal)
            except OutputInvalidError as invalid:
                attempt.error_class = invalid.error_class
                if invalid.error_class == "refusal" or len(followups) >= self.spec.output.validation_retries:
                    outcome.state = ItemState.INVALID_OUTPUT
                    outcome.error_class, outcome.error_message = invalid.error_class, invalid.message
                    outcome.validation_errors = orjson.dumps(invalid.errors).decode() if invalid.errors else None
                    return outcome, attempt
                # Asked again in the next shard, with what was wrong.
                again = Outcome(
                    item.id, ItemState.PENDING, attempts, status_code=reply.status_code,
                    error_class=invalid.error_class, error_message=invalid.message,
                    followups=orjson.dumps([*followups, (reply.output or "", feedback(invalid))]).decode(),
                )
                return again, attempt
            outcome.parsed = orjson.dumps(verdict.parsed).decode()
        outcome.request_hash = self._key(item)
        return outcome, attempt

    def _key(self, item: ShardItem) -> str | None:
        """The response cache's key of the item's first request (what a later job will look up)."""
        try:
            return request_key(self._scope, self.provider.prepare(item.url, item.body, max_tokens=item.max_tokens))
        except ValueError:
            return None

    def _cost(self, reply: Any) -> float | None:
        """USD of one answered line: the job's batch price, else the model's list price at the batch discount."""
        price = self.price
        if price is None and reply.model:
            if reply.model not in self._model_prices:
                listed = price_for(reply.model)
                self._model_prices[reply.model] = None if listed is None else listed.scaled(BATCH_DISCOUNT)
            price = self._model_prices[reply.model]
        if price is None:
            return None
        return price.cost(reply.input_tokens or 0, reply.output_tokens or 0, reply.cached_tokens or 0)

    # -- deadline, cancel, heartbeat ----------------------------------------------

    async def _check_deadline(self, shards: list[ShardRecord]) -> None:
        """Past ``[batch] deadline`` (from the job's first shard): no more shards, the live ones cancelled."""
        deadline = self.spec.batch.deadline
        if deadline <= 0:
            return
        if not self._go_online:
            if not await self._ledger(self.shards.deadline_passed, self.job.id, deadline):
                return
            self._go_online = True
            self._event(f"[batch] deadline of {deadline:g} s passed: no more batches; the live ones are cancelled "
                        "and what they did not finish goes online")
        await self._cancel_live([s for s in shards if s.state == ShardState.LIVE and s.cancel_reason is None],
                                "deadline")

    async def _cancel_live(self, shards: list[ShardRecord], reason: str) -> None:
        """Cancel live shards at the provider (what they finished is still collected)."""
        for shard in shards:
            if shard.batch_id is None:
                continue
            self._cancel_sent.add(shard.id)
            try:
                batch = await self.api.cancel(shard.batch_id)
            except ProviderError as exc:
                log.warning("shard %d: cancel failed: %s", shard.id, exc.message)
                continue
            await self._ledger(self.shards.update, shard, self.run_id, cancel_reason=shard.cancel_reason or reason,
                               provider_status=batch.status)
            self._next_poll[shard.id] = 0.0

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_every)
            try:
                await self._ledger(self.ledger.heartbeat, self.job.id, self.run_id, self.spec.run.lease_seconds,
                                   exclusive=True)
            except LockLostError as lost:
                self.request_stop(StopReason.LOCK_LOST, lost.message)
                return

    # -- waiting ----------------------------------------------------------------

    def _back_off(self, shard: ShardRecord) -> None:
        every = self._poll_every.get(shard.id, self.spec.batch.poll_interval)
        self._poll_every[shard.id] = min(self.spec.batch.poll_max, every * 2)
        self._next_poll[shard.id] = time.monotonic() + every

    def _until_next(self, shards: list[ShardRecord]) -> float:
        """Seconds until a shard is due again."""
        now = time.monotonic()
        return max(0.05, min((self._next_poll.get(s.id, now) - now for s in shards), default=1.0))

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass


def create_margin(timeout: float) -> float:
    """How long past its timeout a create that got no answer may still be made at the provider."""
    return max(CREATE_MARGIN_S, timeout / 4)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _counts_text(batch: RemoteBatch) -> str:
    return " ".join(f"{k}={v}" for k, v in batch.counts.items() if v) or ""


@dataclass(frozen=True)
class CancelledShards:
    """What ``batchrun cancel`` did to a job's provider batches."""

    shards: int  # open shards, now marked cancelled by the user
    items: int  # the items they hold: what finished is still collected, the rest becomes cancelled
    problems: tuple[str, ...] = ()  # shards the provider could not be told about (cancelled at the next run)


async def cancel_shards(
    ledger: Ledger, job: JobRecord, *, transport: httpx.AsyncBaseTransport | None = None
) -> CancelledShards:
    """Mark the job's open shards cancelled by the user and cancel the live ones at the provider.

    Finished lines are kept: the next run collects them, and what was never worked
    becomes ``cancelled``. A shard not yet at the provider is cancelled when that
    run reconciles it.
    """
    shards = await asyncio.to_thread(ShardLedger(ledger).cancel_requested, job.id)
    if not shards:
        return CancelledShards(0, 0)
    spec = dataclasses.replace(job.spec, run=dataclasses.replace(job.spec.run, stream=False))
    problems: list[str] = []
    api = batch_api_for(spec, provider_for(spec), transport=transport, retry_seconds=30.0)
    try:
        for shard in shards:
            if shard.batch_id is None or shard.state != ShardState.LIVE:
                continue
            try:
                await api.cancel(shard.batch_id)
            except ProviderError as exc:
                problems.append(f"shard {shard.id} ({shard.batch_id}): {exc.message}")
    finally:
        await api.aclose()
    return CancelledShards(len(shards), sum(s.requests for s in shards), tuple(problems))


def _create_refused(status_code: int | None) -> bool:
    """Whether a create answered with this status was surely not made: the provider's own refusals
    (4xx but 408, its 529 "overloaded"). A 5xx (a gateway's 502/504 in front of a backend still at
    work), a 408, a 2xx that could not be read, or no answer at all may have made the batch: the
    shard waits out the create's timeout before it is sent again."""
    if status_code is None:
        return False
    return (400 <= status_code < 500 and status_code != 408) or status_code == 529
