"""What the command line knows of a ledger before it opens one (no SQLAlchemy here, so ``--help``
and the commands that never open a ledger start without it): where a ledger lives by default,
how ``--db`` becomes a URL, which columns items may be chosen by, and whether an error is the
database's."""

from __future__ import annotations

import os
from pathlib import Path

# The newest migration under migrations/versions (a test checks they agree). Knowing it lets an
# up-to-date ledger open without importing Alembic (~0.6 s), and tells the read-only quick reader
# (quick.py) whether it knows the schema: a ledger at any other revision goes through SQLAlchemy.
SCHEMA_HEAD = "0010"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# What `batchrun show --where` can choose items by: columns of the items table.
SHOW_FILTERS = ("state", "error_class", "status_code", "custom_id")
# What `batchrun retry --where` may narrow the items to send again by.
RETRY_FILTERS = ("error_class", "status_code", "custom_id")


def default_db_path() -> Path:
    """Where the ledger lives when neither ``--db`` nor ``BATCHRUN_DB`` says."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "batchrun" / "ledger.db"


def resolve_db_url(db: str | os.PathLike[str] | None) -> str:
    """A SQLAlchemy URL from ``--db``: a URL as is, a plain path as a SQLite file."""
    if db is None or str(db) == "":
        db = default_db_path()
    text = str(db)
    if "://" in text:
        if text.startswith("postgresql://") or text.startswith("postgres://"):
            text = "postgresql+psycopg://" + text.split("://", 1)[1]
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


def is_database_error(exc: BaseException) -> bool:
    """An error of the database layer: SQLAlchemy's, or the driver's where it is used directly (COPY)."""
    return type(exc).__module__.split(".")[0] in ("sqlalchemy", "psycopg", "sqlite3")


def database_error_line(exc: BaseException) -> str:
    """The driver's message, first line only (no driver hint, no SQLAlchemy background link)."""
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
