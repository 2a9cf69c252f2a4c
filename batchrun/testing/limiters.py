"""The fake server's request limiters, one per shape a provider may enforce a per-minute limit in.

Each takes ``(limit, now, window_s)``: ``limit`` requests per minute, enforced over
``window_s`` seconds, scaled (``window_s=1``: at most ``limit/60`` per second), with
``now`` the server's monotonic clock.

- ``sliding`` (:class:`SlidingWindow`): at most that many accepted in any ``window_s``;
- ``fixed`` (:class:`FixedWindow`): at most that many per window, windows back to back
  from the first request (a counter reset every ``window_s``);
- ``bucket`` (:class:`Bucket`): a token bucket refilled at ``limit/60`` per second,
  holding ``burst`` tokens (``burst=1``: requests at least ``60/limit`` s apart).

:meth:`take` accepts a request (0.0) or says how long until one would be;
:meth:`remaining` and :meth:`reset_s` feed the ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import collections
from typing import Literal, Protocol

MINUTE_S = 60.0
Shape = Literal["sliding", "fixed", "bucket"]


def allowance(rpm: int, window_s: float) -> int:
    """Requests allowed per window of ``window_s`` for a per-minute limit."""
    return int(rpm * window_s / MINUTE_S)


class Limiter(Protocol):
    def take(self, limit: int, now: float, window_s: float) -> float: ...

    def remaining(self, limit: int, now: float, window_s: float) -> int: ...

    def reset_s(self, limit: int, now: float, window_s: float) -> float: ...


class SlidingWindow:
    """The requests accepted in a sliding window."""

    def __init__(self) -> None:
        self._accepted: collections.deque[float] = collections.deque()

    def _trim(self, now: float, window_s: float) -> None:
        cutoff = now - window_s
        while self._accepted and self._accepted[0] <= cutoff:
            self._accepted.popleft()

    def take(self, limit: int, now: float, window_s: float = MINUTE_S) -> float:
        """Take a slot in the sliding window; returns 0.0 or the seconds until one frees."""
        self._trim(now, window_s)
        allowed = allowance(limit, window_s)
        if allowed <= 0:
            return window_s
        if len(self._accepted) < allowed:
            self._accepted.append(now)
            return 0.0
        # the slot frees when the entry `allowed` places from the end leaves the window
        return max(self._accepted[-allowed] + window_s - now, 0.001)

    def remaining(self, limit: int, now: float, window_s: float = MINUTE_S) -> int:
        """Slots free in the sliding window now."""
        self._trim(now, window_s)
        return max(allowance(limit, window_s) - len(self._accepted), 0)

    def reset_s(self, limit: int, now: float, window_s: float = MINUTE_S) -> float:
        """Seconds until the window is empty again (every slot free)."""
        return max(self._accepted[-1] + window_s - now, 0.0) if self._accepted else 0.0


class FixedWindow:
    """A counter of accepted requests, reset every ``window_s`` (windows back to back)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._used = 0

    def _roll(self, now: float, window_s: float) -> float:
        if self._start is None:
            self._start = now
        elif now >= self._start + window_s:
            self._start += (now - self._start) // window_s * window_s
            self._used = 0
        return self._start + window_s - now

    def take(self, limit: int, now: float, window_s: float = MINUTE_S) -> float:
        left = self._roll(now, window_s)
        if self._used < allowance(limit, window_s):
            self._used += 1
            return 0.0
        return max(left, 0.001)

    def remaining(self, limit: int, now: float, window_s: float = MINUTE_S) -> int:
        self._roll(now, window_s)
        return max(allowance(limit, window_s) - self._used, 0)

    def reset_s(self, limit: int, now: float, window_s: float = MINUTE_S) -> float:
        return self._roll(now, window_s)


class Bucket:
    """A token bucket refilled at ``limit/60`` per second, ``burst`` tokens deep (``window_s`` unused)."""

    def __init__(self, burst: float = 1.0) -> None:
        self.burst = max(1.0, burst)
        self._tokens = self.burst
        self._at: float | None = None

    def _fill(self, limit: int, now: float) -> float:
        rate = limit / MINUTE_S
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * rate)
        self._at = now
        return rate

    def take(self, limit: int, now: float, window_s: float = MINUTE_S) -> float:
        rate = self._fill(limit, now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return max((1.0 - self._tokens) / rate, 0.001) if rate > 0 else MINUTE_S

    def remaining(self, limit: int, now: float, window_s: float = MINUTE_S) -> int:
        self._fill(limit, now)
        return int(self._tokens)

    def reset_s(self, limit: int, now: float, window_s: float = MINUTE_S) -> float:
        rate = self._fill(limit, now)
        return (self.burst - self._tokens) / rate if rate > 0 else 0.0


def make_limiter(shape: Shape, burst: float = 1.0) -> Limiter:
    """A fresh limiter of ``shape``."""
    if shape == "fixed":
        return FixedWindow()
    if shape == "bucket":
        return Bucket(burst)
    return SlidingWindow()
