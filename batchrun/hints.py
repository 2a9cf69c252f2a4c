"""The next commands batchrun suggests ("carry on with: ..."), aimed at the right ledger.

A hint that a user pastes must act on the job it names: when the ledger is not the
one the bare command opens (``$BATCHRUN_DB``, else the default), the command repeats
``--db``. A PostgreSQL URL is shown with its password hidden, never in full.
"""

from __future__ import annotations

import os
import shlex


def db_flag(ledger_url: str) -> str:
    """`` --db LEDGER`` for a ledger the bare command would not open, else ``""``.

    ``ledger_url`` is the ledger's URL as shown (a password hidden). The bare command opens
    ``$BATCHRUN_DB`` when it is set (cron sets it), else the default ledger. A URL whose
    password is hidden cannot be pasted: the hint asks for the user's own ``--db`` value.
    """
    from sqlalchemy.engine import make_url

    from batchrun.ledger.basics import resolve_db_url  # the ledger's own messages use this module

    bare = resolve_db_url(os.environ.get("BATCHRUN_DB") or None)
    if ledger_url in (bare, make_url(bare).render_as_string(hide_password=True)):
        return ""
    if make_url(ledger_url).password is not None:  # shown as ***: pasting it would fail to log in
        return " --db '<your --db URL>'"
    where = ledger_url.removeprefix("sqlite:///") if ledger_url.startswith("sqlite:///") else ledger_url
    return f" --db {shlex.quote(where)}"


def command(ledger_url: str, *args: object) -> str:
    """``batchrun ARGS [--db LEDGER]``: a command line to paste, each argument quoted for a shell."""
    words = " ".join(shlex.quote(str(a)) for a in args)
    return f"batchrun {words}{db_flag(ledger_url)}"
