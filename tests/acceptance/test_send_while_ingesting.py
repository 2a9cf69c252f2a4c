"""The CLI sends while its input is still being read (issue 18): items are workable once their
ingest batch is committed, and every promise of a whole-input ingest still holds."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli
from .test_kill_resume import cid, write_batch_input

CONCURRENCY = 16
PAD = "x" * 4000  # big lines: reading the input takes seconds while answers come back at once


def record_key(body: dict[str, Any]) -> str:
    return str(body["messages"][-1]["content"]).split(" |", 1)[0]


@pytest.fixture
def padded_server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=5), key_fn=record_key) as srv:
        yield srv


def write_input(path: Path, n: int) -> None:
    write_batch_input(path, n, pad=f" | {PAD}")


def query(db: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db, timeout=30)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def job_row(db: Path) -> tuple[int, int]:
    """(ingest_done, items stored) of job 1."""
    ((done,),) = query(db, "select ingest_done from jobs where id = 1")
    ((stored,),) = query(db, "select count(*) from items where job_id = 1")
    return int(done), int(stored)


def check_output(path: Path, n: int) -> None:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == n and set(ids) == {f"rec-{i}" for i in range(n)}, "one line per record, none twice"
    for line in lines:
        assert line["status"] == "succeeded"
        assert line["output"].startswith(f"echo: record {line['custom_id'].removeprefix('rec-')} |")


def start_submit(tmp_path: Path, server: FakeProviderServer, n: int) -> tuple[subprocess.Popen[str], Path, Path]:
    """``batchrun submit`` of ``n`` long lines, started: (the process, its ledger, its output file)."""
    src, db, out = tmp_path / "in.jsonl", tmp_path / "ledger.db", tmp_path / "out.jsonl"
    write_input(src, n)
    proc = start_cli(
        tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", str(db),
        "--output", str(out), "--concurrency", str(CONCURRENCY), "--quiet",
    )
    return proc, db, out


def wait_until(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except sqlite3.OperationalError:
            pass  # the ledger is not created yet
        time.sleep(0.005)
    raise AssertionError(f"not seen within {timeout} s: {what}")


@pytest.mark.slow
def test_a_request_goes_out_before_the_ingest_ends(tmp_path: Path, padded_server: FakeProviderServer) -> None:
    n = 16_000
    proc, db, out = start_submit(tmp_path, padded_server, n)
    try:
        wait_until("the first request", lambda: padded_server.log)
        proc.send_signal(signal.SIGSTOP)  # hold it still while we look
        done, stored = job_row(db)
        shown = run_cli(tmp_path, "status", "1", "--db", str(db)).stdout
        proc.send_signal(signal.SIGCONT)
        assert not done and stored < n, "the first request went out before the input was all stored"
        assert "finished (ingesting: the input is still being read, the total grows)" in shown, shown
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, stderr
    assert job_row(db) == (1, n)
    ((total,),) = query(db, "select total from jobs where id = 1")
    assert total == n
    check_output(out, n)
    assert set(padded_server.ok_by_key().values()) == {1}, "each record sent once"


@pytest.mark.slow
def test_sigkill_while_ingesting_and_sending_then_resume(tmp_path: Path, padded_server: FakeProviderServer) -> None:
    n = 16_000
    padded_server.faults = Faults(latency_s=0.01, p_500=0.02, seed=9)
    proc, db, out = start_submit(tmp_path, padded_server, n)
    try:
        succeeded = "select count(*) from items where state = 'succeeded'"
        # The first committed answers, not many: on a quiet machine the input is all read soon after
        # (50 answers came after the whole input once).
        wait_until("the first answers committed", lambda: query(db, succeeded)[0][0] >= 1, timeout=60)
        proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.communicate()
    done, stored = job_row(db)
    assert not done and 0 < stored < n, "killed while the input was still being read"
    assert not out.exists(), "a job is never exported before its whole input is in"
    shown = run_cli(tmp_path, "status", "1", "--db", str(db)).stdout
    assert f"{stored} total" in shown and "(input read in part: the run reading it is gone; resume reads the rest)" in shown
    assert "still being read" not in shown, shown
    time.sleep(0.2)  # the server notices the dropped connections
    committed = {c for (c,) in query(db, "select custom_id from items where state in ('succeeded', 'failed')")}
    before = [r for r in padded_server.log if r.received_at < killed_at]
    lost = {cid(r.key) for r in before if r.outcome == "ok" or r.finished_at >= killed_at} - committed

    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out), "--quiet",
                      "--concurrency", str(CONCURRENCY), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert job_row(db) == (1, n)
    ((lines, ids),) = query(db, "select count(distinct line), count(distinct custom_id) from items")
    assert lines == ids == n, "every input line stored once"
    check_output(out, n)
    after = {cid(r.key) for r in padded_server.log if r.received_at >= killed_at}
    assert not (after & committed), "a committed result is never requested again"
    assert len(after & lost) <= CONCURRENCY, "re-sent work is bounded by the requests in flight at the kill"
    assert sum(1 for v in padded_server.ok_by_key().values() if v > 1) <= CONCURRENCY


@pytest.mark.slow
def test_overlapping_submits_find_one_job_and_one_ingester(tmp_path: Path, padded_server: FakeProviderServer) -> None:
    n = 8_000
    src, db, out = tmp_path / "in.jsonl", tmp_path / "ledger.db", tmp_path / "out.jsonl"
    write_input(src, n)
    args = ("submit", "--input", str(src), "--base-url", padded_server.base_url, "--db", str(db),
            "--output", str(out), "--concurrency", str(CONCURRENCY), "--quiet")
    procs = [start_cli(tmp_path, *args) for _ in range(3)]
    codes = []
    for proc in procs:
        proc.communicate(timeout=300)
        codes.append(proc.returncode)
    assert sorted(codes)[0] == 0 and set(codes) <= {0, 75}, codes
    assert query(db, "select count(*) from jobs") == [(1,)]
    if 0 not in codes[1:] or codes.count(0) < 3:  # a locked one is carried on by a later submit
        again = run_cli(tmp_path, *args, timeout=300)
        assert again.returncode == 0, again.stderr
    ((lines, rows),) = query(db, "select count(distinct line), count(*) from items")
    assert lines == rows == n, "every line stored once, by one ingester"
    check_output(out, n)
    assert set(padded_server.ok_by_key().values()) == {1}


@pytest.mark.slow
def test_sigterm_mid_ingest_exits_75_and_resume_finishes(tmp_path: Path, padded_server: FakeProviderServer) -> None:
    n = 16_000
    proc, db, out = start_submit(tmp_path, padded_server, n)
    try:
        wait_until("an answer committed", lambda: query(db, "select count(*) from items where state = 'succeeded'")[0][0])
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 75, stderr
    assert "batchrun resume 1" in stderr
    done, stored = job_row(db)
    assert not done and stored < n
    assert Counter(s for (s,) in query(db, "select state from items"))["running"] == 0
    assert not out.exists()
    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out), "--quiet", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    check_output(out, n)
    assert set(padded_server.ok_by_key().values()) == {1}


@pytest.mark.slow
def test_cancel_while_the_input_is_read_stops_sending_and_cancels_the_rest(
    tmp_path: Path, padded_server: FakeProviderServer
) -> None:
    padded_server.faults = Faults(latency_s=0.01, seed=2)
    src, db = tmp_path / "in.jsonl", tmp_path / "ledger.db"
    write_input(src, 20_000)
    proc = start_cli(tmp_path, "submit", "--input", str(src), "--base-url", padded_server.base_url, "--db", str(db),
                     "--concurrency", str(CONCURRENCY), "--quiet", "--max-runtime", "120")
    try:
        wait_until("an answer", lambda: query(db, "select count(*) from items where state = 'succeeded'")[0][0])
        assert query(db, "select ingest_done from jobs") == [(0,)]  # still reading
        cancelled = run_cli(tmp_path, "cancel", "1", "--db", str(db))
        assert cancelled.returncode == 0, cancelled.stderr
        at = time.time()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.communicate()
    # cancel returns once the run has ended: 1 when the ingest had read the whole input by then (every
    # item succeeded or cancelled), 75 when it stopped with the run (its rest comes in cancelled below)
    assert proc.returncode in (1, 75), err
    late = [r for r in padded_server.log if r.received_at > at]
    assert not late, f"{len(late)} requests after cancel returned"
    states = dict(query(db, "select state, count(*) from items group by state"))
    assert set(states) <= {"cancelled", "succeeded"}, states
    # A resume reads the rest of the input, and it comes in cancelled: nothing more is sent.
    sent = len(padded_server.log)
    again = run_cli(tmp_path, "resume", "1", "--db", str(db), "--quiet")
    assert again.returncode == 1, again.stderr
    states = dict(query(db, "select state, count(*) from items group by state"))
    assert set(states) <= {"cancelled", "succeeded"} and sum(states.values()) == 20_000, states
    assert len(padded_server.log) == sent
    assert query(db, "select ingest_done from jobs") == [(1,)]


@pytest.mark.slow
def test_input_that_breaks_while_read_beside_the_run_exits_2(tmp_path: Path, padded_server: FakeProviderServer) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 40_000
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"record {i} " + "x" * 50 for i in range(n)]}), src,
                   row_group_size=2000, compression="NONE")
    data = bytearray(src.read_bytes())
    page = pq.ParquetFile(src).metadata.row_group(18).column(0).data_page_offset
    data[page + 10:page + 400] = b"\xab" * 390  # row group 18 cannot be read
    src.write_bytes(bytes(data))
    spec = tmp_path / "s.toml"
    spec.write_text(f'[provider]\nbase_url = "{padded_server.base_url}"\nmodel = "m"\napi_key_env = ""\n'
                    '[request]\ntemplate = "{text}"\n[run]\nconcurrency = 16\n')
    db = tmp_path / "l.db"
    for args in (("submit", str(spec), "--input", str(src)), ("resume", "1")):
        proc = run_cli(tmp_path, *args, "--db", str(db), "--quiet")
        assert proc.returncode == 2, proc.stderr
        assert "the rest of the input cannot be read" in proc.stderr and "Traceback" not in proc.stderr
        assert "carry on with" not in proc.stderr  # resuming would read the same bad bytes
    stored = query(db, "select count(*) from items")[0][0]
    assert stored < n and len(padded_server.log) < n
