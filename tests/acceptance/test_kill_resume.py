"""The CLI as a subprocess, killed and resumed: nothing lost, nothing duplicated, nothing paid twice."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections import Counter
from pathlib import Path

import orjson

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli

CONCURRENCY = 16


def write_batch_input(path: Path, n: int, pad: str = "") -> None:
    """``n`` OpenAI Batch lines ``rec-<i>`` asking ``record <i>`` (then ``pad``, to make the lines long)."""
    with open(path, "wb") as f:
        for i in range(n):
            line = {
                "custom_id": f"rec-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"record {i}{pad}"}]},
            }
            f.write(orjson.dumps(line) + b"\n")


def ledger_states(db: Path) -> dict[str, str]:
    conn = sqlite3.connect(db)
    try:
        return dict(conn.execute("select custom_id, state from items"))
    finally:
        conn.close()


def wait_for_succeeded(db: Path, at_least: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if db.exists():
            try:
                if Counter(ledger_states(db).values())["succeeded"] >= at_least:
                    return
            except sqlite3.OperationalError:
                pass  # schema not created yet
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} items succeeded within {timeout} s")


def cid(key: str | None) -> str:
    assert key is not None
    return f"rec-{key.removeprefix('record ')}"


def check_output(path: Path, n: int) -> None:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == n and len(set(ids)) == n, "one line per input record, no duplicates"
    assert set(ids) == {f"rec-{i}" for i in range(n)}
    for line in lines:
        assert line["status"] == "succeeded"
        assert line["output"] == f"echo: record {line['custom_id'].removeprefix('rec-')}"


def test_sigkill_midway_then_resume(tmp_path: Path, server: FakeProviderServer) -> None:
    n = 1500
    server.faults = Faults(latency_s=0.02, latency_jitter_s=0.02, p_500=0.03, p_reset=0.01, seed=11)
    src, db, out = tmp_path / "in.jsonl", tmp_path / "ledger.db", tmp_path / "out.jsonl"
    write_batch_input(src, n)
    proc = start_cli(
        tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", str(db),
        "--output", str(out), "--concurrency", str(CONCURRENCY), "--quiet",
    )
    wait_for_succeeded(db, 400)
    proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    proc.wait(timeout=10)
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    time.sleep(0.2)  # let the server notice the dropped connections

    states = ledger_states(db)
    committed = {cid for cid, state in states.items() if state in ("succeeded", "failed")}
    assert 400 <= len(committed) < n
    before = [r for r in server.log if r.received_at < killed_at]
    # Paid for or still open at the kill, but not in the ledger: the work a kill may lose.
    lost = {cid(r.key) for r in before if r.outcome == "ok" or r.finished_at >= killed_at} - committed
    only_failed_before = {cid(r.key) for r in before} - lost - committed
    assert not out.exists()

    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    check_output(out, n)

    after = {cid(r.key) for r in server.log if r.received_at >= killed_at}
    assert not (after & committed), "a committed result is never requested again"
    resent = after & lost
    assert after & {cid(r.key) for r in before} <= lost | only_failed_before
    assert len(resent) <= CONCURRENCY, "re-sent work is bounded by the requests in flight at the kill"
    assert sum(1 for v in server.ok_by_key().values() if v > 1) <= CONCURRENCY


def test_sigterm_exits_75_and_resume_finishes(tmp_path: Path, server: FakeProviderServer) -> None:
    n = 600
    server.faults = Faults(latency_s=0.03)
    src, db, out = tmp_path / "in.jsonl", tmp_path / "ledger.db", tmp_path / "out.jsonl"
    write_batch_input(src, n)
    proc = start_cli(
        tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", str(db),
        "--output", str(out), "--concurrency", "8", "--quiet",
    )
    wait_for_succeeded(db, 100)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 75, stderr
    assert stdout.splitlines()[0] == "1"
    assert "SIGTERM" in stderr and "batchrun resume 1" in stderr
    assert "Traceback" not in stderr
    counts = Counter(ledger_states(db).values())
    assert counts["running"] == 0 and counts["succeeded"] + counts["pending"] == n
    assert not out.exists()

    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    check_output(out, n)
    assert set(server.requests_by_key().values()) == {1}, "a graceful stop re-sends nothing"
