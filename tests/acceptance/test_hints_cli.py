"""The next command batchrun prints acts on the right job (issue 17, item 1).

A hint names the ledger when it is not the default one, and a job remembers where it
is exported, so the printed ``batchrun resume JOB --db ...`` finishes the very job that
stopped and writes the same files, paying for no item twice.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import cli_env, run_cli, start_cli, wait_for_requests
from .test_cli import SPEC, write_spec


def write_records(tmp_path: Path, n: int, extra: list[bytes] | None = None, name: str = "records") -> Path:
    path = tmp_path / f"{name}.jsonl"
    lines = [orjson.dumps({"id": f"r{i}", "text": f"hello {i}"}) for i in range(n)] + (extra or [])
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def hinted(stderr: str, after: str = "carry on with: ") -> list[str]:
    """The command a message tells the user to run, as argv for this interpreter."""
    match = re.search(re.escape(after) + r"(batchrun [^\n`]+)", stderr)
    assert match, stderr
    words = shlex.split(match.group(1))
    return [sys.executable, "-m", "batchrun", *words[1:]]


def run_hint(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=cli_env(tmp_path), timeout=120, check=False)


@pytest.mark.slow
def test_the_printed_resume_of_a_db_job_finishes_it_into_the_same_files(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    # A job in the default ledger too: a hint without --db would carry on that one.
    spec, other = write_spec(tmp_path, server), tmp_path / "other.jsonl"
    other.write_text("".join(f'{{"id": "o{i}", "text": "other {i}"}}\n' for i in range(3)))
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(other)).returncode == 0
    server.faults = Faults(latency_s=0.1)
    many = write_records(tmp_path, 120, [b"{broken"], name="many")
    db = tmp_path / "my ledger.db"  # a space: the hint must quote it
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    first = start_cli(tmp_path, "submit", str(spec), "--input", str(many), "--db", str(db), "--output", str(out),
                      "--format", "openai-batch", "--errors", str(errors), "--quiet")
    wait_for_requests(server, 10)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 75, err
    argv = hinted(err)
    assert argv[3:] == ["resume", "1", "--db", str(db)], err
    assert not out.exists()

    server.faults = Faults()
    done = run_hint(tmp_path, argv)
    assert done.returncode == 1, done.stderr  # one rejected line
    assert f"output: {out} (121 lines)" in done.stdout and f"errors: {errors} (1 lines)" in done.stdout
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert "response" in lines[0]  # --format openai-batch, remembered
    assert set(server.requests_by_key().values()) == {1}  # nothing paid for twice
    # The default ledger's job is untouched: it still has its 3 items.
    default = orjson.loads(run_cli(tmp_path, "status", "1", "--json").stdout)
    assert default["total"] == 3


@pytest.mark.slow
def test_an_explicit_output_wins_and_becomes_the_remembered_one(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 5), tmp_path / "l.db"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.csv"
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(a)).returncode == 0
    again = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(b), "--format", "csv")
    assert again.returncode == 0, again.stderr
    assert b.read_text().startswith("custom_id,status")
    a.unlink()
    b.unlink()
    third = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert third.returncode == 0 and f"output: {b}" in third.stdout
    assert b.read_text().startswith("custom_id,status") and not a.exists()
    assert len(server.log) == 5


@pytest.mark.slow
def test_a_remembered_output_whose_folder_is_gone_says_what_to_do(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 5), tmp_path / "l.db"
    out = tmp_path / "out" / "a.jsonl"
    out.parent.mkdir()
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out)).returncode == 0
    out.unlink()
    out.parent.rmdir()
    gone = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert gone.returncode == 2 and "Traceback" not in gone.stderr
    assert f"folder {out.parent} does not exist (where job 1 was exported before, remembered as its --output)" in gone.stderr
    assert "make the folder again, or give --output FILE" in gone.stderr
    out.mkdir(parents=True)  # the folder is back, but the remembered file name is now a folder itself
    blocked = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert blocked.returncode == 2 and "remembered as its --output); nothing was sent: give --output FILE" in blocked.stderr
    out.rmdir()
    out.parent.rmdir()
    elsewhere = tmp_path / "b.jsonl"
    moved = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(elsewhere))
    assert moved.returncode == 0 and len(elsewhere.read_text().splitlines()) == 5
    assert len(server.log) == 5


@pytest.mark.slow
def test_budget_retry_and_lock_hints_name_the_ledger(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 200), tmp_path / "l.db"
    server.faults = Faults(status_override=500)
    failed = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 2, name="two")), "--db", str(db),
                     "--max-attempts", "1")
    assert failed.returncode == 1
    retried = run_cli(tmp_path, "retry", "1", "--db", str(db))
    assert hinted(retried.stdout, "run: ")[3:] == ["resume", "1", "--db", str(db)], retried.stdout

    server.faults = Faults(latency_s=0.2)
    first = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--quiet", "--new")
    wait_for_requests(server, 3)
    second = run_cli(tmp_path, "resume", "2", "--db", str(db))
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=60)
    assert second.returncode == 75, second.stderr
    assert hinted(second.stderr, "try again later: ")[3:] == ["resume", "2", "--db", str(db)], second.stderr

    server.faults = Faults()
    priced = tmp_path / "priced.toml"
    priced.write_text(SPEC.format(base_url=server.base_url).replace(
        "[run]", "[pricing]\ninput_per_million = 1000\noutput_per_million = 1000\n[run]"))
    budget = run_cli(tmp_path, "submit", str(priced), "--input", str(records), "--db", str(db), "--budget-usd", "0.5", "--new")
    assert budget.returncode == 4, budget.stderr
    assert hinted(budget.stderr, "larger total budget: ")[3:] == ["resume", "3", "--budget-usd", "AMOUNT", "--db", str(db)]
