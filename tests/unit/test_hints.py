"""The hints batchrun prints ("carry on with: ...") name the ledger unless it is the default one,
and never print a URL that cannot work when pasted."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrun.hints import command
from batchrun.ledger.basics import resolve_db_url


def test_only_the_default_ledger_is_not_repeated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHRUN_DB", raising=False)
    assert command(resolve_db_url(None), "resume", 1) == "batchrun resume 1"
    other = tmp_path / "my ledger.db"
    assert command(resolve_db_url(other), "resume", 1) == f"batchrun resume 1 --db '{other}'"
    monkeypatch.setenv("BATCHRUN_DB", str(other))  # cron's way; pasted in a shell without it, the hint still works
    assert command(resolve_db_url(other), "resume", 1) == f"batchrun resume 1 --db '{other}'"


def test_a_url_shown_with_its_password_hidden_is_not_offered_for_pasting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHRUN_DB", raising=False)
    shown = "postgresql+psycopg://br:***@127.0.0.1:5432/bt"
    assert command(shown, "resume", 1) == "batchrun resume 1 --db '<your --db URL>'"
    monkeypatch.setenv("BATCHRUN_DB", "postgresql://br:s3cret@127.0.0.1:5432/bt")
    assert command(shown, "resume", 1) == "batchrun resume 1"
    no_password = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    monkeypatch.delenv("BATCHRUN_DB")
    assert command(no_password, "resume", 1) == f"batchrun resume 1 --db {no_password}"
