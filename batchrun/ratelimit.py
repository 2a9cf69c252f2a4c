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
from collections import deque

DEFAULT_PAUSE_S = 1.0
DECREASE_EVERY_S = 1.0


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
        self._last_decrease = 0.0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._rng = random.Random(seed)

    @property
    def allowed(self) -> int:
        return int(self.window)

    def paused_for(self) -> float:
        return max(0.0, self.paused_until - time.monotonic())

    async def acquire(self) -> None:
        """Wait for a slot (and for any pause to end)."""
        while True:
            delay = self.paused_until - time.monotonic()
            if delay > 0:
                # Spread the wake-ups so a pause does not end in one burst.
                await asyncio.sleep(delay + self._rng.uniform(0.0, min(0.5, 0.1 + delay * 0.1)))
                continue
            if self.in_flight < self.allowed:
                self.in_flight += 1
                return
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

    def _wake(self) -> None:
        free = self.allowed - self.in_flight
        while free > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    def on_success(self) -> None:
        if self.window < self.threshold:
            self.window = min(float(self.limit), self.window + 1.0)
        else:
            self.window = min(float(self.limit), self.window + 1.0 / self.window)
        self._wake()

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
