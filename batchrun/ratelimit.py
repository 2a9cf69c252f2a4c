"""How fast a run may send: adaptive concurrency with slow start and a shared pause, send pacing.

A run opens with a few requests in flight and adds one per clean answer (slow
start). Once ``PROBE_ANSWERS`` answers have come back clean (key, model and
endpoint work) and nothing has been rate limited, it opens to the full
concurrency, or to the provider's ``remaining-requests`` header if lower, in
even steps over one answer's latency: requests sent as one burst come back as
one burst, and the loop then idles while the next burst is out.

A 429 pauses all dispatch until its ``Retry-After`` has passed; waiters then
re-enter a few at a time — no thundering herd. In a run nothing paces yet it
also halves the window (at most once per second, so one burst is one
decrease), which then grows by +1/window per clean answer; a paced run keeps
its window and slows its pace instead (:class:`AimdRate`). ``limit`` (the
spec's concurrency) is a hard cap throughout.

Within the window, :class:`SendPacer` spreads sends so that a run against a
steady latency does not fall into lock-step; :class:`AimdRate` paces requests
(``rpm``, or a limit it learns), :class:`TokenBucket` tokens (``tpm``), and
:class:`RequestWindow` holds ``rpm`` per second.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

DEFAULT_PAUSE_S = 1.0
PROBE_ANSWERS = 4  # clean answers before slow start opens to the cap
DECREASE_EVERY_S = 1.0
OPEN_STEP_S = 0.005  # how often the window grows while it opens
# Sends the pacer lets go at once, at the least. Below it, answers that happen to come
# back together (latencies vary) would wait: at concurrency 1-20 with exponential
# latencies a burst of 1 cost 5-17% of the throughput in a simulation, 8 costs < 1%.
MIN_PACE_BURST = 8.0


class AdaptiveConcurrency:
    """A semaphore whose size adapts to how the provider answers.

    :meth:`release` is synchronous so a slot can be handed back from anywhere,
    e.g. by the ledger writer once a result is committed.
    """

    def __init__(self, limit: int, *, initial: int = 4, seed: int | None = None) -> None:
        self.limit = limit
        self.window = float(max(1, min(initial, limit)))
        self.threshold = float(limit)  # slow start until the window reaches this
        self.in_flight = 0
        self.paused_until = 0.0
        self.rate_limited = 0
        self.clean_answers = 0
        self._last_decrease = 0.0
        self._opening: asyncio.TimerHandle | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._rng = random.Random(seed)
        self._stopped = asyncio.Event()

    @property
    def allowed(self) -> int:
        return int(self.window)

    def paused_for(self) -> float:
        return max(0.0, self.paused_until - time.monotonic())

    def stop(self) -> None:
        """Wake every waiter: :meth:`acquire` returns False from now on."""
        self._stopped.set()
        self._stop_opening()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def acquire(self) -> bool:
        """Wait for a slot (and for any pause to end); False if the run is stopping."""
        while True:
            if self._stopped.is_set():
                return False
            delay = self.paused_until - time.monotonic()
            if delay > 0:
                # Spread the wake-ups so a pause does not end in one burst.
                try:
                    await asyncio.wait_for(
                        self._stopped.wait(), delay + self._rng.uniform(0.0, min(0.5, 0.1 + delay * 0.1))
                    )
                except TimeoutError:
                    pass
                continue
            if self.in_flight < self.allowed:
                self.in_flight += 1
                return True
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake()  # pass the wake-up on
                raise

    def release(self, n: int = 1) -> None:
        self.in_flight -= n
        self._wake()

    def set_limit(self, limit: int) -> None:
        """A new hard cap (a worker shares its concurrency among its jobs); requests above it finish first."""
        self.limit = max(1, limit)
        self.window = min(self.window, float(self.limit))
        self.threshold = min(self.threshold, float(self.limit))
        self._wake()

    def _wake(self) -> None:
        free = self.allowed - self.in_flight
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    def on_success(self, remaining_requests: int | None = None, latency_s: float = 0.0) -> None:
        """A clean answer that took ``latency_s``; ``remaining_requests`` is what the provider's
        rate-limit header says is left."""
        self.clean_answers += 1
        if self.window < self.threshold:
            if self.clean_answers >= PROBE_ANSWERS and not self.rate_limited:
                if self._opening is None:
                    target = self.threshold if remaining_requests is None else min(self.threshold, remaining_requests)
                    self._open_to(float(target), latency_s)
            else:
                self.window = min(float(self.limit), self.window + 1.0)
        else:
            self.window = min(float(self.limit), self.window + 1.0 / self.window)
        self._wake()

    def _open_to(self, target: float, over_s: float) -> None:
        """Grow the window to ``target`` in even steps over ``over_s`` seconds."""
        steps = int(over_s / OPEN_STEP_S)
        if target <= self.window + 1.0 or steps <= 1:
            self.window = max(self.window + 1.0, min(target, float(self.limit)))
            return
        step = (target - self.window) / steps

        def grow() -> None:
            self._opening = None
            if self.rate_limited or self._stopped.is_set():
                return
            self.window = min(target, float(self.limit), self.window + step)
            self._wake()
            if self.window < min(target, float(self.limit)):
                self._opening = loop.call_later(OPEN_STEP_S, grow)

        loop = asyncio.get_running_loop()
        self._opening = loop.call_later(OPEN_STEP_S, grow)

    def _stop_opening(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None

    def pause(self, seconds: float) -> None:
        """Send nothing for ``seconds`` (the provider said its budget resets then)."""
        self.paused_until = max(self.paused_until, time.monotonic() + seconds)

    def on_rate_limited(self, retry_after: float | None, *, shrink: bool = True) -> None:
        """A 429: halve the window (once per burst, unless not ``shrink``: a pace is what went over) and
        pause everyone."""
        now = time.monotonic()
        self.rate_limited += 1
        if shrink:
            self._stop_opening()
        if shrink and now - self._last_decrease >= DECREASE_EVERY_S:
            self.window = max(1.0, self.window / 2.0)
            self.threshold = self.window
            self._last_decrease = now
        pause = retry_after if retry_after is not None else DEFAULT_PAUSE_S
        self.paused_until = max(self.paused_until, now + pause)


class SendPacer:
    """Spreads sends out at up to ``gain`` times the rate the concurrency can sustain.

    Against a steady latency, requests sent together come back together: their
    answers are parsed and committed as one clump, their slots come back as one
    clump, and they go out again together. Left alone the clumps merge until the
    whole concurrency moves in lock-step, and every round trip then also waits
    for a clump to be processed (bench/RESULTS.md, T2). Holding sends to at most
    ``gain × concurrency / mean latency`` per second (Little's law: the most that
    ``concurrency`` slots can carry) never slows a steady run, but a clump leaves
    spread over that pace instead of at once. Up to ``burst`` sends go without a
    wait. Virtual scheduling (GCRA): no lock and no task per waiter.
    """

    def __init__(self, *, gain: float = 1.2, burst_fraction: float = 0.05) -> None:
        self.gain = gain
        self.burst_fraction = burst_fraction
        self.interval = 0.0  # seconds between sends at the pace; 0: not pacing (no latency known yet)
        self.burst = 1.0
        self._next = 0.0  # when the next send is due at the pace

    def follow(self, latencies: Sequence[float], concurrency: int, *, recent: int = 50) -> None:
        """Pace by the latest answers' latencies (oldest first).

        The mean of the latest ``4 × concurrency`` sets the pace, or the mean of the
        latest ``recent`` when that is lower: a provider that speeds up is followed at
        once, one that slows down over a few round trips (meanwhile the pace is only
        looser than it need be, never tighter).
        """
        if not latencies:
            return
        window = latencies[-4 * max(1, concurrency):]
        latest = latencies[-recent:]
        self.set_pace(concurrency, min(sum(window) / len(window), sum(latest) / len(latest)))

    def set_pace(self, concurrency: int, mean_latency_s: float) -> None:
        """Pace for ``concurrency`` slots whose requests take ``mean_latency_s`` on average."""
        concurrency = max(1, concurrency)
        interval = max(0.0, mean_latency_s) / (concurrency * self.gain)
        now = time.monotonic()
        if self._next > now and self.interval > 0.0:  # sends already spaced out wait at the new pace
            self._next = now + (self._next - now) * interval / self.interval
        self.interval = interval
        self.burst = max(MIN_PACE_BURST, concurrency * self.burst_fraction)

    def delay(self) -> float:
        """Seconds the next send should wait (0 for most); counts the send."""
        if self.interval <= 0.0:
            return 0.0
        now = time.monotonic()
        due = max(self._next, now)
        self._next = due + self.interval
        return max(0.0, due - (self.burst - 1.0) * self.interval - now)


class TokenBucket:
    """A budget per minute (requests or tokens), paced smoothly.

    Pacing is smooth rather than bursty because providers may enforce their
    limits over windows shorter than a minute: the bucket holds at most
    ``burst_seconds`` worth of budget, and runs at ``safety`` × the configured
    rate so jitter on the way does not push a window over. A take larger than
    the bucket waits for a full bucket and leaves it in debt, so a big request
    is never starved. :meth:`settle` corrects an estimate once the real cost
    is known (tokens from ``usage``).
    """

    def __init__(self, per_minute: float, *, burst_seconds: float = 0.05, safety: float = 0.985) -> None:
        self.per_minute = per_minute
        self.full_rate = per_minute / 60.0 * safety
        self.rate = self.full_rate
        self.capacity = max(1.0, self.rate * burst_seconds)
        self.tokens = self.capacity
        self._updated = time.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self._updated) * self.rate)
        self._updated = now

    async def take(self, amount: float = 1.0) -> None:
        """Wait until ``amount`` may be spent, then spend it (first come, first served)."""
        async with self._lock:
            while True:
                self._refill()
                need = min(amount, self.capacity)
                if self.tokens >= need:
                    self.tokens -= amount
                    return
                # Short naps: a settle() may refund budget while we wait.
                await asyncio.sleep(min(0.05, (need - self.tokens) / self.rate))

    def settle(self, estimated: float, actual: float) -> None:
        """The request cost ``actual``, not ``estimated``: give back or charge the difference."""
        self._refill()
        self.tokens = min(self.capacity, self.tokens + estimated - actual)

    def slow_down(self) -> None:
        """A 429 despite pacing: the real limit is lower than configured, or shared. Back off."""
        self.rate = max(self.full_rate * 0.25, self.rate * 0.8)

    def recover(self) -> None:
        if self.rate < self.full_rate:
            self.rate = min(self.full_rate, self.rate * 1.01)


class RequestWindow:
    """At most ``count`` requests in any ``window_s`` seconds: the per-second form of a
    per-minute request limit.

    A token bucket bounds a window of ``T`` seconds only to ``rate × T +
    capacity``, and the capacity that lets it catch up after a late wake-up is
    what pushes a sliding one-second window one request over (bench T3s). This
    keeps the last ``count`` send times and holds a request until the oldest is
    ``window_s`` old. For a limit of ``rpm`` per minute it allows ``rpm / 60``
    per second over a second plus ``margin_s``, so jitter on the way to the
    provider does not bunch them into a shorter span.
    """

    def __init__(self, per_minute: float, *, margin_s: float = 0.01) -> None:
        per_second = per_minute / 60.0
        self.count = max(1, int(per_second))
        self.window_s = self.count / per_second + margin_s
        self._sent: deque[float] = deque(maxlen=self.count)
        self._lock = asyncio.Lock()

    async def admit(self) -> None:
        """Wait until one more request fits the window, and count it."""
        async with self._lock:
            if len(self._sent) == self.count:
                wait = self._sent[0] + self.window_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            self._sent.append(time.monotonic())


class AimdRate:
    """The request pace: additive increase, multiplicative decrease, towards a known or learned limit.

    ``per_minute`` is the user's ``rpm`` (a hard cap, paced at ``safety`` × it),
    or 0: the limit is unknown and learned. Until something says what the limit
    is, requests are not paced here (concurrency and slow start hold them).
    It is learned from

    - the provider's headers (:meth:`learn`): ``limit`` requests per minute, unless
      their ``reset`` shows the budget refilling faster than a per-minute limit can
      (a per-second window advertised as its own count): then ``limit`` per the
      longest ``reset`` seen;
    - 429s (:meth:`slow_down`): the pace a 429 came at is more than the server takes,
      so the learned limit is held just under it (and kept when nothing contradicts it).

    A 429 multiplies the pace by ``DECREASE`` (once per ``DECREASE_EVERY_S``: one
    burst, one decrease). Clean answers (:meth:`recover`) add ``RECOVER_PER_S`` of
    the limit per second back to ``safety`` × the limit — a 429 costs a second or
    two at a slightly lower pace, not the rest of the run. With no limit known
    yet, a 429 sets the pace to the answers of the last second and it grows
    ×``GROW_PER_S`` a second until the next 429 says where the limit is. 429s
    more often than one in ``QUIET_SENDS`` sends also lower the limit paced
    towards by a step (``safety``) each, even a configured one (a small bucket
    may need more room than its own spacing); ``HOLD_S`` without a 429 and it
    is probed up by ``PROBE_PER_S`` a second (never past ``rpm``), so a limit
    that was raised, or lowered for jitter, is found again. A limit only 429s
    ever gave (no ``rpm``, no header) starts low, so it is probed sooner and
    faster (``LEARNT_HOLD_S``, ``PROBE_LEARNT_PER_S``).

    A token bucket of burst 1 is held near 80 %, not 95 %, on a shared machine:
    it refuses two requests that *reach* it closer than its spacing, and a
    request reaches it 0.2-8 ms after it was released here (aiohttp's write
    task, the server's own scheduling), so 95 % of the limit (1 ms of margin
    on 20 ms) draws 5-10 % 429s at any steady pace (bench/RESULTS.md, t3b).

    Sends are spaced at the pace (GCRA, ``CATCH_UP_S`` of catch-up after a late
    wake-up) and no ``n = int(limit)`` of them go within ``n / limit`` seconds
    (plus ``WINDOW_MARGIN_S``): catching up would otherwise put one request too
    many into a provider's one-second window (bench/RESULTS.md, T3s).
    """

    DECREASE = 0.85
    DECREASE_EVERY_S = 1.0
    RECOVER_PER_S = 0.1
    HOLD_S = 10.0
    GROW_PER_S = 4.0  # with no limit known after a 429: ×4 a second until the next 429 (at most 2× the answers)
    PROBE_PER_S = 0.01
    # A limit learnt from 429s alone may be far under the real one (the first is read off answers that lag a
    # fast-growing pace): probed up faster (bench/RESULTS.md, t3xbu).
    PROBE_LEARNT_PER_S = 0.05
    LEARNT_HOLD_S = 3.0  # ... and after a shorter quiet spell
    QUIET_SENDS = 250  # a 429 within this many sends of the last lowers the limit (~0.4% of requests)
    MIN_RATE = 0.05  # per second: one request every 20 s at the least
    CATCH_UP_S = 0.05  # sends a late wake-up may make up for (the 50 ms of burst TokenBucket had)
    WINDOW_MARGIN_S = 0.01  # added to the window of the int(limit) check (jitter on the way)
    HEADER_CHECKS = 200  # answers whose headers are checked against a per-minute reading

    def __init__(
        self, per_minute: float = 0.0, *, safety: float = 0.985,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.per_minute = per_minute
        self.safety = safety
        self.cap = per_minute / 60.0 if per_minute > 0 else None  # the user's limit, per second: never above
        self.limit = self.cap  # the limit paced towards, per second: configured or learned (None: unknown)
        self.learned_from: str | None = "configured" if self.cap else None
        self.rate: float | None = self.cap * safety if self.cap else None  # the pace, per second
        self.rate_limited = 0
        self._clock = clock
        self._sleep = sleep
        now = clock()
        self._tat = now  # GCRA: when the next send is due at the pace
        self._updated = now
        self._last_decrease = -math.inf
        self._last_429 = -math.inf
        self._answers: deque[float] = deque()  # clean answers in the last second (their times)
        self._sent: deque[float] = deque(maxlen=4096)
        self._longest_reset = 0.0
        self._catch_up_back = -math.inf  # when catching up after a late wake-up is allowed again
        self._catch_up_off_s = self.HOLD_S
        self._header_checks = 0
        self._short_window = False
        self._headers_said = False  # a header gave the limit (then it is probed up slowly, if at all)
        self._lock = asyncio.Lock()

    @property
    def per_second(self) -> float | None:
        """The pace now (None: not pacing)."""
        return self.rate

    async def take(self, amount: float = 1.0) -> None:
        """Wait until one more request may go at the pace, and count it (first come, first served)."""
        if self.rate is None and not self._lock.locked():  # not pacing: no lock to take (T1/T2's hot path)
            self._sent.append(self._clock())
            return
        async with self._lock:
            while self.rate is not None:
                now = self._clock()
                interval = 1.0 / self.rate
                # CATCH_UP_S (at least one interval) of catch-up after a late wake-up, none for a while after frequent
                # 429s (a small bucket refuses two sends closer than its spacing; see slow_down).
                slack = max(interval, self.CATCH_UP_S) if now >= self._catch_up_back else 0.0
                if not self._sent or now - self._sent[-1] > slack + interval:
                    self._tat = max(self._tat, now)  # idle, not late: nothing to catch up
                due = max(self._tat, now - slack)
                limit = self.limit or self.rate
                n = max(1, int(limit))
                if len(self._sent) >= n:
                    due = max(due, self._sent[-n] + n / limit + self.WINDOW_MARGIN_S)
                wait = due - now
                if wait <= 0:
                    self._tat = max(self._tat, now - slack) + interval
                    break
                # Short naps: a 429 or a header may change the pace meanwhile.
                await self._sleep(min(wait, 0.05))
            self._sent.append(self._clock())

    def settle(self, estimated: float, actual: float) -> None:
        """Requests cost one each: nothing to correct."""

    def hold(self, seconds: float) -> None:
        """Everyone pauses ``seconds``: the pace starts afresh after it, with no catch-up saved up
        meanwhile (a small bucket would refuse the sends that came out together)."""
        self._tat = max(self._tat, self._clock() + seconds)

    def slow_down(self) -> None:
        """A 429: the pace was more than the provider takes."""
        now = self._clock()
        self.rate_limited += 1
        self._last_429 = now
        if now - self._last_decrease < self.DECREASE_EVERY_S:
            return
        since_last, self._last_decrease = now - self._last_decrease, now
        self._updated = now
        # 429s more often than one in QUIET_SENDS: more than jitter at a window's edge.
        frequent = self.rate is not None and since_last * self.rate < self.QUIET_SENDS
        blame_catch_up = frequent and 0.0 <= now - self._catch_up_back < self.HOLD_S
        if blame_catch_up:
            # Frequent again soon after catching up came back: a small bucket (it refuses two
            # sends closer than its spacing). Catch up no more for twice as long; the limit is not to blame.
            self._catch_up_off_s *= 2.0
        if frequent:
            self._catch_up_back = now + self._catch_up_off_s
        if self.rate is None:
            # Nothing known: start from what came back clean in the last second, and grow from there.
            self._trim(now)
            self.rate = max(1.0, float(len(self._answers)))
            return
        if self.limit is None:
            # The first word on the limit: the pace this 429 came at, or what came back clean in
            # the last second if that was much less (the pace grew fast past the limit before
            # a window's 429 said so).
            self._trim(now)
            self.limit = min(self.rate, max(float(len(self._answers)), self.rate * 0.5))
        elif frequent and not blame_catch_up:
            # Frequent 429s: the limit is lower than paced for, or a small bucket needs more room
            # than the limit's own spacing. Each lowers the limit paced towards by a step at most,
            # never below the pace it came at; a rare one is what the decrease alone is for.
            # Quiet spells probe it back up (never past the cap).
            self.limit = min(self.limit, max(self.rate, self.limit * self.safety))
        if self.cap is None:
            self.learned_from = "429s"
        self.rate = max(self.MIN_RATE, min(self.rate * self.DECREASE, self.limit * self.safety))

    def recover(self) -> None:
        """A clean answer: grow the pace back towards the limit (or find one)."""
        now = self._clock()
        self._answers.append(now)
        self._trim(now)
        dt, self._updated = now - self._updated, now
        if self.rate is None:
            return
        if self.limit is None:  # after a 429 with nothing known: grow fast until the next one,
            # but never past twice what comes back (no 429 for minutes must not grow it without end)
            self.rate = min(self.rate * self.GROW_PER_S ** min(dt, 1.0), max(1.0, 2.0 * len(self._answers)))
            return
        target = self.limit * self.safety
        if self.rate < target:
            self.rate = min(target, self.rate + self.limit * self.RECOVER_PER_S * dt)
        elif now - self._last_429 > self._hold_s() and (self.cap is None or self.limit < self.cap):
            probe = self.PROBE_LEARNT_PER_S if self._learnt_from_429s_alone() else self.PROBE_PER_S
            self.rate *= (1.0 + probe) ** min(dt, 1.0)
            self.limit = max(self.limit, self.rate / self.safety)
            if self.cap is not None and self.limit > self.cap:
                self.limit, self.rate = self.cap, self.cap * self.safety

    def _hold_s(self) -> float:
        """How long without a 429 before the limit is probed up."""
        return self.LEARNT_HOLD_S if self._learnt_from_429s_alone() else self.HOLD_S

    def _learnt_from_429s_alone(self) -> bool:
        """The limit paced towards is the 429s' word only: no ``rpm``, no header ever said one."""
        return self.learned_from == "429s" and not self._headers_said
    def learn(self, limit: int | None, remaining: int | None, reset_s: float | None) -> None:
        """What a provider's request headers said: ``limit`` (per minute, as OpenAI and Anthropic
        mean it), ``remaining`` and ``reset_s`` (seconds until the budget is whole again)."""
        if self.cap is not None or limit is None or limit <= 0:
            return
        self._headers_said = True
        if reset_s is not None and remaining is not None and remaining < limit:
            self._longest_reset = max(self._longest_reset, reset_s)
        per_second = limit / 60.0
        if remaining is not None and reset_s is not None and self._header_checks < self.HEADER_CHECKS:
            # Read per minute, ``remaining`` is at most ``limit`` less what this run sent in the
            # last minute, or (a bucket refilled at limit/60 a second, as OpenAI's) the budget is
            # whole again only (limit - remaining) × 60 / limit seconds from now. Far more left
            # and a reset far sooner: the count is per a shorter window.
            self._header_checks += 1
            now = self._clock()
            sent = sum(1 for t in self._sent if t > now - 60.0)
            if sent >= 10 and remaining > limit - sent / 2 and reset_s < 0.5 * (limit - remaining) / per_second:
                self._short_window = True
        if self._short_window:
            if self._longest_reset <= 0:
                return  # no way to tell the window: the 429s will say
            per_second = limit / min(60.0, self._longest_reset)
        if self.learned_from == "429s" and self.limit is not None and self.limit < per_second:
            return  # the server's 429s said less than its headers: keep what they said
        if self.limit is None or self.learned_from == "headers" and abs(self.limit - per_second) > 1e-9:
            self.limit = per_second
            self.learned_from = "headers"
            target = per_second * self.safety
            self.rate = target if self.rate is None else min(self.rate, target)
            self._updated = self._clock()

    def _trim(self, now: float) -> None:
        while self._answers and self._answers[0] <= now - 1.0:
            self._answers.popleft()


class SharedTokenBucket:
    """A job-wide budget per minute kept in the ledger, shared by every process working the job.

    This process reserves the budget in small chunks (``chunk_seconds`` of the
    job's rate per database round trip) through ``reserve``, which takes an
    amount from the job's bucket row and says how long until all of it is paid
    for (the row may go into debt: reservations queue up). Reserved budget is
    spent in order, each part once it is paid for, so the pace is smooth, not
    a burst per chunk. After a 429 each request costs this process more of the
    shared budget (``slow_down``), easing back as answers come back clean. Same
    interface as :class:`TokenBucket`.
    """

    def __init__(
        self,
        per_minute: float,
        reserve: Callable[[float], Awaitable[float]],
        *,
        chunk_seconds: float = 0.2,
        burst_seconds: float = 0.05,
        safety: float = 0.985,
    ) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60.0 * safety  # per second, job-wide
        self.chunk = max(1.0, self.rate * chunk_seconds)
        self.capacity = max(1.0, self.rate * burst_seconds)  # the bucket row's size: the job's burst
        self.local = 0.0  # reserved, not spent yet
        self.factor = 1.0
        self._paid_until = 0.0  # monotonic time by which everything reserved so far is paid for
        self._reserve = reserve
        self._lock = asyncio.Lock()

    async def take(self, amount: float = 1.0) -> None:
        """Wait until ``amount`` may be spent, then spend it (first come, first served)."""
        cost = amount * self.factor
        async with self._lock:
            if self.local < cost:
                need = max(self.chunk, cost - self.local)
                wait = await self._reserve(need)
                self._paid_until = time.monotonic() + wait
                self.local += need
            # What is left behind this take is paid for last, at the job's rate.
            self.local -= cost
            delay = self._paid_until - max(0.0, self.local) / self.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    def settle(self, estimated: float, actual: float) -> None:
        """The request cost ``actual``, not ``estimated``: the difference is kept (or owed) locally."""
        self.local += (estimated - actual) * self.factor

    def slow_down(self) -> None:
        self.factor = min(4.0, self.factor * 1.25)

    def recover(self) -> None:
        if self.factor > 1.0:
            self.factor = max(1.0, self.factor / 1.01)


def parse_reset(value: str | None) -> float | None:
    """OpenAI's ``x-ratelimit-reset-*`` durations (``"1s"``, ``"6m0s"``, ``"20ms"``) in seconds."""
    if not value:
        return None
    total, number = 0.0, ""
    i = 0
    try:
        while i < len(value):
            ch = value[i]
            if ch.isdigit() or ch == ".":
                number += ch
            elif value.startswith("ms", i):
                total += float(number) / 1000.0
                number, i = "", i + 1
            elif ch in "hms":
                total += float(number) * {"h": 3600.0, "m": 60.0, "s": 1.0}[ch]
                number = ""
            else:
                return None
            i += 1
        if number:
            total += float(number)
    except ValueError:
        return None
    return total
