"""batchrun.ratelimit: the adaptive concurrency window (probe, open evenly, back off, shared out),
the request window, the send pacer, the AIMD request pace (on a simulated clock), and the token
bucket shared through the ledger."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest

from batchrun.ratelimit import (
    MIN_PACE_BURST,
    PROBE_ANSWERS,
    AdaptiveConcurrency,
    AimdRate,
    RequestWindow,
    SendPacer,
    SharedTokenBucket,
)
from batchrun.testing.limiters import Bucket, FixedWindow, Limiter, SlidingWindow


def test_probe_answers_grow_the_window_one_by_one() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(200, initial=4)
        for n in range(1, PROBE_ANSWERS):
            c.on_success(latency_s=0.2)
            assert c.allowed == 4 + n  # a wrong key or model costs a handful of requests
        assert c.allowed < 10

    asyncio.run(go())


def test_window_opens_to_the_cap_spread_over_one_latency() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(200, initial=4)
        seen: list[tuple[float, int]] = []
        started = time.monotonic()
        for _ in range(PROBE_ANSWERS):
            c.on_success(latency_s=0.2)
        while c.allowed < 200 and time.monotonic() - started < 2:
            seen.append((time.monotonic() - started, c.allowed))
            await asyncio.sleep(0.01)
        assert c.allowed == 200
        took = time.monotonic() - started
        assert 0.15 <= took <= 1.5, took  # not at once: spread over ~the answer's latency
        halfway = [allowed for t, allowed in seen if 0.08 <= t <= 0.12]
        assert halfway and all(20 <= a <= 170 for a in halfway), seen  # evenly, not in one step

    asyncio.run(go())


def test_waiters_are_let_in_as_the_window_opens() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(50, initial=4)
        for _ in range(4):
            assert await c.acquire()
        waiters = [asyncio.ensure_future(c.acquire()) for _ in range(46)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)
        for _ in range(PROBE_ANSWERS):
            c.on_success(latency_s=0.1)
        await asyncio.sleep(0.04)
        some = sum(w.done() for w in waiters)
        assert 0 < some < 46  # part of them after ~40% of the latency
        await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
        assert c.in_flight == 50

    asyncio.run(go())


def test_opening_stops_at_the_providers_remaining_requests() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(200, initial=4)
        for _ in range(PROBE_ANSWERS):
            c.on_success(remaining_requests=30, latency_s=0.05)
        await asyncio.sleep(0.3)
        assert c.allowed == 30

    asyncio.run(go())


def test_a_429_during_the_opening_halves_and_stops_it() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(200, initial=4)
        for _ in range(PROBE_ANSWERS):
            c.on_success(latency_s=0.2)
        await asyncio.sleep(0.1)
        before = c.allowed
        assert 10 < before < 200
        c.on_rate_limited(retry_after=0.05)
        assert c.allowed == before // 2
        await asyncio.sleep(0.3)
        assert c.allowed == before // 2  # no further opening: +1/window per clean answer from here
        c.on_success(latency_s=0.2)
        assert c.allowed <= before // 2 + 1

    asyncio.run(go())


def test_a_rate_limited_run_never_opens_at_once() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(200, initial=4)
        c.on_rate_limited(retry_after=0.0)
        for _ in range(PROBE_ANSWERS * 4):
            c.on_success(latency_s=0.2)
        await asyncio.sleep(0.05)
        assert c.allowed < 10

    asyncio.run(go())


@pytest.mark.slow
def test_request_window_never_lets_a_second_hold_more_than_its_share() -> None:
    async def go() -> list[float]:
        window = RequestWindow(600)  # 10 per second
        assert (window.count, round(window.window_s, 3)) == (10, 1.01)
        sent: list[float] = []
        for _ in range(25):
            await window.admit()
            sent.append(time.monotonic())
        return sent

    sent = asyncio.run(go())
    assert sent[9] - sent[0] < 0.1  # the first ten go at once: the window only bounds a second
    for i in range(10, len(sent)):
        assert sent[i] - sent[i - 10] >= 1.01 - 0.002  # any 11 span more than a second
    assert sent[-1] - sent[0] < 2.2  # and it does not hold them back beyond that


def test_request_window_below_one_per_second_spaces_requests() -> None:
    window = RequestWindow(30)  # one every 2 s
    assert window.count == 1 and abs(window.window_s - 2.01) < 1e-9


def test_pacer_lets_a_burst_go_then_spaces_sends_at_gain_times_what_the_slots_carry() -> None:
    pacer = SendPacer(gain=1.2, burst_fraction=0.05)
    assert [pacer.delay() for _ in range(50)] == [0.0] * 50  # no latency known yet: no pacing
    pacer.set_pace(400, 0.48)  # 400 slots of 0.48 s carry 833/s; paced at 1,000/s, 20 at once
    assert pacer.interval == pytest.approx(0.001)
    assert pacer.burst == 20.0
    delays = [pacer.delay() for _ in range(40)]
    assert delays[:20] == [0.0] * 20
    # Each later send waits one more interval (the calls take microseconds, hence abs).
    for n, delay in enumerate(delays[20:], start=1):
        assert delay == pytest.approx(n * 0.001, abs=0.0005)
    pacer.set_pace(10, 0.12)
    assert pacer.burst == MIN_PACE_BURST  # a few answers coming back together never wait


def test_pacer_does_not_hold_back_sends_that_come_at_its_pace() -> None:
    pacer = SendPacer(gain=1.2, burst_fraction=0.05)
    pacer.set_pace(10, 0.12)  # one send per 10 ms at the pace
    waited = 0.0
    for _ in range(20):
        waited += pacer.delay()
        time.sleep(0.011)
    assert waited == 0.0


def test_pacer_backlog_shrinks_with_the_pace() -> None:
    pacer = SendPacer(gain=1.0, burst_fraction=0.01)
    pacer.set_pace(10, 1.0)  # one send per 0.1 s, 8 at once
    assert [round(pacer.delay(), 2) for _ in range(11)] == [0.0] * 8 + [0.1, 0.2, 0.3]
    pacer.set_pace(10, 0.1)  # ten times faster: the 0.4 s booked beyond the burst become 0.04 s
    assert pacer.delay() == pytest.approx(0.04, abs=0.005)


def test_pace_follows_a_speed_up_at_once_and_a_slow_down_over_a_few_round_trips() -> None:
    pacer = SendPacer(gain=1.0, burst_fraction=0.01)
    pacer.follow([1.0] * 2000 + [0.01] * 50, 100)  # the provider became 100x faster
    assert pacer.interval == pytest.approx(0.01 / 100)
    pacer.follow([0.01] * 2000 + [1.0] * 50, 100)  # it became slower: the latest 400 answers' mean
    assert pacer.interval == pytest.approx((350 * 0.01 + 50 * 1.0) / 400 / 100)


def test_concurrency_limit_can_be_shared_out() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(8, initial=8)
        for _ in range(6):
            assert await c.acquire()
        c.set_limit(4)
        assert c.allowed == 4
        waiter = asyncio.ensure_future(c.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # 6 in flight over a limit of 4: wait until 3 are back
        c.release(3)
        assert await waiter

    asyncio.run(go())


def test_shared_bucket_reserves_in_chunks_and_waits_what_the_ledger_says() -> None:
    asked: list[float] = []

    async def reserve(amount: float) -> float:
        asked.append(amount)
        return 0.3 if len(asked) > 1 else 0.0  # the second chunk is paid for in 0.3 s (the job's bucket is in debt)

    async def go() -> float:
        bucket = SharedTokenBucket(6000, reserve)  # 98.5/s: chunks of ~19.7
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(30):
            await bucket.take(1)
        assert len(asked) == 2 and asked[0] == pytest.approx(6000 / 60 * 0.985 * 0.2)
        bucket.slow_down()  # after a 429 each request costs this process more of the job's budget
        local = bucket.local
        await bucket.take(1)
        assert bucket.local == pytest.approx(local - 1.25) and len(asked) == 2
        bucket.settle(10, 4)  # the estimate was high: the rest stays here
        return loop.time() - t0

    # Each part of a chunk is spent once paid for: the 30th request waits until 0.3 s minus the
    # 9.4 requests' worth still reserved behind it (at 98.5/s), not for the whole chunk.
    assert 0.3 - 9.4 / 98.5 - 0.01 <= asyncio.run(go()) < 0.3


def test_a_big_take_reserves_what_it_needs() -> None:
    asked: list[float] = []

    async def reserve(amount: float) -> float:
        asked.append(amount)
        return 0.0

    async def go() -> None:
        bucket = SharedTokenBucket(60_000, reserve)  # tokens: chunks of ~197
        await bucket.take(1500)
        assert asked == [1500]
        bucket.settle(1500, 1700)  # it cost more than estimated: owed locally, reserved with the next take
        await bucket.take(10)
        assert asked[1] == pytest.approx(210)

    asyncio.run(go())


class SimClock:
    """A clock that moves only when slept on; a sleep may wake up ``lag`` late (exponential, mean ``lag``)."""

    def __init__(self, lag: float = 0.0, seed: int = 3) -> None:
        self.t = 1000.0
        self.lag = lag
        self._rng = random.Random(seed)

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0) + (self._rng.expovariate(1.0 / self.lag) if self.lag else 0.0)


def aimd(per_minute: float = 0.0, lag: float = 0.0) -> tuple[AimdRate, SimClock]:
    clock = SimClock(lag)
    return AimdRate(per_minute, clock=clock, sleep=clock.sleep), clock


def test_aimd_paces_at_the_configured_limit_and_never_puts_more_than_its_share_in_a_second() -> None:
    rate, clock = aimd(3000)
    assert rate.rate == pytest.approx(50 * 0.985)
    sent: list[float] = []

    async def go() -> None:
        for _ in range(500):
            await rate.take()
            sent.append(clock())
            clock.t += 0.0003  # the loop's own time between sends

    asyncio.run(go())
    assert 500 / (sent[-1] - sent[0]) == pytest.approx(50 * 0.985, rel=0.01)
    for i in range(50, len(sent)):
        assert sent[i] - sent[i - 50] > 1.0  # no second holds 51


def test_aimd_catches_up_a_little_after_a_late_wake_up_not_a_burst() -> None:
    rate, clock = aimd(3000)

    async def go() -> list[float]:
        out = []
        for i in range(40):
            await rate.take()
            out.append(clock())
            if i == 20:
                clock.t += 0.2  # a stall of 10 intervals
        return out

    sent = asyncio.run(go())
    gaps = [b - a for a, b in zip(sent[21:], sent[22:])]
    assert sum(1 for g in gaps if g < 0.001) <= round(AimdRate.CATCH_UP_S * 50)  # 50 ms caught up, then the pace


def test_a_429_decreases_the_pace_once_per_burst_and_clean_answers_bring_it_back_to_the_limit() -> None:
    rate, clock = aimd(3000)
    full = rate.rate
    assert full is not None
    rate.slow_down()
    clock.t += 0.2
    rate.slow_down()  # the same burst: no second decrease
    assert rate.rate == pytest.approx(full * AimdRate.DECREASE)
    for _ in range(100):  # 50 clean answers a second
        clock.t += 0.02
        rate.recover()
    assert rate.rate == pytest.approx(full)  # two seconds on, back at the full pace
    rate.slow_down()  # another 429 soon (within QUIET_SENDS): the limit aimed at is lowered a step
    for _ in range(100):
        clock.t += 0.02
        rate.recover()
    assert rate.rate == pytest.approx(full * 0.985)
    for _ in range(int((AimdRate.HOLD_S + 5.0) / 0.02)):
        clock.t += 0.02
        rate.recover()
        assert rate.rate <= full + 1e-9  # never above the configured limit's pace
    # ... and after a quiet spell at the full pace again: it does not stay down.
    assert rate.rate == pytest.approx(full)
    assert rate.limit == 50 and rate.learned_from == "configured"


def test_repeated_429s_bring_the_pace_down_multiplicatively() -> None:
    rate, clock = aimd(3000)
    paces = []
    for _ in range(5):
        rate.slow_down()
        paces.append(rate.rate)
        clock.t += 1.0
    assert paces == pytest.approx([50 * 0.985 * AimdRate.DECREASE ** k for k in range(1, 6)])


def test_an_unknown_limit_is_learnt_from_the_headers_and_held() -> None:
    rate, clock = aimd()
    assert rate.rate is None and rate.limit is None  # not pacing: nothing known
    rate.learn(3000, 2990, None)
    assert rate.limit == pytest.approx(50) and rate.learned_from == "headers"
    assert rate.rate == pytest.approx(50 * 0.985)
    for _ in range(100):
        clock.t += 0.02
        rate.recover()
        rate.learn(3000, 2990, None)
    assert rate.limit == pytest.approx(50) and rate.rate == pytest.approx(50 * 0.985)  # held
    rate.slow_down()  # a 429 at the held pace, once: the limit holds, the pace comes back
    assert rate.limit == pytest.approx(50) and rate.learned_from == "429s"
    for _ in range(100):
        clock.t += 0.02
        rate.recover()
    assert rate.rate == pytest.approx(50 * 0.985)
    rate.slow_down()  # 429s again and again: one step lower at most each
    assert rate.limit == pytest.approx(50 * 0.985)
    for _ in range(200):
        clock.t += 0.02
        rate.recover()
        rate.learn(3000, 2990, None)  # the headers do not undo what the 429s said
    assert rate.rate == pytest.approx(50 * 0.985 ** 2)


def test_a_count_per_a_shorter_window_is_read_as_such() -> None:
    rate, clock = aimd()

    async def go() -> None:
        for _ in range(20):
            await rate.take()  # not paced yet: the sends are only counted
            clock.t += 0.01

    asyncio.run(go())
    rate.learn(50, 45, 0.4)  # 20 sent, 45 of 50 left and whole again in 0.4 s: not a per-minute budget
    rate.learn(50, 45, 1.0)  # a fixed one-second window: its reset is never more than 1 s
    assert rate.limit == pytest.approx(50.0)
    assert rate.rate == pytest.approx(50 * 0.985)


def test_a_per_minute_bucket_that_refills_as_it_goes_is_read_per_minute() -> None:
    rate, clock = aimd()

    async def go() -> None:
        for _ in range(20):
            await rate.take()
            clock.t += 0.1

    asyncio.run(go())
    # OpenAI's way: 3,000 a minute refilled continuously, so after 20 sends at 10/s most is back,
    # and the rest in (3000 - 2990) / 50 = 0.2 s.
    rate.learn(3000, 2990, 0.2)
    assert rate.limit == pytest.approx(50.0) and rate.learned_from == "headers"


def test_configured_limit_ignores_the_headers() -> None:
    rate, _ = aimd(600)
    rate.learn(3000, 2990, None)
    assert rate.limit == 10 and rate.rate == pytest.approx(10 * 0.985)


def test_an_unknown_limit_is_learnt_from_429s_and_probed_again_after_a_quiet_spell() -> None:
    rate, clock = aimd()
    for _ in range(20):  # 20 clean answers in the last second, nothing paced
        clock.t += 0.05
        rate.recover()
    rate.slow_down()
    assert rate.rate == 20 and rate.limit is None
    grown_for = 0.0
    while rate.rate < 60 or grown_for < AimdRate.DECREASE_EVERY_S + 0.01:  # grows fast while nothing is known
        clock.t += 0.02  # the server answers 50 a second cleanly meanwhile
        grown_for += 0.02
        rate.recover()
    at_429 = rate.rate
    assert at_429 > 60
    rate.slow_down()
    # The pace had grown past the limit before the 429 said so: the limit is what came back clean.
    assert rate.limit == pytest.approx(50, abs=1.5) and rate.rate == pytest.approx(rate.limit * 0.985)
    for _ in range(int(AimdRate.LEARNT_HOLD_S / 0.02)):
        clock.t += 0.02
        rate.recover()
    assert rate.rate == pytest.approx(rate.limit * 0.985)  # held just under it
    held = rate.rate
    for _ in range(500):
        clock.t += 0.02
        rate.recover()
    assert rate.rate > held  # probing above it again


def simulate(limiter: Limiter, *, per_minute: float, seconds: float, jitter_s: float, lag_s: float,
             seed: int = 7) -> tuple[int, int, float]:
    """Send through ``limiter`` (50/s enforced) for ``seconds`` at the AIMD pace: (accepted, 429s, pace at the end).

    Each send reaches the server ``jitter_s`` late at most (uniform), the pacer's sleeps wake up
    ``lag_s`` late on average; a 429 is known at once.
    """
    rate, clock = aimd(per_minute, lag_s)
    rng = random.Random(seed)
    accepted = refused = 0
    if per_minute == 0:
        rate.learn(3000, 3000 - 1, None)  # what the first answer's headers would say

    async def go() -> None:
        nonlocal accepted, refused
        start = clock()
        while clock() - start < seconds:
            await rate.take()
            arrival = clock() + rng.uniform(0.0, jitter_s)
            if limiter.take(3000, arrival, 1.0) > 0:
                refused += 1
                rate.slow_down()
            else:
                accepted += 1
                rate.recover()
            clock.t += 0.0005

    asyncio.run(go())
    return accepted, refused, rate.rate or 0.0


LIMITERS: dict[str, Callable[[], Limiter]] = {"fixed": FixedWindow, "bucket": lambda: Bucket(1.0), "sliding": SlidingWindow}


@pytest.mark.parametrize(("shape", "per_minute", "share", "most_429s"), [
    ("fixed", 3000, 0.97, 0.001), ("sliding", 3000, 0.97, 0.001),
    ("fixed", 0, 0.94, 0.005), ("sliding", 0, 0.94, 0.005),
    # Burst 1 refuses two sends closer than 20 ms: with 1 ms of lag no pacer can catch up, so less.
    ("bucket", 3000, 0.88, 0.005), ("bucket", 0, 0.88, 0.005),
])
def test_aimd_holds_one_second_limiters_near_their_limit_with_few_429s(
    shape: str, per_minute: int, share: float, most_429s: float,
) -> None:
    accepted, refused, pace = simulate(LIMITERS[shape](), per_minute=per_minute, seconds=120, jitter_s=0.001,
                                       lag_s=0.001)
    assert accepted / 120 >= share * 50
    assert refused <= most_429s * (accepted + refused)
    assert pace <= 50 * (1.1 if per_minute == 0 else 0.985)  # learnt: probing a little above, now and then


def send_times(rate: AimdRate, clock: SimClock, n: int) -> list[float]:
    """When ``n`` sends in a row get through ``rate``."""

    async def go() -> list[float]:
        out = []
        for _ in range(n):
            await rate.take()
            out.append(clock())
        return out

    return asyncio.run(go())


def test_a_pause_saves_up_no_catch_up_for_after_it() -> None:
    rate, clock = aimd(3000)
    send_times(rate, clock, 1)
    rate.hold(0.5)  # everyone paused after a 429
    sent = send_times(rate, clock, 5)
    assert sent[0] >= 1000.5  # not before the pause ends
    assert all(b - a >= 1 / 50 for a, b in zip(sent, sent[1:]))  # and then at the pace, no burst


def test_idle_time_is_not_caught_up() -> None:
    rate, clock = aimd(3000)
    clock.t += 5.0  # nothing to send for a while (a slow start, an empty queue)
    sent = send_times(rate, clock, 4)
    assert all(b - a >= 1 / 50 for a, b in zip(sent, sent[1:]))  # the first sends are spaced, not a burst


def test_a_limit_learnt_low_from_429s_is_probed_back_up_within_seconds() -> None:
    """The first limit read off a 429 with nothing known is what came back clean in the last
    second, which lags a fast-growing pace: against a bucket of 50/s it was learnt at ~23/s and,
    probed at 1 %/s after 10 s of quiet, took most of a 4,500-item run to climb back (t3xbu 50 %)."""
    rate, clock = aimd(0)
    for _ in range(12):  # 12 clean answers in the last second, nothing paced
        clock.t += 0.08
        rate.recover()
    rate.slow_down()  # nothing known: the pace starts from what came back
    clock.t += AimdRate.DECREASE_EVERY_S + 0.01
    rate.slow_down()  # the next 429 sets the limit
    assert rate.learned_from == "429s" and rate.limit is not None
    learnt = rate.limit
    for _ in range(20 * 50):  # 20 s of clean answers at 50 a second
        clock.t += 0.02
        rate.recover()
    assert rate.rate is not None and rate.rate >= 1.5 * learnt * 0.985


def test_aimd_with_nothing_known_after_one_429_grows_no_further_than_what_comes_back() -> None:
    """One 429 and then minutes of clean answers (a burst limit, or a 429 from a proxy): the pace
    must stay near what is answered, not grow ×4 a second to infinity (it overflowed after ~8.5 min)."""
    rate, clock = aimd(0)
    for _ in range(20):  # 20 answers a second before the 429
        rate.recover()
        clock.t += 0.05
    rate.slow_down()
    assert rate.limit is None and rate.rate is not None

    async def go() -> None:
        for _ in range(10 * 60 * 20):  # ten minutes at 20 answers a second
            await rate.take()
            rate.recover()
            clock.t += 0.05

    asyncio.run(go())
    assert rate.rate is not None and rate.rate <= 2 * 21
