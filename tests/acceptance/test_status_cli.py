"""``batchrun status`` as a subprocess: on a job whose run was SIGKILLed it says the run is dead
(no ETA) and that its running items wait for a resume; while a run works, it says so."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

import orjson

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli
from .test_kill_resume import write_batch_input


def running_items(db: Path) -> int:
    if not db.exists():
        return 0
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("select count(*) from items where state = 'running'").fetchone()[0])
    except sqlite3.OperationalError:
        return 0  # schema not created yet
    finally:
        conn.close()


def wait_for_running(db: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while running_items(db) == 0:
        assert time.monotonic() < deadline, "no item was claimed"
        time.sleep(0.05)


def status(tmp_path: Path, db: Path) -> dict[str, object]:
    proc = run_cli(tmp_path, "status", "1", "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    data: dict[str, object] = orjson.loads(proc.stdout)
    return data


def test_status_of_a_killed_run_says_it_is_dead(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.5)  # answers take long: items stay running when the run is killed
    src, db = tmp_path / "in.jsonl", tmp_path / "ledger.db"
    write_batch_input(src, 400)
    proc = start_cli(tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", str(db),
                     "--concurrency", "8", "--quiet")
    try:
        wait_for_running(db)
        live = status(tmp_path, db)
        assert live["run"]["live"] is True  # type: ignore[index]
        assert live["run"]["last"]["state"] == "live"  # type: ignore[index]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    left = running_items(db)
    assert left > 0

    dead = status(tmp_path, db)
    assert dead["counts"]["running"] == left  # type: ignore[index]
    assert dead["run"]["live"] is False  # type: ignore[index]
    assert dead["run"]["last"]["state"] == "dead"  # type: ignore[index]
    assert dead["run"]["last"]["pid"] == proc.pid  # type: ignore[index]
    assert dead["eta_s"] is None

    text = run_cli(tmp_path, "status", "1", "--db", str(db))
    assert text.returncode == 0, text.stderr
    # the hint is for this ledger: pasted, it resumes this job, not the default ledger's job 1
    assert f"running   {left} left by a dead run, resume to continue: batchrun resume 1 --db {db}\n" in text.stdout
    assert f"(pid {proc.pid} on " in text.stdout and "dead: no heartbeat for" in text.stdout
    assert "eta" not in text.stdout


def test_status_after_a_run_that_ended(tmp_path: Path, server: FakeProviderServer) -> None:
    src, db = tmp_path / "in.jsonl", tmp_path / "ledger.db"
    write_batch_input(src, 20)
    done = run_cli(tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", str(db), "--quiet")
    assert done.returncode == 0, done.stderr
    data = status(tmp_path, db)
    assert data["run"]["live"] is False and data["run"]["last"]["state"] == "ended"  # type: ignore[index]
    assert data["run"]["last"]["exit_code"] == 0 and data["run"]["last"]["command"] == "submit"  # type: ignore[index]
    text = run_cli(tmp_path, "status", "1", "--db", str(db)).stdout
    assert "ended (exit 0)" in text and "left by a dead run" not in text
    assert "items     20 total, 20 finished (done)" in text and data["state"] == "done"
