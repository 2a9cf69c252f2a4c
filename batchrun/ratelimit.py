"""How fast a run may send: adaptive concurrency with slow start and a shared pause, send pacing.

A run opens with a few requests in flight and adds one per clean answer (slow
start). Once ``PROBE_ANSWERS`` answers have come back clean (key, model and
endpoint work) and nothing has been rate limited, it opens to the full
concurrency, or to the provider's ``remaining-requests`` header if lower, in
even steps over one answer's latency: requests sent as one burst come back as
one burst, and the loop then idles while the next burst is out.

A 429 halves the window (at most once per second, so one burst is one
decrease) and pauses all dispatch until its ``Retry-After`` has passed; waiters
then re-enter a few at a time, bounded by the halved window — no thundering
herd. From there the window grows by +1/window per clean answer.
``limit`` (the spec's concurrency) is a hard cap throughout.

Within the window, :class:`SendPacer` spreads sends so that a run against a
steady latency does not fall into lock-step; :class:`TokenBucket` and
:class:`RequestWindow` keep ``rpm``/``tpm``.
"""

from __future__ import annotations

import asyncio
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

    def on_rate_limited(self, retry_after: float | None) -> None:
        """A 429: halve the window (once per burst) and pause everyone."""
        now = time.monotonic()
        self.rate_limited += 1
        self._stop_opening()
        if now - self._last_decrease >= DECREASE_EVERY_S:
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
