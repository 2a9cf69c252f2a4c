"""Health: whether the provider is down, and when a request counts as hung.

- **Outage.** ``OUTAGE_AFTER_FAILURES`` retryable failures in a row, across
  items, mean the endpoint is down, not that these items are bad: the run
  pauses everyone (a pause that doubles at most once a second, up to
  ``OUTAGE_MAX_PAUSE_S``), stops charging attempts to the items, and past
  ``outage_seconds`` without a clean answer it stops (exit 75) with the items
  pending instead of failing them one by one. A run that never had a clean answer
  and cannot connect (refused, DNS, TLS: ``CONNECT_ERRORS``) is down from its first
  such failure and stops after ``connect_grace``, naming the error.
- **Refused.** Until its first answer, a run that sees the same client error
  (404, or a 400/422 with the same message) for ``REFUSED_AFTER_ITEMS`` items is
  sending something every request carries wrong (the model, the path, a
  parameter): it stops (exit 3) with the items pending, instead of paying one
  request per item to fail them all. Until it can tell, the refused items are
  held (not failed); once an answer comes back (or the run runs out of work)
  they fail as their own, so an item-specific 400 still costs one request.
- **Hang.** A non-streamed answer sends nothing until it is complete, so a
  hang looks like a slow answer until the total timeout. Once the run knows
  ``HANG_MIN_SAMPLES`` clean latencies (its own, and the job's earlier ones from
  the ledger), an attempt that takes ``hang_factor`` times their P99 (and at
  least ``hang_min_seconds``) is cut and retried: :attr:`Health.attempt_timeout`.
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from batchrun.errors import CONNECT_ERRORS, PermanentError, ProviderError, RetryableError
from batchrun.spec import RunSpec

OUTAGE_AFTER_FAILURES = 20  # failed attempts in a row, across items, that mean "the endpoint is down"
OUTAGE_MAX_PAUSE_S = 30.0
T = TypeVar("T")

HANG_MIN_SAMPLES = 50
HANG_ESTIMATE_EVERY = 50  # clean answers between two estimates of the attempt timeout
LATENCIES_KEPT = 2000
REFUSED_AFTER_ITEMS = 3  # different items refused the same way, before any answer: every request is wrong
REFUSED_STATUSES = frozenset({400, 404, 422})
REFUSED_HOLD_MAX = 32  # refused items held before any answer; past it the refusals are the items' own


@dataclass(frozen=True)
class Outage:
    """Every request has been failing: pause everyone ``pause_s``; ``stop_message`` once the run should stop."""

    pause_s: float
    stop_message: str | None = None


class Health:
    """The outage and hang watchers of one run (see the module docstring)."""

    def __init__(self, run: RunSpec, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._run = run
        self._clock = clock
        self.failures_in_row = 0
        self.last_clean = clock()
        self.answered = False  # this run has had a clean answer
        self.reached = False  # some request of this run got an HTTP answer (of any status)
        self._first_connect_error: float | None = None  # connect_grace counts from it
        self.last_error: RetryableError | None = None
        self._pause = 0.0
        self._pause_grown = 0.0
        self.latencies: deque[float] = deque(maxlen=LATENCIES_KEPT)  # clean answers' seconds, oldest first
        self._since_estimate = 0
        self.attempt_timeout = run.timeout

    def observe(self, error: ProviderError | None) -> Outage | None:
        """An attempt was answered cleanly (``error`` None) or failed; an :class:`Outage` while all fail.

        Every failure in an outage re-arms the shared pause, so probing a dead
        endpoint costs a few requests per pause, not a stream of them. Errors
        that are not retryable neither count toward an outage nor end one.
        """
        if error is None:
            self.failures_in_row = 0
            self.last_clean = self._clock()
            self._pause = 0.0
            self.answered = True
        elif isinstance(error, RetryableError):
            self.failures_in_row += 1
            self.last_error = error
        if error is not None and error.status_code is not None:
            self.reached = True
        # A run none of whose requests ever reached the server, and that cannot connect, is down from
        # its first failure (slow first answers on open connections are not "cannot connect").
        cannot_connect = (not self.answered and not self.reached and error is not None
                          and error.error_class in CONNECT_ERRORS)
        if cannot_connect and self._first_connect_error is None:
            self._first_connect_error = self._clock()
        if self.failures_in_row < OUTAGE_AFTER_FAILURES and not cannot_connect:
            return None
        now = self._clock()
        if now - self._pause_grown >= 1.0:
            self._pause = min(OUTAGE_MAX_PAUSE_S, max(0.5, self._pause * 2))
            self._pause_grown = now
        last = f": {self.last_error.message}" if self.last_error is not None else ""
        if cannot_connect and self._first_connect_error is not None and (
            now - self._first_connect_error > self._run.connect_grace
        ):
            return Outage(
                self._pause,
                f"nothing connected in {self._run.connect_grace:g} s ([run] connect_grace){last}; "
                "the items stay pending",
            )
        if now - self.last_clean > self._run.outage_seconds:
            return Outage(
                self._pause,
                f"no clean answer for {self._run.outage_seconds:g} s: every request failed "
                f"({self.failures_in_row} in a row{last}); the items stay pending",
            )
        return Outage(self._pause)

    def note_latency(self, seconds: float) -> None:
        """A clean answer took ``seconds``; now and then the attempt timeout is estimated afresh."""
        self.latencies.append(seconds)
        self._since_estimate += 1
        run = self._run
        if run.hang_factor <= 0 or len(self.latencies) < HANG_MIN_SAMPLES:
            return
        if self._since_estimate < HANG_ESTIMATE_EVERY:
            return
        self._since_estimate = 0
        ordered = sorted(self.latencies)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        self.attempt_timeout = min(run.timeout, max(run.hang_min_seconds, run.hang_factor * p99))



_REQUEST_IDS = re.compile(
    r"\b(?:req|request|msg|chatcmpl)_[A-Za-z0-9]{6,}\b"  # req_011C..., chatcmpl-like ids
    r"|\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"  # UUIDs
    r"|\b[0-9a-fA-F]{16,}\b"  # long hex ids
)


def _without_ids(message: str) -> str:
    """A refusal's message less the request ids some gateways put in every error (the same
    refusal then reads the same); other numbers stay (a prompt's token count is its own)."""
    return _REQUEST_IDS.sub("<id>", message)


class Refusals(Generic[T]):
    """The "every request is refused the same way" watcher of one run (see the module docstring).

    It holds the refused items (``T``: whatever the runner keeps per item) with their errors
    until it can tell: :meth:`verdict` (the same refusal for ``items`` different items), or
    :attr:`decided` (an answer came back, or too many different refusals: they are the items' own).
    """

    def __init__(self, items: int = REFUSED_AFTER_ITEMS, hold_max: int = REFUSED_HOLD_MAX) -> None:
        self.items = items
        self.hold_max = hold_max
        self.decided = False
        self._held: list[tuple[T, PermanentError]] = []
        self._seen: Counter[tuple[int | None, str]] = Counter()

    def hold(self, item: T, error: PermanentError) -> bool:
        """Whether to hold ``item`` instead of failing it: a refusal that could be every request's."""
        if self.decided or error.status_code not in REFUSED_STATUSES:
            return False
        if error.error_class != PermanentError.error_class:  # content_filter, truncated: the item's own answer
            return False
        self._held.append((item, error))
        self._seen[(error.status_code, _without_ids(error.message))] += 1
        if len(self._held) >= self.hold_max:
            self.decided = True
        return True

    def verdict(self) -> str | None:
        """The stop message once ``items`` items were refused the same way, else None."""
        if self.decided or not self._seen:
            return None
        (_, message), n = self._seen.most_common(1)[0]
        if n < self.items:
            return None
        return (f"the provider refused the first {n} requests the same way: {message}; every request carries "
                "what it refuses (the model, the URL path or a parameter): nothing failed, the items stay "
                "pending; resume with the right --model or --base-url (or correct it where it was given, "
                "spec or command line, and submit again: a new job)")

    def release(self) -> list[tuple[T, PermanentError]]:
        """The held items and their errors, no longer held."""
        held, self._held = self._held, []
        return held
