"""Admission on its own: the order of the waits, handing back on cancel or stop, settling once."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from batchrun.admission import PACE_EVERY, Admission, NotAdmitted
from batchrun.budget import SpendBudget
from batchrun.errors import BudgetExceededError, RetryableError
from batchrun.pricing import Price
from batchrun.providers import Reply
from batchrun.providers.base import RateLimits
from batchrun.ratelimit import AdaptiveConcurrency, AimdRate, RequestWindow, SendPacer, TokenBucket

# $1 per token at the worst-case rate: a request estimated at 5 tokens holds $5.
PRICE = Price(input=250_000.0, output=1_000_000.0, cached_input=100_000.0)
ESTIMATE = 5
STAGES = ["concurrency", "pace", "requests", "tokens", "window", "spend", "ready"]


def reply(input_tokens: int | None = 2, output_tokens: int | None = 1, limits: RateLimits | None = None) -> Reply:
    return Reply(200, "{}", "ok", "stop", input_tokens, output_tokens, None, limits=limits)


@dataclass
class Parts:
    """An admission whose every wait passes at once, except the one made to block."""

    controller: AdaptiveConcurrency = field(default_factory=lambda: AdaptiveConcurrency(2, initial=2))
    pacer: SendPacer = field(default_factory=SendPacer)
    requests: TokenBucket = field(default_factory=lambda: TokenBucket(0.6))  # one request in it, then 100 s each
    tokens: TokenBucket = field(default_factory=lambda: TokenBucket(0.6))  # holds 1: a take of 5 leaves -4
    window: RequestWindow = field(default_factory=lambda: RequestWindow(0.6))  # one request per 100 s
    spend: SpendBudget = field(default_factory=lambda: SpendBudget(10.0, PRICE))
    owned: bool = True  # what ready() says
    confirmed: bool = True  # what a confirmation finds
    ready_calls: int = 0
    confirm_gate: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.confirm_gate.set()
        self.admission = Admission(
            self.controller, pacer=self.pacer, request_budget=self.requests, token_budget=self.tokens,
            request_window=self.window, spend=self.spend,
        )

    async def block(self, stage: str) -> None:
        if stage == "concurrency":
            for _ in range(2):
                assert await self.controller.acquire()
        elif stage == "pace":
            self.pacer.set_pace(1, 100.0)  # one send per ~83 s beyond a burst of 8
            for _ in range(8):
                assert self.pacer.delay() == 0.0
        elif stage == "requests":
            self.requests.tokens = 0.0
        elif stage == "tokens":
            self.tokens.tokens = 0.0
        elif stage == "window":
            await self.window.admit()
        elif stage == "spend":
            assert await self.spend.reserve(8) == 8.0  # 8 + 5 > 10: waits for it to settle
        elif stage == "ready":
            self.owned = False
            self.confirm_gate.clear()

    def ready(self) -> bool:
        self.ready_calls += 1
        return self.owned

    async def confirm(self) -> None:
        await self.confirm_gate.wait()
        self.owned = self.confirmed

    def taken(self) -> dict[str, bool]:
        """Which waits this request has passed (the pace leaves no trace to read)."""
        return {
            "concurrency": self.controller.in_flight > self._base_in_flight,
            "requests": self.requests.tokens < self._base_requests - 0.5,
            "tokens": self.tokens.tokens < self._base_tokens - 1.0,
            "window": len(self.window._sent) > self._base_sent,
            "spend": self.spend.reserved > self._base_reserved,
            "ready": self.ready_calls > 0,
        }

    def mark(self) -> None:
        self._base_in_flight = self.controller.in_flight
        self._base_requests = self.requests.tokens
        self._base_tokens = self.tokens.tokens
        self._base_sent = len(self.window._sent)
        self._base_reserved = self.spend.reserved

    def holds_nothing(self) -> bool:
        return self.controller.in_flight == self._base_in_flight and self.spend.reserved == self._base_reserved


def roomy(spend: SpendBudget | None = None) -> Parts:
    """Parts whose rate budgets let many requests through (those of :class:`Parts` let one)."""
    return Parts(
        requests=TokenBucket(60_000), tokens=TokenBucket(6_000_000), window=RequestWindow(60_000),
        spend=spend or SpendBudget(10.0, PRICE),
    )


async def enter(parts: Parts, entered: asyncio.Event) -> None:
    async with parts.admission.slot(ESTIMATE, ready=parts.ready, confirm=parts.confirm) as slot:
        entered.set()
        slot.settle(reply(), 0.0, None)


@pytest.mark.parametrize("stage", STAGES)
def test_the_waits_come_in_their_order_and_a_cancel_hands_back_what_was_taken(stage: str) -> None:
    async def go() -> None:
        parts = Parts()
        await parts.block(stage)
        parts.mark()
        entered = asyncio.Event()
        task = asyncio.create_task(enter(parts, entered))
        await asyncio.sleep(0.1)
        assert not entered.is_set()
        taken = parts.taken()
        i = STAGES.index(stage)
        assert all(taken[s] for s in STAGES[:i] if s != "pace"), taken  # every earlier wait passed
        assert not any(taken[s] for s in STAGES[i + 1 :] if s != "pace"), taken  # no later one entered
        if stage not in ("pace", "ready"):
            assert not taken[stage], taken
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert parts.holds_nothing()

    asyncio.run(go())


def test_a_request_that_passes_every_wait_holds_a_slot_and_its_worst_case() -> None:
    async def go() -> None:
        parts = Parts()
        parts.mark()
        async with parts.admission.slot(ESTIMATE, ready=parts.ready, confirm=parts.confirm) as slot:
            assert all(parts.taken().values())
            assert slot.held == 5.0 and parts.spend.reserved == 5.0
            slot.settle(reply(), 0.5, None)

    asyncio.run(go())


@pytest.mark.parametrize("stage", ["concurrency", "spend"])
def test_a_stop_wakes_the_waiters_and_they_hold_nothing(stage: str) -> None:
    async def go() -> None:
        parts = Parts()
        await parts.block(stage)
        parts.mark()
        task = asyncio.create_task(enter(parts, asyncio.Event()))
        await asyncio.sleep(0.05)
        assert not task.done()
        parts.admission.stop()
        with pytest.raises(NotAdmitted):
            await asyncio.wait_for(task, 1)
        assert parts.holds_nothing()
        with pytest.raises(NotAdmitted):  # and nothing is admitted from now on
            await enter(parts, asyncio.Event())
        assert parts.holds_nothing()

    asyncio.run(go())


def test_a_stop_during_the_last_check_sends_nothing() -> None:
    async def go() -> None:
        parts = Parts()
        await parts.block("ready")
        parts.mark()
        task = asyncio.create_task(enter(parts, asyncio.Event()))
        await asyncio.sleep(0.05)
        parts.admission.stop()
        parts.confirm_gate.set()  # the run still owns the item, but it is stopping
        with pytest.raises(NotAdmitted):
            await asyncio.wait_for(task, 1)
        assert parts.holds_nothing()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("make", "raised"),
    [
        (lambda: Parts(owned=False, confirmed=False), NotAdmitted),  # the run no longer owns the item
        (lambda: Parts(spend=SpendBudget(10.0, PRICE, spent_usd=6.0)), BudgetExceededError),  # 6 + 5 > 10
    ],
    ids=["not-owned", "over-budget"],
)
def test_a_request_turned_away_holds_nothing_and_costs_nothing(
    make: Callable[[], Parts], raised: type[Exception]
) -> None:
    async def go() -> None:
        parts = make()
        parts.mark()
        spent = parts.spend.spent
        with pytest.raises(raised):
            await enter(parts, asyncio.Event())
        assert parts.holds_nothing() and parts.spend.spent == spent

    asyncio.run(go())


def test_a_clean_answer_settles_to_its_cost_and_keeps_its_slot_until_committed() -> None:
    async def go() -> None:
        parts = Parts()
        async with parts.admission.slot(ESTIMATE) as slot:
            slot.settle(reply(2, 1), 0.75, None)
        assert parts.spend.spent == 0.75 and parts.spend.reserved == 0.0
        assert parts.tokens.tokens == pytest.approx(-4.0 + ESTIMATE - 3, abs=0.01)  # charged 3 used, not 5
        assert parts.controller.in_flight == 1  # answered, not yet in the ledger
        parts.admission.release_committed(1)
        assert parts.controller.in_flight == 0

    asyncio.run(go())


@pytest.mark.parametrize(
    ("error", "spent"),
    [
        (RetryableError("HTTP 500", status_code=500), 0.0),  # an error answer is not billed
        (RetryableError("timed out", error_class="timeout"), 5.0),  # it may have been: the worst case
    ],
)
def test_a_failed_request_frees_its_slot_at_once(error: RetryableError, spent: float) -> None:
    async def go() -> None:
        parts = Parts()
        async with parts.admission.slot(ESTIMATE) as slot:
            slot.settle(None, None, error)
        assert parts.controller.in_flight == 0
        assert parts.spend.spent == spent and parts.spend.reserved == 0.0
        assert parts.tokens.tokens == pytest.approx(-4.0, abs=0.01)  # charged its estimate

    asyncio.run(go())


def test_a_request_cut_off_in_flight_counts_its_worst_case_once() -> None:
    async def go() -> None:
        parts = roomy(spend=SpendBudget(100.0, PRICE))
        with pytest.raises(ConnectionError):
            async with parts.admission.slot(ESTIMATE):
                raise ConnectionError("cut off")
        assert parts.controller.in_flight == 0
        assert parts.spend.spent == 5.0 and parts.spend.reserved == 0.0
        # Settled, then an error in the block: settled once, the clean answer's slot still held.
        with pytest.raises(ConnectionError):
            async with parts.admission.slot(ESTIMATE) as slot:
                slot.settle(reply(), 1.0, None)
                raise ConnectionError("after the answer")
        assert parts.spend.spent == 6.0 and parts.spend.reserved == 0.0
        assert parts.controller.in_flight == 1

    asyncio.run(go())


def test_a_block_that_forgets_to_settle_is_a_bug() -> None:
    async def go() -> None:
        parts = Parts()
        with pytest.raises(RuntimeError, match="without settling"):
            async with parts.admission.slot(ESTIMATE):
                pass

    asyncio.run(go())


def test_spent_rate_limit_headers_pause_everyone_until_they_reset() -> None:
    async def go() -> None:
        parts = roomy()
        async with parts.admission.slot(ESTIMATE) as slot:  # budget left: no pause
            slot.settle(reply(limits=RateLimits(remaining_tokens=10, reset_tokens_s=60.0)), 0.0, None)
        assert parts.controller.paused_for() == 0.0
        async with parts.admission.slot(ESTIMATE) as slot:
            slot.settle(reply(limits=RateLimits(remaining_requests=0, reset_requests_s=5.0)), 0.0, None)
        assert 4.0 < parts.controller.paused_for() <= 5.0

    asyncio.run(go())


def test_the_pace_follows_this_runs_answers_and_a_new_limit() -> None:
    async def go() -> None:
        latencies: deque[float] = deque([10.0] * 100)  # an earlier run's: the pace waits for this run's own
        controller = AdaptiveConcurrency(10, initial=10)
        admission = Admission(controller, latencies=latencies)
        admission.set_limit(10)
        assert admission.pacer.interval == 0.0  # not pacing yet: a new limit sets no pace
        for _ in range(PACE_EVERY - 1):
            latencies.append(0.12)
            admission.on_answer(None, 0.12)
        assert admission.pacer.interval == 0.0
        latencies.append(0.12)
        admission.on_answer(None, 0.12)
        assert admission.pacer.interval == pytest.approx(0.12 / (10 * 1.2))  # the latest 50, not the old 10 s
        admission.set_limit(5)
        assert controller.limit == 5
        assert admission.pacer.interval > 0.12 / (10 * 1.2)  # fewer slots carry fewer sends

    asyncio.run(go())


def test_a_429_in_a_paced_run_slows_the_budgets_and_pauses_everyone_but_keeps_the_slots() -> None:
    async def go() -> None:
        parts = Parts(requests=TokenBucket(600), tokens=TokenBucket(60_000))
        rates = (parts.requests.rate, parts.tokens.rate)
        parts.admission.on_rate_limited(0.35)  # an exact wait (retry-after-ms): obeyed as it is
        assert parts.controller.allowed == 2 and 0.3 < parts.controller.paused_for() <= 0.35
        assert parts.requests.rate < rates[0] and parts.tokens.rate < rates[1]
        parts.admission.on_answer(None, 0.1)
        assert parts.requests.rate > rates[0] * 0.8  # eased back a little per clean answer

    asyncio.run(go())


def test_a_whole_second_retry_after_pauses_a_paced_run_for_its_lower_bound() -> None:
    async def go() -> None:
        parts = Parts(requests=TokenBucket(600), tokens=TokenBucket(60_000))
        parts.admission.on_rate_limited(3.0)  # an integer, rounded up: the wait is in (2, 3]
        assert 1.9 < parts.controller.paused_for() <= 2.0
        parts.admission.on_rate_limited(1.0)  # (0, 1]: two sends at the pace (~10/s, slowed)
        assert parts.controller.paused_for() <= 2.0
        fresh = Parts(requests=TokenBucket(600), tokens=TokenBucket(60_000))
        fresh.admission.on_rate_limited(1.0)
        assert 0.15 < fresh.controller.paused_for() <= 0.35 and fresh.controller.allowed == 2

    asyncio.run(go())


def test_the_first_429_of_a_run_nothing_paces_halves_the_window_and_obeys_retry_after_in_full() -> None:
    async def go() -> None:
        controller = AdaptiveConcurrency(8, initial=8)
        admission = Admission(controller)
        assert isinstance(admission.request_budget, AimdRate) and admission.request_budget.rate is None
        admission.on_rate_limited(1.0)
        assert controller.allowed == 4 and 0.9 < controller.paused_for() <= 1.0
        assert admission.request_budget.rate is not None  # paced from now on: the limit is being learnt

    asyncio.run(go())


def test_only_a_token_or_spend_budget_needs_the_estimate() -> None:
    async def go() -> None:
        assert not Admission(AdaptiveConcurrency(1), request_budget=TokenBucket(60)).counts_tokens
        assert Admission(AdaptiveConcurrency(1), token_budget=TokenBucket(60)).counts_tokens
        assert Admission(AdaptiveConcurrency(1), spend=SpendBudget(1.0, PRICE)).counts_tokens

    asyncio.run(go())

