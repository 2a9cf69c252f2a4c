"""AsyncLedger and ride_out: the ledger's own thread, and riding out a database restart.

No database is reached: the calls are plain functions that raise what SQLAlchemy
raises when PostgreSQL goes away. The ledgers only say which backend they are
(a PostgreSQL engine that never connects; an in-memory SQLite one).
tests/integration/test_ledger_fences.py replays a real write whose acknowledgement was lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import psycopg.errors
import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import IntegrityError, OperationalError

from batchrun.errors import LedgerBusyError, LockLostError
from batchrun.ledger import AsyncLedger, Ledger, ride_out
from batchrun.ledger.engine import is_transient


@pytest.fixture
def pg_ledger() -> Iterator[Ledger]:
    """A PostgreSQL ledger that is never connected to."""
    ledger = Ledger(create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none"))
    yield ledger
    ledger.close()


@pytest.fixture
def sqlite_ledger() -> Iterator[Ledger]:
    ledger = Ledger(create_engine("sqlite://"))
    yield ledger
    ledger.close()


def _lost(statement: str = "SELECT 1") -> OperationalError:
    return OperationalError(statement, {}, psycopg.OperationalError("server closed the connection unexpectedly"))


def _failing(times: int, error: Callable[[], BaseException]) -> tuple[Callable[[], str], list[int]]:
    """A call that raises ``error()`` its first ``times`` calls, then returns "ok"; and its call count."""
    calls = [0]

    def call() -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise error()
        return "ok"

    return call, calls


def _call(ledger: Ledger, fn: Callable[[], str], *, ride_out_seconds: float = 10.0) -> str:
    aledger = AsyncLedger(ledger, ride_out_seconds=ride_out_seconds)
    try:
        return asyncio.run(aledger.call(fn))
    finally:
        aledger.close()


def test_calls_run_one_at_a_time_on_the_ledgers_own_thread(sqlite_ledger: Ledger) -> None:
    running, most, threads = [0], [0], set()

    def work(n: int) -> int:
        running[0] += 1
        most[0] = max(most[0], running[0])
        threads.add(threading.current_thread().name)
        time.sleep(0.01)
        running[0] -= 1
        return n

    async def go() -> list[int]:
        aledger = AsyncLedger(sqlite_ledger, thread_name="batchrun-test")
        try:
            return await asyncio.gather(*(aledger.call(work, n) for n in range(8)))
        finally:
            aledger.close()

    assert asyncio.run(go()) == list(range(8))
    assert most == [1] and len(threads) == 1 and threads.pop().startswith("batchrun-test")


def test_postgresql_calls_ride_out_a_lost_connection_and_a_deadlock(pg_ledger: Ledger) -> None:
    flaky, calls = _failing(2, _lost)
    assert _call(pg_ledger, flaky) == "ok" and calls == [3]
    deadlocked, calls = _failing(1, lambda: OperationalError("UPDATE", {}, psycopg.errors.DeadlockDetected("deadlock")))
    assert _call(pg_ledger, deadlocked) == "ok" and calls == [2]


def test_riding_out_gives_up_in_time_with_the_last_error(pg_ledger: Ledger) -> None:
    down, calls = _failing(1000, _lost)
    started = time.monotonic()
    with pytest.raises(OperationalError):
        _call(pg_ledger, down, ride_out_seconds=0.3)
    assert calls[0] > 1 and time.monotonic() - started < 2


@pytest.mark.parametrize(
    "error",
    [
        lambda: IntegrityError("INSERT", {}, Exception("duplicate key")),
        lambda: OperationalError("INSERT", {}, Exception("disk I/O error")),  # the database's own error
        lambda: LockLostError("job 1 was taken over"),  # the ledger's fences
        lambda: LedgerBusyError("the ledger stayed locked"),
    ],
)
def test_other_errors_and_the_fences_reach_the_caller_at_once(pg_ledger: Ledger, error: Callable[[], BaseException]) -> None:
    call, calls = _failing(1, error)
    started = time.monotonic()
    with pytest.raises(type(error())):
        _call(pg_ledger, call)
    assert calls == [1] and time.monotonic() - started < 1


def test_a_sqlite_ledger_never_rides_out(sqlite_ledger: Ledger) -> None:
    assert AsyncLedger(sqlite_ledger, ride_out_seconds=10).ride_out_seconds == 0.0
    call, calls = _failing(1, _lost)
    with pytest.raises(OperationalError):
        _call(sqlite_ledger, call)
    assert calls == [1]
    call, calls = _failing(1, _lost)
    with pytest.raises(OperationalError):
        ride_out(sqlite_ledger, call, what="test")
    assert calls == [1]


def test_a_synchronous_caller_rides_out_the_same_way(pg_ledger: Ledger) -> None:
    call, calls = _failing(2, _lost)
    assert ride_out(pg_ledger, call, what="ingest") == "ok" and calls == [3]
    broken, calls = _failing(1, lambda: IntegrityError("INSERT", {}, Exception("duplicate key")))
    with pytest.raises(IntegrityError):
        ride_out(pg_ledger, broken, what="ingest")
    assert calls == [1]


def test_close_waits_for_the_call_on_the_thread_unless_told_not_to(sqlite_ledger: Ledger) -> None:
    async def close_during_a_call(wait: bool) -> tuple[float, bool]:
        aledger = AsyncLedger(sqlite_ledger)
        started, done = threading.Event(), threading.Event()

        def slow() -> None:
            started.set()
            time.sleep(0.3)
            done.set()

        task = asyncio.ensure_future(aledger.call(slow))
        while not started.is_set():
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        aledger.close(wait=wait)
        took, finished = time.monotonic() - t0, done.is_set()
        await task  # the call itself is not cut short either way
        return took, finished

    took, finished = asyncio.run(close_during_a_call(wait=True))
    assert finished and took >= 0.2
    took, finished = asyncio.run(close_during_a_call(wait=False))
    assert not finished, took  # close returned while the 0.3 s call was still going


def test_what_is_transient() -> None:
    assert is_transient(OperationalError("x", {}, psycopg.OperationalError("y")))  # no SQLSTATE: cannot connect
    assert is_transient(OperationalError("x", {}, psycopg.errors.AdminShutdown("restart")))
    assert is_transient(OperationalError("x", {}, psycopg.errors.DeadlockDetected("deadlock")))
    invalidated = IntegrityError("x", {}, Exception("y"))
    invalidated.connection_invalidated = True
    assert is_transient(invalidated)
    assert not is_transient(OperationalError("x", {}, Exception("y")))
    assert not is_transient(ValueError())
