"""The worker pool: claim with leases -> bounded requests -> batched outcomes.

One asyncio loop runs three things:

- the dispatcher claims items in batches, finishes at once those whose request
  was already answered in the ledger (the response cache: one lookup per
  batch, no request, no cost), and starts one task per other item, with at
  most ``2 × concurrency`` item tasks alive;
- each item task sends attempts through tenacity; every attempt passes the
  run's :class:`~batchrun.admission.Admission` (a concurrency slot, so backoff
  sleeps hold none, the send pace, the rate budgets, the spend reservation),
  and what it learns goes to the run's :class:`~batchrun.health.Health` (is the
  provider down, how long may an answer take);
  a clean answer keeps its slot until it is committed, so answers paid for but
  not yet in the ledger (lost by a ``kill -9``) never exceed the concurrency;
- the writer commits outcomes and attempts in batches (by count or every
  ``flush_interval``; at once while a clean answer holds its slot, so the
  answers that come in during one commit make the next one), hands the held
  slots back, and renews the run's heartbeat and leases (the run's
  :class:`~batchrun.tenure.Tenure`: what it may still send). Waiting to gather
  bigger batches would hand slots back in bursts, and against a steady
  latency a burst sent together comes back together and stalls the loop.

The ledger is synchronous; its calls run on one dedicated thread so the loop
never blocks on SQLite and the ledger sees one writer per process. On
PostgreSQL a call cut by a database restart is retried for up to
``RunOptions.ledger_retry_seconds``: answers that arrive meanwhile wait in
memory (each holding its slot, so at most the concurrency) and are committed
once the database is back. On PostgreSQL the job's ``rpm``/``tpm`` are one
budget for all its runs, kept in the ledger (:class:`SharedTokenBucket`).

A run may have the rest of its job's ingest beside it (a :class:`Feed`, on a thread, writing
under the run's job lock): with nothing to claim, the dispatcher waits for its next batch
instead of ending, claims once more after it ends, and the run joins it before it ends.

Stopping: :meth:`JobRunner.request_stop` stops claiming; unstarted items go
back at once, in-flight requests get ``grace_seconds`` to finish, anything
left is put back to ``pending``, the ledger is flushed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson
from sqlalchemy.exc import SQLAlchemyError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential, wait_random
from tenacity.wait import wait_base

from batchrun.admission import Admission, NotAdmitted
from batchrun.budget import SpendBudget, budget_price
from batchrun.cache import cache_scope, request_key, reusable
from batchrun.errors import (
    AuthError,
    BatchrunError,
    BudgetExceededError,
    InputError,
    LedgerWriteError,
    LockLostError,
    OutputInvalidError,
    PermanentError,
    ProviderError,
    RateLimitedError,
    RetryableError,
)
from batchrun.health import LATENCIES_KEPT, Health, Refusals
from batchrun.ledger.store import attempt_message
from batchrun.ledger import (
    LEDGER_RETRY_SECONDS,
    AsyncLedger,
    AttemptRecord,
    CachedAnswer,
    ClaimedItem,
    JobRecord,
    Outcome,
    RunLedger,
)
from batchrun.providers import Provider, Reply
from batchrun.providers.base import PreparedRequest
from batchrun.providers.http import Sender
from batchrun.pricing import Price, price_for
from batchrun.ratelimit import AdaptiveConcurrency, AimdRate, RequestWindow, SharedTokenBucket, TokenBucket
from batchrun.spec import JobSpec
from batchrun.validate import OutputValidator, feedback
from batchrun.states import ItemState, StopReason
from batchrun.tenure import Tenure, clocks

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_RATE_LIMITED_PER_ITEM = 100
_NO_VALUE = object()


class Feed(Protocol):
    """The rest of a job's ingest, running beside the run (:class:`batchrun.ingest.BackgroundIngest`)."""

    @property
    def ended(self) -> bool:
        """The ingest has ended: the whole input stored and the job marked so, or stopped by ``error``."""

    @property
    def error(self) -> BaseException | None: ...

    def start(
        self, run_id: str, on_batch: Callable[[int], None], should_stop: Callable[[], bool], taken: Callable[[], int]
    ) -> None: ...

    def join(self) -> None: ...


@dataclass(frozen=True)
class RunOptions:
    """How a run behaves, beyond the spec."""

    command: str = "submit"
    exclusive: bool = True
    transport: str = "aiohttp"
    initial_concurrency: int = 4
    flush_interval: float = 0.1
    flush_count: int = 500
    heartbeat_interval: float = 2.0
    cancel_poll_interval: float = 0.2  # how soon a `batchrun cancel` from elsewhere stops the sending
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    lease_seconds: float | None = None  # None: the spec's; how soon a killed run's items come back
    ledger_retry_seconds: float = LEDGER_RETRY_SECONDS  # PostgreSQL: ride out a database restart this long


@dataclass
class RunStats:
    """Live figures of one run, for progress displays."""

    started_at: float = field(default_factory=time.time)
    done: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    in_flight: int = 0
    window: int = 0
    paused_for: float = 0.0
    cached: int = 0  # items finished with a reused answer (also counted in done["succeeded"])
    fed: int = 0  # items the ingest beside the run stored since the run started (not in its first todo)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    stop_reason: StopReason | None
    stop_message: str | None


class _WaitRetryAfter(wait_base):
    """Wait what the provider asked for (plus a little jitter), else exponential backoff with jitter."""

    def __init__(self, fallback: wait_base, rng: random.Random) -> None:
        self.fallback = fallback
        self.rng = rng

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, RetryableError) and exc.retry_after is not None:
            return exc.retry_after + self.rng.uniform(0.0, 0.1 + exc.retry_after * 0.1)
        return self.fallback(retry_state)


@dataclass
class _ItemWork:
    item: ClaimedItem
    ready_at: float
    counted: int  # attempts that count against max_attempts (429s do not)
    rate_limited: int = 0
    reasks: int = 0
    followups: list[tuple[str, str]] = field(default_factory=list)
    lost: bool = False  # a heartbeat found the item no longer leased to this run: send it no more
    last_attempt: AttemptRecord | None = None
    last_error: ProviderError | None = None  # kept on the item if it goes back to pending
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None  # None until an attempt had a price
    key: str | None = None  # the response cache's key of the first request
    first_request: PreparedRequest | None = None  # sent again as is until a re-ask changes the question


class JobRunner:
    """Works one job until nothing is left to claim or it is told to stop."""

    def __init__(
        self,
        ledger: RunLedger,
        job: JobRecord,
        spec: JobSpec,
        provider: Provider,
        options: RunOptions | None = None,
        *,
        sender: Sender | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        feed: Feed | None = None,
    ) -> None:
        self.ledger = ledger
        self.feed = feed  # the job's ingest, when it goes on beside the run
        self._ending = False  # the run is ending: the feed stops at its next batch
        self._taken = 0  # items claimed so far (the feed slows down when far ahead of them)
        self.job = job
        self.spec = spec
        self.provider = provider
        self.options = options or RunOptions()
        self.stats = RunStats()
        self.run_id = ""
        self._sender = sender
        self._sleep = sleep
        self._stop = asyncio.Event()
        self._stop_reason: StopReason | None = None
        self._stop_message: str | None = None
        self._db = AsyncLedger(ledger, ride_out_seconds=self.options.ledger_retry_seconds)
        self._outcomes: list[Outcome] = []
        self._attempts: list[AttemptRecord] = []
        self._flush_now = asyncio.Event()
        self._wake = asyncio.Event()
        self._writer_done = False
        self._rng = random.Random()
        self.validator = OutputValidator(spec.output.schema) if spec.output.schema is not None else None
        self.price = spec.price()
        self._model_prices: dict[str, Price | None] = {}
        self.lease_seconds = self.options.lease_seconds or spec.run.lease_seconds
        self._heartbeat_interval = min(self.options.heartbeat_interval, self.lease_seconds / 4)
        self.tenure = Tenure(
            job.id, lock_stale_seconds=spec.run.lock_stale_seconds, lease_seconds=self.lease_seconds,
            renew=self._renew_leases, on_lost=self._lock_taken, beat_now=self._flush_now.set,
        )
        self._attempt_seq = 0
        self._claims = 0
        self._bucket_db = AsyncLedger(
            ledger, ride_out_seconds=self.options.ledger_retry_seconds, thread_name="batchrun-bucket"
        )
        self.health = Health(spec.run)
        self.refusals: Refusals[_ItemWork] = Refusals()
        budget_at = budget_price(spec)  # SpecError here, before anything is sent, if a budget has no price
        self.admission = Admission(
            AdaptiveConcurrency(spec.run.concurrency, initial=self.options.initial_concurrency),
            # This process's request pace adapts to 429s (AIMD) and, with no rpm, learns the limit.
            request_budget=(
                self._budget("requests", spec.run.rpm) if self.ledger.shares_rate_budgets else AimdRate(spec.run.rpm)
            ),
            token_budget=self._budget("tokens", spec.run.tpm),
            request_window=RequestWindow(spec.run.rpm) if spec.run.rpm > 0 else None,
            spend=SpendBudget(spec.run.budget_usd, budget_at) if budget_at is not None else None,
            latencies=self.health.latencies,
        )
        self._crash: BaseException | None = None
        self._held_slots = 0
        self._cache_scope = cache_scope(spec.provider)
        # Flush often enough that slots held by committed-to-be answers come back quickly.
        self._flush_count = max(8, min(self.options.flush_count, spec.run.concurrency // 2))
        self._wait = _WaitRetryAfter(
            wait_exponential(multiplier=self.options.backoff_initial, max=self.options.backoff_max)
            + wait_random(0, self.options.backoff_initial),
            self._rng,
        )

    # -- control ------------------------------------------------------------

    def request_stop(self, reason: StopReason, message: str | None = None) -> None:
        """Stop claiming and wind down (first reason wins)."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_message = message
            log.info("stopping run: %s", message or reason, extra={"job": self.job.id})
        self._stop.set()
        self._wake.set()
        self.admission.stop()
        self.tenure.stop()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def set_concurrency(self, limit: int) -> None:
        """A new cap on requests in flight (a worker sharing its slots among jobs); never above the spec's."""
        self.admission.set_limit(min(limit, self.spec.run.concurrency))

    async def _ledger(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._db.call(fn, *args)

    def _budget(self, kind: str, per_minute: float) -> TokenBucket | SharedTokenBucket | None:
        """The run's budget: the job's shared one on PostgreSQL (several workers), else this process's own."""
        if per_minute <= 0:
            return None
        if not self.ledger.shares_rate_budgets:
            return TokenBucket(per_minute)

        async def reserve(amount: float) -> float:
            return await self._bucket_db.call(self.ledger.take_rate_budget, self.job.id, kind, amount)

        return SharedTokenBucket(per_minute, reserve)

    # -- the run ------------------------------------------------------------

    async def run(self) -> RunResult:
        """Work the job; returns how the run ended. Raises JobLockedError if another run holds it."""
        try:
            vouched = clocks()
            run_id = os.urandom(8).hex()  # chosen here, so a replayed start finds its own run
            self.run_id = await self._ledger(
                lambda: self.ledger.start_run(
                    self.job.id, self.options.command, exclusive=self.options.exclusive,
                    stale_after=self.spec.run.lock_stale_seconds, run_id=run_id,
                )
            )
            self.tenure.vouch(vouched)
            admission = self.admission
            for kind, budget in (("requests", admission.request_budget), ("tokens", admission.token_budget)):
                if isinstance(budget, SharedTokenBucket):
                    await self._ledger(self.ledger.set_rate_budget, self.job.id, kind, budget.rate, budget.capacity)
            if self.options.exclusive:
                orphans = await self._ledger(self.ledger.requeue_orphans, self.job.id, self.run_id)
            else:
                orphans = await self._ledger(self.ledger.requeue_expired, self.job.id)
            if orphans:
                log.info("put %d items left running by an earlier run back to pending", orphans)
            if self.feed is not None:  # the lock is this run's: the ingest writes under it
                loop = asyncio.get_running_loop()

                def fed(accepted: int) -> None:  # on the ingest's thread
                    loop.call_soon_threadsafe(self._fed, accepted)

                self.feed.start(self.run_id, fed, lambda: self.stopping or self._ending, lambda: self._taken)
            if admission.spend is not None:
                admission.spend.spent = await self._ledger(self.ledger.spent_usd, self.job.id)
            for seconds in await self._ledger(self.ledger.recent_latencies, self.job.id, LATENCIES_KEPT):
                self.health.note_latency(seconds)  # the pace waits for this run's own answers
            if (await self._ledger(self.ledger.counts, self.job.id)).get(ItemState.SUCCEEDED, 0):
                # Requests of this job have been answered: refusals now are the items' own (a few
                # flagged prompts first in line must not stop the job on every resume).
                self.refusals.decided = True
            owns_sender = self._sender is None
            if self._sender is None:
                self._sender = Sender.for_spec(self.spec, transport=self.options.transport)
            deadline = None
            if self.spec.run.max_runtime > 0:
                deadline = asyncio.get_running_loop().call_later(
                    self.spec.run.max_runtime,
                    self.request_stop,
                    StopReason.DEADLINE,
                    f"--max-runtime of {self.spec.run.max_runtime:g} s reached",
                )
            try:
                writer = asyncio.create_task(self._writer(), name="batchrun-writer")
                writer.add_done_callback(self._writer_ended)
                try:
                    await self._dispatch(writer)
                finally:
                    self._writer_done = True
                    self._flush_now.set()
                    await asyncio.wait([writer])
                if writer.exception() is not None:
                    raise writer.exception()  # type: ignore[misc]
                # Nothing this run claimed stays running after it: items a replayed claim
                # leased without this run knowing go back too.
                await self._ledger(self.ledger.release_held, self.job.id, self.run_id)
            finally:
                if deadline is not None:
                    deadline.cancel()
                if owns_sender:
                    await self._sender.aclose()
                    self._sender = None
        except SQLAlchemyError as exc:
            raise LedgerWriteError(
                f"the ledger failed during the run: {exc.__class__.__name__}: {exc}. What was committed is safe; "
                f"resume job {self.job.id} when the database is back"
            ) from exc
        finally:
            if self.feed is not None:  # it writes under this run's lock: it ends before the run does
                self._ending = True
                await asyncio.get_running_loop().run_in_executor(None, self.feed.join)
            self._db.close()
            self._bucket_db.close()
        if self._crash is not None:
            raise self._crash
        return RunResult(self.run_id, self._stop_reason, self._stop_message)

    async def _dispatch(self, writer: asyncio.Task[None]) -> None:
        queue: deque[_ItemWork] = deque()
        active: set[asyncio.Task[None]] = set()
        max_tasks = 2 * self.spec.run.concurrency
        batch = max(64, min(1000, 2 * self.spec.run.concurrency))
        feed_drained = False

        def task_done(task: asyncio.Task[None]) -> None:
            active.discard(task)
            self._wake.set()

        try:
            while not self.stopping and not writer.done():
                if self.feed is not None and self.feed.ended and self.feed.error is not None:
                    self._feeding()  # a failed ingest stops the run now, not once the stored backlog is sent
                    if self.stopping:
                        break
                if not queue:
                    self._claims += 1
                    token = self._claims  # the same for a replay of this claim (see Ledger.claim)
                    try:
                        claimed = await self._ledger(
                            lambda: self.ledger.claim(
                                self.job.id, self.run_id, batch, self.lease_seconds,
                                exclusive=self.options.exclusive, token=token,
                            )
                        )
                    except LockLostError as lost:
                        self.tenure.lose(lost)
                        break
                    self._taken += len(claimed)
                    if not claimed:
                        if active or self._feeding():
                            await self._wait_for_wake()
                            continue
                        if self.feed is not None and not feed_drained:
                            feed_drained = True  # it has ended: one more claim takes its last batch
                            continue
                        return
                    to_send, hits = await self._ledger(self._look_up, claimed)
                    for work in [*to_send, *(work for work, _ in hits)]:
                        self.tenure.hold(work)
                    queue.extend(to_send)
                    queue.extend(work for work, answer in hits if not self._finish_cached(work, answer))
                    continue
                if len(active) >= max_tasks:
                    await self._wait_for_wake()
                    continue
                work = queue.popleft()
                work.ready_at = time.monotonic()
                task = asyncio.create_task(self._work(work))
                active.add(task)
                task.add_done_callback(task_done)
        finally:
            # Unstarted items go back at once; in-flight ones get the grace period (none when
            # another run has the job: it has these items and will answer them).
            if queue:
                for work in queue:
                    self.tenure.settle(work)
                    self._outcomes.append(
                        Outcome(work.item.id, ItemState.PENDING, work.item.attempts, claim=work.item.claim)
                    )
                queue.clear()
            if active:
                grace = 0.0 if self.tenure.lock_lost else self.spec.run.grace_seconds
                done, pending = await asyncio.wait(active, timeout=grace)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending)
            # Refusals still held: out of work, they were the items' own; stopped, they are not judged.
            self._settle_refused(failed=not self.stopping)

    def _look_up(self, claimed: list[ClaimedItem]) -> tuple[list[_ItemWork], list[tuple[_ItemWork, CachedAnswer]]]:
        """Key each claimed item by its first request; split off those already answered in the ledger.

        Runs on the ledger thread: the hashing and the one lookup query stay off the loop.
        """
        works: list[_ItemWork] = []
        for item in claimed:
            work = _ItemWork(item, 0.0, counted=item.attempts)
            if item.followups:  # re-asks a killed run had committed: carry on from the last one
                work.followups = [(str(answer), str(note)) for answer, note in orjson.loads(item.followups)]
                work.reasks = len(work.followups)
            try:
                work.first_request = self.provider.prepare(item.url, item.body, max_tokens=item.max_tokens)
                work.key = request_key(self._cache_scope, work.first_request)
            except ValueError:
                pass  # not sendable as stored: the attempt raises it as it always has
            works.append(work)
        if not self.spec.run.cache:
            return works, []
        found = self.ledger.find_cached({w.key for w in works if w.key is not None})
        if not found:
            return works, []
        to_send: list[_ItemWork] = []
        hits: list[tuple[_ItemWork, CachedAnswer]] = []
        for work in works:
            answer = found.get(work.key) if work.key is not None else None
            (to_send.append(work) if answer is None else hits.append((work, answer)))
        return to_send, hits

    async def _wait_for_wake(self) -> None:
        """Until an item task ends, a stop is requested or the writer dies."""
        await self._wake.wait()
        self._wake.clear()

    def _fed(self, accepted: int) -> None:
        """The ingest beside the run committed a batch (``accepted`` new items), or ended (0)."""
        self.stats.fed += accepted
        self._wake.set()

    def _feeding(self) -> bool:
        """Whether the ingest beside the run is still reading (more items may come); a failed one stops the run."""
        feed = self.feed
        if feed is None:
            return False
        if not feed.ended:
            return True
        if feed.error is not None and not self.stopping:
            error = feed.error
            if isinstance(error, LockLostError):
                if not self.tenure.lock_lost:
                    self.tenure.lose(error)
            elif isinstance(error, InputError):
                self.request_stop(StopReason.INPUT, f"the rest of the input cannot be read: {error.message}; "
                                                    "the lines stored before it were worked, nothing after it was read")
            else:
                message = error.message if isinstance(error, BatchrunError) else f"{type(error).__name__}: {error}"
                self.request_stop(StopReason.ERROR, f"the ingest of the input stopped: {message}")
        return False

    def _writer_ended(self, writer: asyncio.Task[None]) -> None:
        if not writer.cancelled() and writer.exception() is not None:
            exc = writer.exception()
            self.request_stop(StopReason.ERROR, f"the ledger writer failed: {type(exc).__name__}: {exc}")
        self._wake.set()

    async def _work(self, work: _ItemWork) -> None:
        try:
            while True:
                reply = await self._ask(work)
                if self.validator is None:
                    self._finish(work, ItemState.SUCCEEDED, reply=reply)
                    return
                try:
                    verdict = self.validator.check(reply.output, finish_reason=reply.finish_reason, refusal=reply.refusal)
                except OutputInvalidError as invalid:
                    if work.last_attempt is not None:
                        work.last_attempt.error_class = invalid.error_class
                    self.stats.errors[invalid.error_class] += 1
                    if invalid.error_class == "refusal" or work.reasks >= self.spec.output.validation_retries:
                        self._finish(work, ItemState.INVALID_OUTPUT, reply=reply, invalid=invalid)
                        return
                    work.reasks += 1
                    work.followups.append((reply.output or "", feedback(invalid)))
                    self._note_reask(work)
                    continue
                self._finish(work, ItemState.SUCCEEDED, reply=reply, parsed=verdict.parsed)
                return
        except NotAdmitted:
            self._put_back(work)
        except AuthError as exc:
            self.request_stop(StopReason.AUTH, f"authentication refused: {exc.message}")
            self._put_back(work)
        except BudgetExceededError as exc:
            self.request_stop(exc.stop_reason, exc.message)
            self._put_back(work)
        except PermanentError as exc:
            if not self.refusals.hold(work, exc):
                self._finish(work, ItemState.FAILED, error=exc)
                return
            stop = self.refusals.verdict()
            if stop is not None:
                self.request_stop(StopReason.REFUSED, stop)
                self._settle_refused(failed=False)
            elif self.refusals.decided:
                self._settle_refused(failed=True)
        except ProviderError as exc:
            self._finish(work, ItemState.FAILED, error=exc)
        except asyncio.CancelledError:
            self._put_back(work)
            raise
        except Exception as exc:  # a bug or a broken environment: stop the run with it
            self._put_back(work)
            self._crash = self._crash or exc
            self.request_stop(StopReason.ERROR, f"internal error: {type(exc).__name__}: {exc}")

    async def _ask(self, work: _ItemWork) -> Reply:
        """One question (the request, or a re-ask), retried through tenacity until answered.

        The first attempt is made before tenacity is set up: most questions are
        answered at once, and setting up and stepping through the retry machinery
        costs ~40 µs a question (bench/RESULTS.md). A first attempt that fails is handed
        to tenacity as its own attempt 1, so stop, wait and Retry-After see exactly
        what they would.
        """
        try:
            return await self._attempt(work)
        except RetryableError as exc:
            failed: RetryableError | None = exc
        retrying = AsyncRetrying(
            stop=lambda state: self._budget_spent(work),
            wait=self._wait,
            retry=retry_if_exception_type(RetryableError),
            sleep=self._interruptible_sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if failed is not None:  # attempt 1, already made above
                    replay, failed = failed, None
                    raise replay
                return await self._attempt(work)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    def _budget_spent(self, work: _ItemWork) -> bool:
        # Re-asks are budgeted by validation_retries, not max_attempts.
        spent = work.counted - work.reasks
        return spent >= self.spec.run.max_attempts or work.rate_limited >= MAX_RATE_LIMITED_PER_ITEM

    async def _interruptible_sleep(self, seconds: float) -> None:
        if self._sleep is not None:
            await self._sleep(seconds)
            return
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _attempt(self, work: _ItemWork) -> Reply:
        """One HTTP request for ``work``: admitted, sent, settled, learnt from, recorded; a failure raised."""
        if self.stopping:
            raise NotAdmitted
        request = self._request(work)
        estimate = self.provider.estimate_tokens(request).total if self.admission.counts_tokens else 0
        # Last before the send, the run may have stalled in the waits: it sends only what it still owns.
        ready, confirm = lambda: self.tenure.owns(work), lambda: self.tenure.confirm(work)
        async with self.admission.slot(estimate, ready=ready, confirm=confirm) as slot:
            queue_wait_ms = (time.monotonic() - work.ready_at) * 1000.0
            started = time.time()
            t0 = time.perf_counter()
            self.stats.requests += 1
            self.stats.in_flight += 1
            error: ProviderError | None = None
            reply: Reply | None = None
            try:
                reply = await self._http().send(self.provider, request, total_timeout=self.health.attempt_timeout)
            except ProviderError as exc:
                error = exc
            finally:
                self.stats.in_flight -= 1
            latency_ms = (time.perf_counter() - t0) * 1000.0
            cost = self._cost(reply) if reply else None
            # A clean answer keeps its slot until the writer has committed it, so
            # answers paid for but not yet in the ledger never exceed the concurrency.
            slot.settle(reply, cost, error)
        counted = self._learn(work, reply, error, latency_ms / 1000.0)
        self._record_attempt(
            work, reply, error, cost=cost, counted=counted, started=started, queue_wait_ms=queue_wait_ms,
            latency_ms=latency_ms,
        )
        if error is not None:
            log.debug("item %s attempt failed: %s", work.item.custom_id, error.message)
            work.last_error = error
            raise error
        assert reply is not None
        return reply

    def _request(self, work: _ItemWork) -> PreparedRequest:
        """What to send: the item's request as keyed, else the question with its re-asks so far."""
        if work.first_request is not None and not work.followups:
            return work.first_request
        return self.provider.prepare(
            work.item.url, work.item.body, max_tokens=work.item.max_tokens, followups=work.followups
        )

    def _learn(self, work: _ItemWork, reply: Reply | None, error: ProviderError | None, latency_s: float) -> bool:
        """Tell health and admission how an attempt went; whether it counts against the item's attempts."""
        outage = self.health.observe(error)
        if outage is not None:
            self.admission.pause(outage.pause_s)
            if outage.stop_message is not None:
                self.request_stop(StopReason.OUTAGE, outage.stop_message)
        if isinstance(error, RateLimitedError):
            work.rate_limited += 1
            self.admission.on_rate_limited(error.retry_after)
            return False
        if isinstance(error, RetryableError) and outage is not None:
            return False  # an outage is not the item's fault: no attempt is charged
        if isinstance(error, AuthError):
            return False
        work.counted += 1
        if error is None:
            if not self.refusals.decided:  # the endpoint answers: the refusals so far were the items' own
                self.refusals.decided = True
                self._settle_refused(failed=True)
            self.health.note_latency(latency_s)
            self.admission.on_answer(reply.limits.remaining_requests if reply and reply.limits else None, latency_s)
        return True

    def _record_attempt(
        self,
        work: _ItemWork,
        reply: Reply | None,
        error: ProviderError | None,
        *,
        cost: float | None,
        counted: bool,
        started: float,
        queue_wait_ms: float,
        latency_ms: float,
    ) -> None:
        """Queue the attempt's row for the writer; add its tokens and cost to the item's and the run's."""
        self._attempt_seq += 1
        record = AttemptRecord(
            seq=self._attempt_seq,
            job_id=self.job.id,
            item_id=work.item.id,
            run_id=self.run_id,
            number=work.counted + work.rate_limited,
            started_at=started,
            queue_wait_ms=queue_wait_ms,
            latency_ms=latency_ms,
            status_code=reply.status_code if reply else error.status_code if error else None,
            error_class=error.error_class if error else None,
            input_tokens=reply.input_tokens if reply else None,
            output_tokens=reply.output_tokens if reply else None,
            cached_tokens=reply.cached_tokens if reply else None,
            cost_usd=cost,
            ttft_ms=reply.ttft_ms if reply else None,
            tpot_ms=reply.tpot_ms if reply else None,
            counted=counted,
            error_message=attempt_message(error.message) if error else None,
            ttfb_ms=reply.ttfb_ms if reply else None,
        )
        self._attempts.append(record)
        work.last_attempt = record
        work.ready_at = time.monotonic()
        if error is not None:
            self.stats.errors[error.error_class] += 1
            return
        assert reply is not None
        self.stats.input_tokens += reply.input_tokens or 0
        self.stats.output_tokens += reply.output_tokens or 0
        work.input_tokens += reply.input_tokens or 0
        work.output_tokens += reply.output_tokens or 0
        if cost is not None:
            work.cost_usd = (work.cost_usd or 0.0) + cost
            self.stats.cost_usd += cost

    def _cost(self, reply: Reply) -> float | None:
        """USD of one answered attempt: the job's price, else the answering model's list price."""
        price = self.price
        if price is None and reply.model:
            if reply.model not in self._model_prices:
                self._model_prices[reply.model] = price_for(reply.model)
            price = self._model_prices[reply.model]
        if price is None:
            return None
        return price.cost(reply.input_tokens or 0, reply.output_tokens or 0, reply.cached_tokens or 0)

    def _http(self) -> Sender:
        if self._sender is None:
            raise RuntimeError("no HTTP sender")
        return self._sender

    # -- outcomes -----------------------------------------------------------

    def _settle_refused(self, *, failed: bool) -> None:
        """The items held by the refusal watcher: failed with their errors, or back to pending."""
        for work, error in self.refusals.release():
            if failed:
                self._finish(work, ItemState.FAILED, error=error)
            else:
                self._put_back(work)

    def _put_back(self, work: _ItemWork) -> None:
        self.tenure.settle(work)
        outcome = Outcome(work.item.id, ItemState.PENDING, work.counted, claim=work.item.claim)
        if work.last_error is not None:  # why it is not done yet: status and report show it
            error = work.last_error
            outcome.status_code, outcome.error_class, outcome.error_message = (
                error.status_code, error.error_class, error.message)
        self._outcomes.append(outcome)
        self.stats.done["released"] += 1
        self._maybe_flush()

    def _finish(
        self,
        work: _ItemWork,
        state: str,
        *,
        reply: Reply | None = None,
        error: ProviderError | None = None,
        invalid: OutputInvalidError | None = None,
        parsed: Any = _NO_VALUE,
    ) -> None:
        self.tenure.settle(work)
        outcome = Outcome(
            item_id=work.item.id, state=state, attempts=work.counted, finished_at=time.time(), request_hash=work.key,
            claim=work.item.claim,
        )
        if reply is not None:
            outcome.status_code = reply.status_code
            outcome.response = reply.body
            outcome.output = reply.output
            outcome.request_id = reply.request_id
            outcome.input_tokens = work.input_tokens
            outcome.output_tokens = work.output_tokens
            outcome.cost_usd = work.cost_usd
            outcome.latency_ms = work.last_attempt.latency_ms if work.last_attempt else None
            if parsed is not _NO_VALUE:
                outcome.parsed = orjson.dumps(parsed).decode()
            self._held_slots += 1
        if invalid is not None:
            outcome.error_class = invalid.error_class
            outcome.error_message = invalid.message
            outcome.validation_errors = orjson.dumps(invalid.errors).decode() if invalid.errors else None
        if error is not None:
            outcome.status_code = error.status_code
            outcome.response = error.body
            outcome.error_class = error.error_class
            outcome.error_message = error.message
        self._outcomes.append(outcome)
        self.stats.done[state] += 1
        self._maybe_flush()

    def _finish_cached(self, work: _ItemWork, answer: CachedAnswer) -> bool:
        """Finish an item with an answer the ledger already holds: succeeded, no request, no cost.

        A structured job checks the answer with its own validator (and parses it
        afresh); False if it does not pass, and the item is sent instead. No attempt row is
        written: attempts are HTTP requests, and latency or TTFT figures must
        not count answers that were never asked for.
        """
        ok, parsed = reusable(answer, self.validator, self.provider)
        if not ok:
            return False
        self.tenure.settle(work)
        self._outcomes.append(
            Outcome(
                item_id=work.item.id,
                claim=work.item.claim,
                state=ItemState.SUCCEEDED,
                attempts=work.counted,
                status_code=answer.status_code,
                response=answer.response,
                output=answer.output,
                parsed=parsed,
                request_id=answer.request_id,
                input_tokens=answer.input_tokens,
                output_tokens=answer.output_tokens,
                finished_at=time.time(),
                cost_usd=0.0,
                request_hash=work.key,
                cached_from=answer.item_id,
            )
        )
        self.stats.done[ItemState.SUCCEEDED] += 1
        self.stats.cached += 1
        self._maybe_flush()
        return True

    def _note_reask(self, work: _ItemWork) -> None:
        """Queue a structured item's re-asks so far for the next commit, so a run killed after it carries
        on from them instead of paying for them again. The invalid answer keeps its slot until that is
        committed, like a clean one: re-asks paid for but not yet in the ledger never exceed the
        concurrency (the re-ask itself may go out before the commit, in another free slot)."""
        self._outcomes.append(
            Outcome(
                item_id=work.item.id, state=ItemState.RUNNING, attempts=work.counted,
                followups=orjson.dumps(work.followups).decode(), claim=work.item.claim,
            )
        )
        self._held_slots += 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._outcomes) >= self._flush_count or self._held_slots:
            self._flush_now.set()

    async def _writer(self) -> None:
        last_beat = last_cancel_check = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(self._flush_now.wait(), self.options.flush_interval)
            except TimeoutError:
                pass
            self._flush_now.clear()
            self.stats.window = self.admission.controller.allowed
            self.stats.paused_for = self.admission.controller.paused_for()
            outcomes, self._outcomes = self._outcomes, []
            attempts, self._attempts = self._attempts, []
            held, self._held_slots = self._held_slots, 0
            if outcomes or attempts:
                await self._ledger(self.ledger.record, self.run_id, outcomes, attempts)
            if held:
                self.admission.release_committed(held)
            if not self.stopping and time.monotonic() - last_cancel_check >= self.options.cancel_poll_interval:
                last_cancel_check = time.monotonic()
                await self._notice_cancel()
            beat_due = self.tenure.wanted or time.monotonic() - last_beat >= self._heartbeat_interval
            if beat_due and not self.tenure.lock_lost:  # a lost lock is not asked for again
                last_beat = time.monotonic()
                await self.tenure.renew()
            if self._writer_done and not self._outcomes and not self._attempts:
                self.tenure.wake()
                return

    # -- the lock and the leases (their fences: batchrun.tenure) --------------

    async def _notice_cancel(self) -> None:
        """A ``batchrun cancel`` since the run started stops it: nothing more is sent (the cancelled items
        are no longer held), and answers already in flight are recorded. Looked for every
        ``cancel_poll_interval`` (one read of the job's row), not only with the heartbeat."""
        if await self._ledger(self.ledger.cancelled_since, self.job.id, self.stats.started_at) and not self.stopping:
            self.request_stop(
                StopReason.CANCELLED,
                f"job {self.job.id} was cancelled (batchrun cancel) while this run worked it: nothing more was "
                "sent, answers already in flight were recorded",
            )

    async def _renew_leases(self) -> dict[int, int]:
        """The heartbeat in the ledger: the lock (an exclusive run) and the leases renewed; the items still held."""
        return await self._ledger(
            lambda: self.ledger.heartbeat(self.job.id, self.run_id, self.lease_seconds, exclusive=self.options.exclusive)
        )

    def _lock_taken(self, lost: LockLostError) -> None:
        """Another run took the job over: stop, sending nothing more (exit 75)."""
        log.error("%s", lost.message, extra={"job": self.job.id})
        self.request_stop(StopReason.LOCK_LOST, lost.message)
