"""Open a ledger database: URL resolution, SQLite pragmas, upgrade to head."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import QueuePool

from batchrun.bundled import bundled_dir
from batchrun.errors import LedgerError
from batchrun.ledger.basics import SCHEMA_HEAD as SCHEMA_HEAD  # both live in basics.py (SQLAlchemy-free)
from batchrun.ledger.basics import SQLITE_BUSY_TIMEOUT_MS as SQLITE_BUSY_TIMEOUT_MS
from batchrun.ledger.basics import database_error_line
from batchrun.ledger.basics import resolve_db_url as resolve_db_url  # where tests and tools have found it
from batchrun.ledger.models import metadata

PG_IDLE_IN_TRANSACTION_S = 10.0  # PostgreSQL ends a session idle this long inside a transaction
WRITE_OPTION = "batchrun_write"  # execution option marking a write transaction
_UPGRADE_LOCK = threading.Lock()
_MIGRATION_LOCK_KEY = 0x6261746368  # "batch": the PostgreSQL advisory lock around migrations


def alembic_config() -> Any:
    """An Alembic Config pointing at our migrations."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(bundled_dir("migrations")))
    return cfg


def _enable_wal(cursor: Any) -> None:
    """Switch a new database file to WAL once; retried because the switch ignores busy_timeout.

    Two processes opening a brand-new ledger at the same moment (two cron jobs)
    otherwise fail with "database is locked".
    """
    if cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return
    from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random

    for attempt in Retrying(
        stop=stop_after_delay(SQLITE_BUSY_TIMEOUT_MS / 1000),
        wait=wait_random(0.01, 0.1),
        retry=retry_if_exception(lambda exc: isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)),
        reraise=True,
    ):
        with attempt:
            cursor.execute("PRAGMA journal_mode = WAL")


def create_ledger_engine(url: str) -> Engine:
    """An engine with our SQLite settings: WAL, busy timeout, foreign keys, BEGIN IMMEDIATE."""
    if url.startswith("sqlite"):
        # A pool (SQLAlchemy's default for a SQLite file): a run commits every few
        # milliseconds, and a new connection per commit (open, pragmas, close) cost
        # ~7% of a T2 run's CPU and ~0.1 s of a submit's start-up (bench/RESULTS.md).
        # A connection serves one thread at a time (check_same_thread only stops
        # pysqlite from refusing the hand-over); the overflow is unbounded so no
        # checkout ever waits for another thread; batchrun never forks.
        # timeout: pysqlite's busy timeout, set at connect without a PRAGMA round trip.
        engine = create_engine(
            url,
            poolclass=QueuePool,
            pool_size=4,
            max_overflow=-1,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        )
        # WAL is a property of the file: once a connection has seen it, the next ones of
        # this engine need not ask (when every write opened a connection, that query was ~2.5% of a run's CPU).
        wal_seen = False

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            nonlocal wal_seen
            # Take transaction control from pysqlite so we can BEGIN IMMEDIATE:
            # a writer then waits for the lock up front instead of failing on upgrade.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            if not wal_seen:
                _enable_wal(cursor)
                wal_seen = True
            # FULL: a committed result survives power loss too; commits are batched, so it is cheap.
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # Writers take the lock up front (no deadlock on upgrade); readers stay
            # deferred so `status` never blocks a run, nor waits on one.
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE_OPTION) else "BEGIN")

        return engine
    engine = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)

    @event.listens_for(engine, "connect")
    def _on_pg_connect(dbapi_connection: Any, _record: Any) -> None:
        # A process stalled inside a transaction (SIGSTOP, a suspended laptop, a paused VM)
        # would hold its row locks, and every other run waiting on them, until it wakes:
        # PostgreSQL ends such a session instead. batchrun's transactions never sit idle,
        # and a call whose session was ended is retried whole when its process wakes.
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {int(PG_IDLE_IN_TRANSACTION_S * 1000)}")
        dbapi_connection.commit()

    return engine


def current_revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade_to_head(engine: Engine, *, migrate_new: bool = False) -> bool:
    """Apply pending migrations; return whether anything was applied.

    A new, empty SQLite ledger is not migrated but created from the models in
    one go and stamped at head (see :func:`_create_at_head`); ``migrate_new``
    runs the migrations on it all the same, as tests of the migrations do.

    Safe when several processes (or threads) open a new ledger at once: the
    upgrade runs in one write transaction (and a PostgreSQL advisory lock) that
    re-reads the revision first; Alembic's module-level context is guarded too.
    """
    with engine.connect() as conn:
        if current_revision(conn) == SCHEMA_HEAD:
            return False
    with _UPGRADE_LOCK, engine.connect() as conn:
        conn.execution_options(**{WRITE_OPTION: True})
        with conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
            if current_revision(conn) == SCHEMA_HEAD:
                return False
            if conn.dialect.name == "sqlite" and not migrate_new and not inspect(conn).get_table_names():
                _create_at_head(conn)
                return True
            from alembic import command

            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    return True


# As Alembic creates its version table on SQLite (a test compares the two ways of making a ledger).
_ALEMBIC_VERSION_DDL = (
    "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
    "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
)


def _create_at_head(conn: Connection) -> None:
    """A new SQLite ledger: every table from the models, stamped at head.

    This is Alembic's recipe for a database built from scratch (``create_all``,
    then stamp head), with the one-row stamp written here: a first ``submit``
    then loads neither Alembic nor its template engine (0.2-0.3 s of its
    start-up here). The migrations stay the only way an existing ledger changes.
    """
    metadata.create_all(conn)
    conn.execute(text(_ALEMBIC_VERSION_DDL))
    conn.execute(text("INSERT INTO alembic_version (version_num) VALUES (:head)"), {"head": SCHEMA_HEAD})


def open_engine(db: str | os.PathLike[str] | None) -> Engine:
    """Open (and upgrade) the ledger at ``db``; errors name the database."""
    url = resolve_db_url(db)
    try:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_ledger_engine(url)
        upgrade_to_head(engine)
    except ModuleNotFoundError as exc:
        raise LedgerError(
            f"cannot open ledger {_safe_url(url)}: missing driver {exc.name!r} "
            "(for PostgreSQL install batchrun[postgres])"
        ) from exc
    except (SQLAlchemyError, OSError, ValueError) as exc:
        raise LedgerError(f"cannot open ledger {_safe_url(url)}: {database_error_line(exc)}") from exc
    return engine


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


def _safe_url(url: str) -> str:
    """The URL without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url
