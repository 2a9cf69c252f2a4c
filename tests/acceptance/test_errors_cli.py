"""Signals and errors without tracebacks, in one line (issue 17, item 9)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli, wait_for_requests
from .test_cli import write_records, write_spec


def one_line_error(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchrun: error: "), stderr
    assert "Traceback" not in stderr and "Usage:" not in stderr
    return lines[0]


def test_click_usage_errors_are_one_line_with_where_to_look(tmp_path: Path) -> None:
    bogus = run_cli(tmp_path, "submit", "--bogus")
    assert bogus.returncode == 2
    assert "no such option '--bogus'" in one_line_error(bogus.stderr) and "batchrun submit --help" in bogus.stderr
    missing = run_cli(tmp_path, "resume")
    assert missing.returncode == 2 and "missing argument 'JOB'" in one_line_error(missing.stderr)
    bad = run_cli(tmp_path, "status", "--interval", "soon")
    assert bad.returncode == 2 and "'--interval'" in one_line_error(bad.stderr)
    unknown = run_cli(tmp_path, "sumbit")
    assert unknown.returncode == 2 and "no such command 'sumbit'" in one_line_error(unknown.stderr)
    assert run_cli(tmp_path, "--help").returncode == 0 and run_cli(tmp_path, "--version").returncode == 0


@pytest.mark.slow
def test_verbosity_flags_are_taken_after_the_command(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 3), tmp_path / "l.db"
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "-q").returncode == 0
    assert run_cli(tmp_path, "status", "1", "--db", str(db), "-vv").returncode == 0  # not "no such option"
    verbose = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--new", "-v")
    assert verbose.returncode == 0 and "INFO" in verbose.stderr, verbose.stderr
    assert run_cli(tmp_path, "list", "--db", str(db), "-q").returncode == 0
    assert run_cli(tmp_path, "db", "upgrade", "--db", str(db), "-v").returncode == 0


@pytest.mark.slow
def test_the_input_file_is_never_the_output_even_with_force(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 3), tmp_path / "l.db"
    before = records.read_bytes()
    for flag in ("--output", "--errors"):
        proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), flag, str(records),
                       "--force", *(["--output", str(tmp_path / "o.jsonl")] if flag == "--errors" else []))
        assert proc.returncode == 2, proc.stderr
        assert f"{records}: is the job's input file" in one_line_error(proc.stderr)
    assert len(server.log) == 0 and records.read_bytes() == before
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db)).returncode == 0
    exported = run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(records), "--force")
    assert exported.returncode == 2 and "is the job's input file" in one_line_error(exported.stderr)
    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(records), "--force")
    assert resumed.returncode == 2 and "is the job's input file" in resumed.stderr
    assert records.read_bytes() == before


@pytest.mark.slow
def test_read_only_commands_on_a_missing_ledger_say_so_and_create_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "typo.db"
    for args in (["status"], ["status", "1"], ["list"], ["report", "1"], ["show", "1"], ["resume", "1"],
                 ["export", "1", "--output", str(tmp_path / "o.jsonl")], ["retry", "1"], ["cancel", "1"]):
        proc = run_cli(tmp_path, *args, "--db", str(missing))
        assert proc.returncode == 2, (args, proc.stderr)
        assert f"no ledger at {missing}: the file does not exist" in one_line_error(proc.stderr)
    assert not missing.exists() and not (tmp_path / "home").exists()


@pytest.mark.slow
def test_a_second_signal_while_shutting_down_exits_75_at_once(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(p_hang=1.0)  # the requests in flight never answer: the grace period would last 30 s
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 20), tmp_path / "l.db"
    proc = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    wait_for_requests(server, 4)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert time.monotonic() - started < 10
    assert "Traceback" not in err and "Aborted" not in err
    hint = f"batchrun resume 1 --db {db}"
    assert err.rstrip().endswith(f"SIGINT again: stopped at once; carry on with: {hint}"), err
    server.faults = Faults()
    done = run_cli(tmp_path, *hint.split()[1:])  # the hint, as printed
    assert done.returncode == 0, done.stderr
