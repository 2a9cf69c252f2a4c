"""The CLI's error boundary: a database failure past what a command rides out is one line and
exit 75 (run it again), never a traceback; anything else is not swallowed."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from sqlalchemy.exc import OperationalError

from batchrun.cli import handle_errors
from batchrun.states import ExitCode


def _command(exc: BaseException) -> click.Command:
    @click.command()
    @handle_errors
    def fails() -> None:
        raise exc

    return fails


def test_a_database_failure_mid_command_is_one_line_and_exit_75() -> None:
    cause = Exception("FATAL:  the database system is shutting down\nmore detail")
    result = CliRunner().invoke(_command(OperationalError("SELECT 1", {}, cause)))
    assert result.exit_code == ExitCode.TEMPFAIL
    assert result.output.strip().splitlines() == [
        "batchrun: error: the ledger failed: FATAL:  the database system is shutting down; nothing committed "
        "is lost: run the same command again when the database is back"
    ]


def test_other_errors_are_not_swallowed() -> None:
    result = CliRunner().invoke(_command(KeyError("bug")))
    assert isinstance(result.exception, KeyError)
    with pytest.raises(KeyError):
        _command(KeyError("bug")).main([], standalone_mode=False)


def test_a_ledger_that_cannot_be_opened_is_one_line() -> None:
    """Nothing was done: a usage error (exit 2), in one line (psycopg's hint and SQLAlchemy's
    background link are left out)."""
    from batchrun.cli import main

    result = CliRunner().invoke(main, ["status", "--db", "postgresql+psycopg://postgres@127.0.0.1:9/test"])
    assert result.exit_code == ExitCode.USAGE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "cannot open ledger postgresql+psycopg://postgres@127.0.0.1:9/test" in lines[0]
    assert "Connection refused" in lines[0]
