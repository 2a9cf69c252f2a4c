"""Riding out a database restart: which errors are passing, and retrying them.

PostgreSQL restarts (failover, upgrade, ``pg_ctlcluster restart``) break every open
connection; the pool's pre-ping replaces dead connections at checkout, and a call
that was cut mid-way is retried whole (each Ledger method is one transaction that
rolled back, or that committed and lost only its acknowledgement: the writes a run
replays are idempotent, see ``Ledger.record``). A deadlock (two runs updating the
same items in different orders: a lease sweep and a commit) rolls back one of the
two transactions; it is retried the same way. SQLite errors are local (disk full,
file removed): retrying them cannot help, so only PostgreSQL ledgers retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
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


def ride_out_sync(call: Callable[[], T], *, for_seconds: float, what: str) -> T:
    """:func:`ride_out` for synchronous callers (ingest): ``call()``, retried the same way."""
    if for_seconds <= 0:
        return call()
    return Retrying(**_policy(for_seconds, what))(call)


async def ride_out(call: Callable[[], Awaitable[T]], *, for_seconds: float, what: str) -> T:
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
