"""Admission: the waits a request passes before it is sent, and what it settles afterwards.

::

    async with admission.slot(estimate, ready=..., confirm=...) as slot:
        reply = await send(...)          # or a ProviderError
        slot.settle(reply, cost, error)

:meth:`Admission.slot` waits, in this order. The order was tuned (bench/RESULTS.md:
the pace within a slot since ``12132f8``, T2; the window last of the rate
waits since ``d8ac5c9``, T3s); keep it.

1. a concurrency slot (:class:`~batchrun.ratelimit.AdaptiveConcurrency`: slow
   start, the window, a shared pause after a 429), taken per attempt, so
   backoff sleeps between attempts hold none;
2. the send pace (:class:`~batchrun.ratelimit.SendPacer`): slots handed back
   together do not go out together;
3. the request pace (:class:`~batchrun.ratelimit.AimdRate`: ``rpm``, or with none
   a limit learnt from the headers and 429s; the job's
   :class:`~batchrun.ratelimit.SharedTokenBucket` on PostgreSQL with an ``rpm``),
   then 4. the token budget (``tpm``, charged the estimate: a
   :class:`~batchrun.ratelimit.TokenBucket`, or the shared one);
5. the request window (``rpm`` over any second): last of the rate waits, so
   the time it counts is the send's;
6. the spend reservation (:class:`~batchrun.budget.SpendBudget`: the request's
   worst case; :class:`~batchrun.errors.BudgetExceededError` stops the run);
7. ``ready()``, the caller's last word (the run still owns the item), and if
   it says no, ``confirm()`` to learn afresh — the run may have stalled in the
   waits above.

Whatever fails, is cancelled or is stopped before the block hands back the
slot and the reservation (rate budget already taken stays spent), and :class:`NotAdmitted` means "the run is
stopping: nothing was sent". Inside the block the request is in flight:
:meth:`Slot.settle` settles it once its fate is known (the reservation to
what it cost, the token budget to the tokens used, the provider's rate-limit
headers obeyed), and an exception that leaves the block before that counts
the reservation at its worst case (it may have been billed). A clean answer
keeps its concurrency slot past the block until :meth:`Admission.release_committed`
(the writer, once the answer is in the ledger), so answers paid for but not
yet committed never exceed the concurrency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from batchrun.budget import SpendBudget, settled_cost
from batchrun.ratelimit import AdaptiveConcurrency, AimdRate, RequestWindow, SendPacer, SharedTokenBucket, TokenBucket

if TYPE_CHECKING:
    from batchrun.errors import ProviderError
    from batchrun.providers import Reply
    from batchrun.providers.base import RateLimits

DEFAULT_PAUSE_S = 1.0  # a 429 with no Retry-After, in a run that is not paced
PACE_EVERY = 50  # this run's clean answers between two settings of the send pace


class NotAdmitted(Exception):
    """The run is stopping: the request was not sent and holds nothing; put its item back untouched."""


class Admission:
    """Every wait between a claimed item and its send, as one object (see the module docstring)."""

    def __init__(
        self,
        controller: AdaptiveConcurrency,
        *,
        pacer: SendPacer | None = None,
        request_budget: AimdRate | TokenBucket | SharedTokenBucket | None = None,
        token_budget: TokenBucket | SharedTokenBucket | None = None,
        request_window: RequestWindow | None = None,
        spend: SpendBudget | None = None,
        latencies: Sequence[float] = (),
    ) -> None:
        self.controller = controller
        self.pacer = pacer or SendPacer()
        # With no rpm the request pace is learned (from headers and 429s) and held.
        self.request_budget = request_budget if request_budget is not None else AimdRate()
        self.token_budget = token_budget
        self.request_window = request_window
        self.spend = spend
        self._rate_budgets = [b for b in (self.request_budget, token_budget) if b is not None]
        self._latencies = latencies  # the latest answers' latencies, oldest first: the pace follows them
        self._answers = 0
        self._stopped = False
        #: Whether :meth:`slot` needs the request's token estimate (a token or spend budget).
        self.counts_tokens = token_budget is not None or spend is not None

    @property
    def stopping(self) -> bool:
        return self._stopped

    def slot(
        self,
        estimate: int,
        *,
        ready: Callable[[], bool] | None = None,
        confirm: Callable[[], Awaitable[None]] | None = None,
    ) -> Slot:
        """Wait for everything a request of ``estimate`` tokens needs (``async with``).

        ``ready`` says whether the request may still be sent; when it says no
        after the waits, ``confirm`` is awaited to learn afresh and ``ready`` asked again.
        """
        return Slot(self, estimate, ready, confirm)

    def stop(self) -> None:
        """The run is stopping: wake every waiter; slots not yet taken raise :class:`NotAdmitted`."""
        self._stopped = True
        self.controller.stop()
        if self.spend is not None:
            self.spend.stop()

    def release_committed(self, n: int) -> None:
        """Hand back the slots of ``n`` answers now committed to the ledger."""
        self.controller.release(n)

    def set_limit(self, limit: int) -> None:
        """A new cap on requests in flight; the pace is what the slots carry, so it is re-set for their number."""
        self.controller.set_limit(limit)
        if self.pacer.interval > 0.0:
            self.pacer.follow(list(self._latencies), self.controller.limit)

    def on_answer(self, remaining_requests: int | None, latency_s: float) -> None:
        """A clean answer (its latency already among the latest): open up, and re-set the pace now and then.

        The pace follows only this run's answers (an earlier run's, read from the
        ledger, do not count), so a provider that has sped up is not held to an old pace.
        """
        self.controller.on_success(remaining_requests, latency_s)
        for budget in self._rate_budgets:
            budget.recover()
        self._answers += 1
        if self._answers % PACE_EVERY == 0:
            self.pacer.follow(list(self._latencies), self.controller.limit)

    def on_rate_limited(self, retry_after: float | None) -> None:
        """A 429: the rate budgets slowed down, everyone paused; fewer slots if nothing paced the rate yet.

        A paced run holds its slots (the pace, not the concurrency, went over the
        limit: halving the window would cap the rate at window / latency), and
        a whole-second ``Retry-After`` — an integer rounded up, all that many
        servers send — pauses everyone for its lower bound (``N - 1`` s, at least
        two sends at the pace): against a one-second window or a small bucket,
        ``Retry-After: 1`` means "a few ms", and a full second's pause at every
        429 would cost a second of sending each time.
        """
        paced = self._pace() is not None
        for budget in self._rate_budgets:
            budget.slow_down()
        rate = self._pace()
        if not paced or rate is None:
            self.controller.on_rate_limited(retry_after)  # the first brake of a run nothing paced yet
            return
        floor = 2.0 / rate
        if retry_after is None:
            pause = min(DEFAULT_PAUSE_S, floor)
        elif retry_after >= 1.0 and float(retry_after).is_integer():
            pause = min(retry_after, max(retry_after - 1.0, floor))
        else:
            pause = retry_after
        self.controller.on_rate_limited(pause, shrink=False)
        if isinstance(self.request_budget, AimdRate):
            self.request_budget.hold(pause)

    def _pace(self) -> float | None:
        """Requests per second this process's request budget paces at, if it paces. A bucket the
        workers share is not such a pace (each 429 of a burst slows it again): a 429 brakes the
        window as before."""
        budget = self.request_budget
        if isinstance(budget, (AimdRate, TokenBucket)):
            return budget.rate
        return None

    def pause(self, seconds: float) -> None:
        """Every request has been failing: pause everyone (and shrink the window) as a 429 would."""
        self.controller.on_rate_limited(seconds)

    def obey_headers(self, limits: RateLimits, age_s: float = 0.0) -> None:
        """Learn the request limit from the headers; if the budget is spent, pause everyone until it resets.

        ``age_s`` is how long ago the request was sent: the provider counted its
        reset from then, so a one-second window's reset read after a 200 ms answer
        is 200 ms nearer.
        """
        if isinstance(self.request_budget, AimdRate):
            self.request_budget.learn(limits.limit_requests, limits.remaining_requests, limits.reset_requests_s)
        for remaining, reset in (
            (limits.remaining_requests, limits.reset_requests_s),
            (limits.remaining_tokens, limits.reset_tokens_s),
        ):
            if remaining is not None and remaining <= 0 and reset and reset > age_s:
                self.controller.pause(reset - age_s)


class Slot:
    """One request's way through :class:`Admission`: what it holds, and settling it once."""

    __slots__ = ("_admission", "estimate", "held", "_ready", "_confirm", "_settled", "sent_at")

    def __init__(
        self,
        admission: Admission,
        estimate: int,
        ready: Callable[[], bool] | None,
        confirm: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self._admission = admission
        self.estimate = estimate
        self.held: float | None = None  # USD held of the spend budget
        self._ready = ready
        self._confirm = confirm
        self._settled = False
        self.sent_at = 0.0  # monotonic: when the waits were passed (the request goes now)

    async def __aenter__(self) -> Slot:
        a = self._admission
        if not await a.controller.acquire():
            raise NotAdmitted
        try:
            if pause := a.pacer.delay():
                await asyncio.sleep(pause)
            if a.request_budget is not None:
                await a.request_budget.take(1)
            if a.token_budget is not None:
                await a.token_budget.take(self.estimate)
            if a.request_window is not None:
                await a.request_window.admit()
            if a.spend is not None:
                self.held = await a.spend.reserve(self.estimate)  # BudgetExceededError: stop the run
                if self.held is None:
                    raise NotAdmitted
            if self._ready is not None and not self._ready() and self._confirm is not None:
                await self._confirm()
        except BaseException:
            self._hand_back()
            raise
        if a.stopping or (self._ready is not None and not self._ready()):
            self._hand_back()
            raise NotAdmitted
        self.sent_at = time.monotonic()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._settled:
            return
        if exc_type is None:
            raise RuntimeError("a request's slot was left without settling it")
        # Cut off in flight: the slot is free, and the request may have been billed.
        a = self._admission
        a.controller.release()
        if a.spend is not None and self.held is not None:
            a.spend.settle(self.held, self.held)
        self._settled = True

    def settle(self, reply: Reply | None, cost: float | None, error: ProviderError | None) -> None:
        """The request's fate is known: ``reply`` (which cost ``cost``) or ``error``.

        An error hands its slot back at once; a clean answer keeps it until
        :meth:`Admission.release_committed`.
        """
        a = self._admission
        if error is not None:
            a.controller.release()
        if a.spend is not None and self.held is not None:
            a.spend.settle(self.held, settled_cost(self.held, reply, cost, error))
        if a.token_budget is not None:
            used = (reply.input_tokens or 0) + (reply.output_tokens or 0) if reply else self.estimate
            a.token_budget.settle(self.estimate, used)
        if reply is not None and reply.limits is not None:
            a.obey_headers(reply.limits, time.monotonic() - self.sent_at)
        self._settled = True

    def _hand_back(self) -> None:
        """Not sent: give back the slot and the reservation."""
        a = self._admission
        a.controller.release()
        if a.spend is not None and self.held is not None:
            a.spend.release(self.held)
        self._settled = True
