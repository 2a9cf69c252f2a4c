"""The next commands batchrun suggests ("carry on with: ..."), aimed at the right ledger.

A hint that a user pastes must act on the job it names: when the ledger is not the
default one (``--db`` or ``$BATCHRUN_DB`` pointed elsewhere), the command repeats
``--db``. A PostgreSQL URL is shown with its password hidden, never in full.
"""

from __future__ import annotations

import shlex


def db_flag(ledger_url: str) -> str:
    """`` --db LEDGER`` for a ledger that is not the default one, else ``""``."""
    from batchrun.ledger.engine import resolve_db_url  # the ledger's own messages use this module

    if ledger_url == resolve_db_url(None):
        return ""
    where = ledger_url.removeprefix("sqlite:///") if ledger_url.startswith("sqlite:///") else ledger_url
    return f" --db {shlex.quote(where)}"


def command(ledger_url: str, *args: object) -> str:
    """``batchrun ARGS [--db LEDGER]``: a command line to paste, each argument quoted for a shell."""
    words = " ".join(shlex.quote(str(a)) for a in args)
    return f"batchrun {words}{db_flag(ledger_url)}"
