"""The ledger from the event loop: its calls on one thread of their own, riding out a database restart.

The :class:`~batchrun.ledger.store.Ledger` is synchronous. :class:`AsyncLedger`
runs its calls on one dedicated thread, so the loop never blocks on SQLite and
the ledger sees one writer per process (a runner, a worker), and on PostgreSQL
rides out a lost connection; :func:`ride_out` does the same for a synchronous
caller (ingest). Callers say what to call, never how to retry it.

PostgreSQL restarts (failover, upgrade, ``pg_ctlcluster restart``) break every open
connection; the pool's pre-ping replaces dead connections at checkout, and a call
that was cut mid-way is retried whole (each Ledger method is one transaction that
rolled back, or that committed and lost only its acknowledgement: the writes a run
replays are idempotent, see ``Ledger.record``). A deadlock (two runs updating the
same items in different orders: a lease sweep and a commit) rolls back one of the
two transactions; it is retried the same way. SQLite errors are local (disk full,
file removed): retrying them cannot help, so only PostgreSQL ledgers retry.

Only those errors are retried. The ledger's fences (LockLostError when the job
lock is another run's, LedgerBusyError when a SQLite file stays locked,
JobLockedError) and any other error reach the caller at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from batchrun.ledger.protocol import RunLedger

log = logging.getLogger(__name__)
T = TypeVar("T")

LEDGER_RETRY_SECONDS = 180.0  # how long a PostgreSQL ledger call is retried by default


# SQLSTATEs worth retrying: a server going away or not there yet (admin_shutdown, a
# restart; crash_shutdown; cannot_connect_now, "the database system is starting up"), a
# session ended for sitting in a transaction (this process was stalled: see engine.py),
# and a transaction PostgreSQL rolled back to break a deadlock or a serialization conflict.
_GONE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "25P03"})
_ROLLED_BACK_SQLSTATES = frozenset({"40P01", "40001"})


def is_transient(exc: BaseException) -> bool:
    """The database went away, cannot be reached right now, or rolled the transaction back
    to break a deadlock (worth retrying).

    SQLAlchemy marks a connection lost mid-use (``connection_invalidated``); a failure to
    connect is psycopg's OperationalError without a SQLSTATE (refused, reset, timed out),
    a connection exception (class 08) or one of the shutdown/start-up states; a deadlock
    is ``40P01``. Anything else (a constraint, a full disk, a bug) is not retried: it
    would fail again.
    """
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    try:
        import psycopg
    except ImportError:  # pragma: no cover - PostgreSQL ledgers need it
        return False
    orig = exc.orig
    if not isinstance(orig, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    sqlstate = orig.sqlstate
    return (
        sqlstate is None
        or sqlstate.startswith("08")
        or sqlstate in _GONE_SQLSTATES
        or sqlstate in _ROLLED_BACK_SQLSTATES
    )


def _ride_out_seconds(ledger: RunLedger, seconds: float) -> float:
    """How long a call to ``ledger`` is retried: ``seconds`` on PostgreSQL; never on SQLite (its errors are local)."""
    return seconds if ledger.reconnects else 0.0


def _policy(for_seconds: float, what: str) -> dict[str, Any]:
    """Tenacity's arguments for riding out: backoff with jitter, transient errors only, logged."""
    started = time.monotonic()

    def note(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        level = logging.WARNING if state.attempt_number in (1, 10) or state.attempt_number % 30 == 0 else logging.DEBUG
        log.log(
            level,
            "ledger unreachable during %s (%s); retrying for up to %.0f s more",
            what, type(exc).__name__, max(0.0, for_seconds - (time.monotonic() - started)),
        )

    return {
        "stop": stop_after_delay(for_seconds),
        "wait": wait_exponential(multiplier=0.1, max=5.0) + wait_random(0, 0.25),
        "retry": retry_if_exception(is_transient),
        "before_sleep": note,
        "reraise": True,
    }


async def _ride_out_async(call: Callable[[], Awaitable[T]], *, for_seconds: float, what: str) -> T:
    """``await call()``, retried with backoff while the database is unreachable, for at most ``for_seconds``.

    The last error is raised when the time is up (``reraise``); any other error at once.
    """
    if for_seconds <= 0:
        return await call()
    started = time.monotonic()
    retrying = AsyncRetrying(**_policy(for_seconds, what))
    async for attempt in retrying:
        with attempt:
            result = await call()
        outcome = attempt.retry_state.outcome
        if outcome is not None and outcome.failed:
            continue  # tenacity decides: sleep and try again, or re-raise
        if attempt.retry_state.attempt_number > 1:
            log.warning("ledger reachable again after %.1f s (%s)", time.monotonic() - started, what)
        return result
    raise AssertionError("unreachable: tenacity re-raises the last error")


def ride_out(ledger: RunLedger, call: Callable[[], T], *, what: str) -> T:
    """``call()`` (one Ledger transaction) for a synchronous caller (ingest), retried like :meth:`AsyncLedger.call`
    for up to LEDGER_RETRY_SECONDS."""
    for_seconds = _ride_out_seconds(ledger, LEDGER_RETRY_SECONDS)
    if for_seconds <= 0:
        return call()
    return Retrying(**_policy(for_seconds, what))(call)


class AsyncLedger:
    """A ledger's calls from the event loop, on one thread of their own, riding out a lost connection.

    One per runner or worker; :meth:`close` at its end. ``ride_out_seconds`` is how
    long a call cut by a PostgreSQL restart is retried before its error is raised.
    """

    def __init__(
        self, ledger: RunLedger, *, ride_out_seconds: float = LEDGER_RETRY_SECONDS, thread_name: str = "batchrun-ledger"
    ) -> None:
        self.ledger = ledger
        self.ride_out_seconds = _ride_out_seconds(ledger, ride_out_seconds)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the ledger's thread (one call at a time, in the order asked), retried whole
        while the database is unreachable; its result, or its error."""
        loop = asyncio.get_running_loop()
        return await _ride_out_async(
            lambda: loop.run_in_executor(self._thread, fn, *args),
            for_seconds=self.ride_out_seconds,
            what=getattr(fn, "__name__", "ledger"),
        )

    def close(self, *, wait: bool = True) -> None:
        """End the thread; with ``wait``, once the call on it has returned (without, a call stuck on
        an unreachable database does not hold up the caller's exit)."""
        self._thread.shutdown(wait=wait)
