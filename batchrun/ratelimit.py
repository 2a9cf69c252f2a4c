"""How fast a run may send: adaptive concurrency with slow start and a shared pause.

A run opens with a few requests in flight and adds one per clean answer (slow
start, then +1/window per answer once it has been told to slow down). A 429
halves the window (at most once per second, so one burst is one decrease) and
pauses all dispatch until its ``Retry-After`` has passed; waiters then re-enter
a few at a time, bounded by the halved window — no thundering herd.
``limit`` (the spec's concurrency) is a hard cap throughout.
"""

from __future__ import annotations

import asyncio
import random
import time

DEFAULT_PAUSE_S = 1.0
DECREASE_EVERY_S = 1.0


class AdaptiveConcurrency:
    """A semaphore whose size adapts to how the provider answers."""

    def __init__(self, limit: int, *, initial: int = 4, seed: int | None = None) -> None:
        self.limit = limit
        self.window = float(max(1, min(initial, limit)))
        self.threshold = float(limit)  # slow start until the window reaches this
        self.in_flight = 0
        self.paused_until = 0.0
        self.rate_limited = 0
        self._last_decrease = 0.0
        self._cond = asyncio.Condition()
        self._rng = random.Random(seed)

    @property
    def allowed(self) -> int:
        return int(self.window)

    def paused_for(self) -> float:
        return max(0.0, self.paused_until - time.monotonic())

    async def acquire(self) -> float:
        """Wait for a slot; return the seconds spent waiting."""
        started = time.monotonic()
        async with self._cond:
            while True:
                delay = self.paused_until - time.monotonic()
                if delay > 0:
                    # Spread the wake-ups so a pause does not end in one burst.
                    jitter = self._rng.uniform(0.0, min(0.5, 0.1 + delay * 0.1))
                    try:
                        await asyncio.wait_for(self._cond.wait(), delay + jitter)
                    except TimeoutError:
                        pass
                    continue
                if self.in_flight < self.allowed:
                    self.in_flight += 1
                    return time.monotonic() - started
                await self._cond.wait()

    async def release(self) -> None:
        async with self._cond:
            self.in_flight -= 1
            free = self.allowed - self.in_flight
            if free > 0:
                self._cond.notify(free)

    def on_success(self) -> None:
        if self.window < self.threshold:
            self.window = min(float(self.limit), self.window + 1.0)
        else:
            self.window = min(float(self.limit), self.window + 1.0 / self.window)

    def on_rate_limited(self, retry_after: float | None) -> None:
        """A 429: halve the window (once per burst) and pause everyone."""
        now = time.monotonic()
        self.rate_limited += 1
        if now - self._last_decrease >= DECREASE_EVERY_S:
            self.window = max(1.0, self.window / 2.0)
            self.threshold = self.window
            self._last_decrease = now
        pause = retry_after if retry_after is not None else DEFAULT_PAUSE_S
        self.paused_until = max(self.paused_until, now + pause)
