"""The next commands batchrun suggests ("carry on with: ..."), aimed at the right ledger.

A hint that a user pastes must act on the job it names, in whatever shell it is pasted:
when the ledger is not the default one, the command repeats ``--db`` (a ``$BATCHRUN_DB``
that cron sets is not in the user's shell). A PostgreSQL URL is shown with its password
hidden, never in full; one whose password comes from ``$BATCHRUN_DB`` is left to it.
"""

from __future__ import annotations

import os
import shlex


def db_flag(ledger_url: str) -> str:
    """`` --db LEDGER`` for a ledger other than the default, else ``""``.

    ``ledger_url`` is the ledger's URL as shown (a password hidden). A URL whose password is
    hidden cannot be pasted: the hint leaves it to ``$BATCHRUN_DB`` when that names it, else
    asks for the user's own ``--db`` value.
    """
    from batchrun.ledger.basics import resolve_db_url  # the ledger's own messages use this module

    if ledger_url == resolve_db_url(None):
        return ""
    if ledger_url.startswith("sqlite:///"):  # a file: no password (and no SQLAlchemy import for `status`)
        return f" --db {shlex.quote(ledger_url.removeprefix('sqlite:///'))}"
    from sqlalchemy.engine import make_url

    if make_url(ledger_url).password is not None:  # shown as ***: pasting it would fail to log in
        from_env = os.environ.get("BATCHRUN_DB")
        env_url = resolve_db_url(from_env) if from_env else None
        if env_url is not None and ledger_url in (env_url, make_url(env_url).render_as_string(hide_password=True)):
            return ""  # the password stays in $BATCHRUN_DB, the way to keep it off command lines
        return " --db '<your --db URL>'"
    return f" --db {shlex.quote(ledger_url)}"


def command(ledger_url: str, *args: object) -> str:
    """``batchrun ARGS [--db LEDGER]``: a command line to paste, each argument quoted for a shell."""
    words = " ".join(shlex.quote(str(a)) for a in args)
    return f"batchrun {words}{db_flag(ledger_url)}"
