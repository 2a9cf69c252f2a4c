"""Tenure on the in-memory ledger: what a run may still send, as its heartbeats confirm it.

tests/unit/test_scheduler.py has a runner lose its lock mid-run; tests/acceptance/test_stalls.py
freezes real runs past their lock and leases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

import batchrun.tenure as tenure_module
from batchrun.errors import LedgerBusyError, LockLostError
from batchrun.ledger import ClaimedItem
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.tenure import Tenure, clocks
from batchrun.testing.ledger import InMemoryLedger

SPEC = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))
LEASE = 0.4  # the lock goes stale after 0.2 s: a confirmation vouches for 0.15 s


@dataclass
class Work:
    item: ClaimedItem
    lost: bool = False


@dataclass
class Run:
    """A run of a 4-item job holding its lock, and its tenure; ``beats_asked`` counts the heartbeats asked for."""

    ledger: InMemoryLedger
    job_id: int
    run_id: str
    tenure: Tenure = field(init=False)
    lost: list[LockLostError] = field(default_factory=list)
    beats_asked: int = 0

    def __post_init__(self) -> None:
        async def renew() -> dict[int, int]:
            return self.ledger.heartbeat(self.job_id, self.run_id, LEASE, exclusive=True)

        self.tenure = Tenure(
            self.job_id, lock_stale_seconds=LEASE / 2, lease_seconds=LEASE, renew=renew,
            on_lost=self.lost.append, beat_now=self.ask_beat,
        )

    def ask_beat(self) -> None:
        self.beats_asked += 1

    def claim(self, n: int, token: int) -> list[Work]:
        works = [Work(c) for c in self.ledger.claim(self.job_id, self.run_id, n, LEASE, exclusive=True, token=token)]
        for work in works:
            self.tenure.hold(work)
        return works


@pytest.fixture
def run() -> Iterator[Run]:
    ledger = InMemoryLedger()
    job_id = ledger.add_job(SPEC, ["{}"] * 4)
    yield Run(ledger, job_id, ledger.start_run(job_id, "submit", exclusive=True, stale_after=LEASE / 2))


def test_a_confirmation_vouches_for_a_while_on_both_clocks(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    (work,) = run.claim(1, token=1)
    assert run.tenure.vouched_for == pytest.approx(0.15)
    assert not run.tenure.owns(work)  # nothing confirmed yet
    run.tenure.vouch(clocks())
    assert run.tenure.owns(work)
    run.tenure.vouch((clocks()[0] - 0.2, clocks()[1]))  # the monotonic clock ran on past it
    assert not run.tenure.owns(work)
    run.tenure.vouch(clocks())
    wall = tenure_module.time.time
    monkeypatch.setattr(tenure_module.time, "time", lambda: wall() + 0.2)  # the wall clock jumped
    assert not run.tenure.owns(work)
    monkeypatch.undo()
    assert run.tenure.owns(work)
    work.lost = True
    assert not run.tenure.owns(work)


def test_a_heartbeat_vouches_from_before_it_was_made(run: Run) -> None:
    """A heartbeat that took long (a stall inside it) vouches from when it was asked, not answered."""
    (work,) = run.claim(1, token=1)

    async def slow_heartbeat() -> bool:
        async def renew() -> dict[int, int]:
            await asyncio.sleep(0.1)
            return run.ledger.heartbeat(run.job_id, run.run_id, LEASE, exclusive=True)

        slow = Tenure(run.job_id, lock_stale_seconds=LEASE / 2, lease_seconds=LEASE, renew=renew,
                      on_lost=run.lost.append, beat_now=run.ask_beat)
        slow.hold(work)
        await slow.renew()
        assert slow.owns(work)
        await asyncio.sleep(0.07)  # 0.17 s after it was asked, 0.07 s after it was answered
        return slow.owns(work)

    assert asyncio.run(slow_heartbeat()) is False


def test_a_heartbeat_marks_the_items_taken_from_the_run(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    first, swept = run.claim(1, token=1) + run.claim(1, token=2)
    run.ledger.heartbeat(run.job_id, run.run_id, -1, exclusive=True)  # the run stalled past its leases
    assert run.ledger.requeue_expired(run.job_id) == 2
    again = run.claim(1, token=3)[0]  # the first item, claimed afresh under a new claim
    assert again.item.id == first.item.id and first.lost  # the earlier claim of it is lost at once
    with caplog.at_level(logging.WARNING, logger="batchrun.tenure"):
        asyncio.run(run.tenure.renew())
    assert (first.lost, swept.lost, again.lost) == (True, True, False)
    assert [r.getMessage() for r in caplog.records] == [
        f"1 items were taken from this run (their lease lapsed while it was stalled, or the job was cancelled), "
        f"e.g. {swept.item.custom_id}; "
        "not sending them again"
    ]
    run.tenure.settle(first)  # the lost claim's outcome does not untrack the new one
    run.ledger.heartbeat(run.job_id, run.run_id, -1, exclusive=True)
    run.ledger.requeue_expired(run.job_id)
    asyncio.run(run.tenure.renew())
    assert again.lost
    later = run.claim(1, token=4)[0]
    run.tenure.settle(later)
    run.ledger.release_held(run.job_id, run.run_id)
    asyncio.run(run.tenure.renew())  # a settled item is no longer watched
    assert not later.lost


def test_a_lost_lock_stops_the_run_once(run: Run) -> None:
    run.claim(2, token=1)
    other = run.ledger.start_run(run.job_id, "resume", exclusive=True, stale_after=-1)
    asyncio.run(run.tenure.renew())
    assert run.tenure.lock_lost
    assert len(run.lost) == 1 and other in run.lost[0].message


def test_confirm_asks_for_one_heartbeat_and_waits_for_it(run: Run) -> None:
    works = run.claim(3, token=1)

    async def main() -> list[bool]:
        waiting = [asyncio.create_task(run.tenure.confirm(w)) for w in works]
        await asyncio.sleep(0.01)
        assert run.beats_asked == 1 and run.tenure.wanted and not any(t.done() for t in waiting)
        await run.tenure.renew()  # the writer's heartbeat
        await asyncio.gather(*waiting)
        return [run.tenure.owns(w) for w in works]

    assert asyncio.run(main()) == [True] * 3
    assert not run.tenure.wanted


def test_confirm_asks_again_when_the_heartbeat_it_got_was_already_stale(run: Run) -> None:
    (work,) = run.claim(1, token=1)

    async def stale_then_fresh() -> None:
        waiting = asyncio.create_task(run.tenure.confirm(work))
        await asyncio.sleep(0.005)
        run.tenure.wake()  # a heartbeat that confirmed nothing new (it started before the stall)
        await asyncio.sleep(0.005)
        assert run.beats_asked == 2 and not waiting.done()
        await run.tenure.renew()
        await waiting

    asyncio.run(stale_then_fresh())
    assert run.tenure.owns(work)


def test_confirm_gives_up_after_three_heartbeats_and_the_send_is_refused(run: Run) -> None:
    (work,) = run.claim(1, token=1)

    async def never_confirmed() -> None:
        waiting = asyncio.create_task(run.tenure.confirm(work))
        for _ in range(3):
            await asyncio.sleep(0.005)
            run.tenure.wake()
        await waiting

    asyncio.run(never_confirmed())
    assert run.beats_asked == 3 and not run.tenure.owns(work)


def test_confirm_returns_at_once_when_stopping_or_for_a_lost_item(run: Run) -> None:
    first, second = run.claim(2, token=1)
    second.lost = True

    async def main() -> None:
        await run.tenure.confirm(second)
        assert run.beats_asked == 0
        waiting = asyncio.create_task(run.tenure.confirm(first))
        await asyncio.sleep(0.005)
        run.tenure.stop()
        await waiting
        await run.tenure.confirm(first)  # asked after the stop
        assert run.beats_asked == 1

    asyncio.run(main())


def test_a_failed_heartbeat_wakes_the_waiters_and_raises(run: Run) -> None:
    (work,) = run.claim(1, token=1)

    async def busy() -> dict[int, int]:
        raise LedgerBusyError("the ledger stayed locked")

    failing = Tenure(
        run.job_id, lock_stale_seconds=LEASE / 2, lease_seconds=LEASE, renew=busy, on_lost=run.lost.append,
        beat_now=run.ask_beat,
    )
    failing.hold(work)

    async def main() -> None:
        waiting = asyncio.create_task(failing.confirm(work))
        await asyncio.sleep(0.005)
        with pytest.raises(LedgerBusyError):
            await failing.renew()
        await asyncio.sleep(0.005)
        assert run.beats_asked == 2 and not waiting.done()  # woken, it asked for another
        failing.stop()
        await waiting

    asyncio.run(main())
    assert not failing.lock_lost and run.lost == []
