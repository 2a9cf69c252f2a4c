"""Tenure: a run's hold on its job lock and its items' leases, and so what it may still send.

A run sends an item only while both hold:

- the item is still leased to it under the claim it was claimed with: a heartbeat
  returns the items the run still holds, and one taken from it (its lease lapsed
  while the run was stalled, and it was swept) is *lost*, sent no more;
- its last confirmation (taking the lock at the start, then each heartbeat) still
  vouches for the lock and the leases: for ``vouched_for`` seconds from the clocks
  read *before* the ledger call that confirmed them, well inside the time after
  which another run may take them (the lock's staleness; half the lease for a
  worker's items). A run that stalled (SIGSTOP, a suspended laptop, a long outage)
  re-confirms before it sends again. Both clocks count: the monotonic one stops
  while a laptop sleeps, the wall clock may jump.

A lost lock (:class:`~batchrun.errors.LockLostError`, from a heartbeat or a claim)
stops the run; it is not asked for again. These are the fences of issue 14
(tests/integration/test_ledger_fences.py, tests/acceptance/test_stalls.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from batchrun.errors import LockLostError
from batchrun.ledger import ClaimedItem

log = logging.getLogger(__name__)


class Held(Protocol):
    """An item a run claimed and works: its claim, and whether it was taken from the run."""

    item: ClaimedItem
    lost: bool


def clocks() -> tuple[float, float]:
    """(monotonic, wall) now: what a confirmation is counted from."""
    return time.monotonic(), time.time()


class Tenure:
    """One run's tenure of its lock and leases (see the module docstring).

    ``renew`` is the run's heartbeat in the ledger (the items it still holds, by id: their
    claim; LockLostError if the lock is another run's), ``on_lost`` what the run does when
    its lock is lost (stop), ``beat_now`` asks the run's writer for a heartbeat at once.
    """

    def __init__(
        self,
        job_id: int,
        *,
        lock_stale_seconds: float,
        lease_seconds: float,
        renew: Callable[[], Awaitable[Mapping[int, int]]],
        on_lost: Callable[[LockLostError], None],
        beat_now: Callable[[], None],
    ) -> None:
        self.job_id = job_id
        self.vouched_for = 0.75 * min(lock_stale_seconds, lease_seconds / 2)
        self._renew = renew
        self._on_lost = on_lost
        self._beat_now = beat_now
        self._vouched_until = (0.0, 0.0)  # (monotonic, wall) ends of the last confirmation
        self._confirmation: asyncio.Future[None] | None = None
        self._stopped = False
        self.lock_lost = False
        self._working: dict[int, Held] = {}  # claimed items without an outcome yet, by id

    @property
    def wanted(self) -> bool:
        """Whether a task waits in :meth:`confirm` for a heartbeat."""
        return self._confirmation is not None

    def hold(self, work: Held) -> None:
        """Track a claimed item until its outcome is queued. One this run held before under an
        earlier claim (swept from it while it stalled, then claimed again) is that claim's no more."""
        earlier = self._working.get(work.item.id)
        if earlier is not None:
            earlier.lost = True
        self._working[work.item.id] = work

    def settle(self, work: Held) -> None:
        """The item's outcome is queued: stop tracking it (unless a later claim of it is tracked)."""
        if self._working.get(work.item.id) is work:
            del self._working[work.item.id]

    def vouch(self, since: tuple[float, float]) -> None:
        """The lock and leases are confirmed as of ``since`` (taken before the ledger call that confirmed them)."""
        self._vouched_until = (since[0] + self.vouched_for, since[1] + self.vouched_for)

    def owns(self, work: Held) -> bool:
        """Whether this run may send ``work`` now: its item was not taken, and the last confirmation still holds."""
        mono, wall = self._vouched_until
        return not work.lost and time.monotonic() < mono and time.time() < wall

    async def confirm(self, work: Held) -> None:
        """Wait for a heartbeat that re-confirms the lock and leases (the writer makes it at once).

        A heartbeat already under way when this asked may have started before a stall,
        so its confirmation can be stale too: then one more is asked for.
        """
        for _ in range(3):
            if self._stopped or work.lost or self.owns(work):
                return
            if self._confirmation is None:
                self._confirmation = asyncio.get_running_loop().create_future()
                self._beat_now()
            await asyncio.shield(self._confirmation)

    def wake(self) -> None:
        """Wake every task waiting in :meth:`confirm` (after a heartbeat, or when the run stops)."""
        if self._confirmation is not None:
            if not self._confirmation.done():
                self._confirmation.set_result(None)
            self._confirmation = None

    def stop(self) -> None:
        """The run is stopping: every task waiting in :meth:`confirm`, and any that asks, goes on at once."""
        self._stopped = True
        self.wake()

    def lose(self, lost: LockLostError) -> None:
        """The lock is another run's: no heartbeat is made again, the run stops (``on_lost``)."""
        self.lock_lost = True
        self._on_lost(lost)

    async def renew(self) -> None:
        """The heartbeat: renew the lock (an exclusive run) and the leases; notice what this run no longer holds.

        Lost lock: :meth:`lose` (the run stops, exit 75, sending nothing more). Items whose
        lease was swept (a worker that stalled past it) are not sent again by this run.
        """
        started = clocks()
        try:
            held = await self._renew()
        except LockLostError as lost:
            self.lose(lost)  # the run stops: that wakes the waiters, and they stop
            return
        except BaseException:
            self.wake()
            raise
        self.vouch(started)
        taken = [w for item_id, w in self._working.items() if held.get(item_id) != w.item.claim and not w.lost]
        for work in taken:
            work.lost = True
        if taken:
            log.warning(
                "%d items were taken from this run (their lease lapsed while it was stalled, or the job was "
                "cancelled), e.g. %s; "
                "not sending them again", len(taken), taken[0].item.custom_id, extra={"job": self.job_id},
            )
        self.wake()
