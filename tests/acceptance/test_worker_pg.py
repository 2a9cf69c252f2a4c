"""``batchrun worker`` processes over one real PostgreSQL ledger (issue 6).

Workers, the fake server and the CLI commands each run as their own process;
the server logs every request it receives (key, outcome, time) to a file, so
what was sent is counted independently of batchrun. One worker is SIGKILLed
midway; PostgreSQL itself is restarted under running workers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from sqlalchemy import create_engine, text

from batchrun.ledger.engine import PG_IDLE_IN_TRANSACTION_S

from .conftest import batchrun_cmd, cli_env, run_cli, start_cli
from .test_kill_resume import check_output, write_batch_input

pytestmark = pytest.mark.postgres

LATENCY = 0.02
CONCURRENCY = 16
LEASE = "5s"


class LoggedServer:
    """``python -m batchrun.testing serve --log``: its own process, its own count of every request."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.log_path = tmp_path / "server.jsonl"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchrun.testing", "serve", "--port", "0", "--log", str(self.log_path), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), line + self.proc.stderr.read()  # type: ignore[union-attr]
        self.base_url = line.split()[-1]
        self.requests: list[dict[str, object]] = []

    def stop(self) -> list[dict[str, object]]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.communicate(timeout=30)
        self.requests = [orjson.loads(line) for line in self.log_path.read_bytes().splitlines()]
        return self.requests


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[LoggedServer]:
    server = LoggedServer(tmp_path, "--latency", str(LATENCY))
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.communicate()


def pg_counts(url: str) -> Counter[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return Counter(dict(conn.execute(text("select state, count(*) from items group by state")).all()))
    finally:
        engine.dispose()


def wait_for(url: str, done_at_least: int, procs: list[subprocess.Popen[str]], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pg_counts(url)["succeeded"] >= done_at_least:
            return
        for p in procs:
            assert p.poll() is None, f"worker ended early ({p.returncode}): {p.communicate()[1]}"
        time.sleep(0.1)
    raise AssertionError(f"fewer than {done_at_least} items succeeded within {timeout} s")


def submit(tmp_path: Path, url: str, server: LoggedServer, n: int, *extra: str) -> str:
    src = tmp_path / "in.jsonl"
    write_batch_input(src, n)
    proc = run_cli(tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", url, "--no-run", *extra)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.splitlines()[0]
    assert pg_counts(url)["pending"] == n
    return job


def start_workers(tmp_path: Path, url: str, job: str, count: int, *extra: str) -> list[subprocess.Popen[str]]:
    return [
        start_cli(
            tmp_path, "worker", job, "--db", url, "--concurrency", str(CONCURRENCY), "--lease", LEASE,
            "--poll", "0.5", "--exit-when-idle", "--quiet", *extra,
        )
        for _ in range(count)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = 150) -> str:
    """Wait for workers to exit 0 (idle); their stderr."""
    errs = []
    for p in procs:
        _, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr
        assert "Traceback" not in stderr
        errs.append(stderr)
    return "".join(errs)


def held_by(url: str, pid: int) -> int:
    """Items leased to the runs of process ``pid``."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "select count(*) from items i join runs r on r.id = i.lease_owner where i.state = 'running' and r.pid = :pid"
            ), {"pid": pid}).scalar_one())
    finally:
        engine.dispose()


def export(tmp_path: Path, url: str, job: str, n: int) -> None:
    out = tmp_path / "out.jsonl"
    proc = run_cli(tmp_path, "export", job, "--db", url, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    check_output(out, n)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def resent_keys(requests: list[dict[str, object]]) -> int:
    """Keys (records) the server was asked for more than once."""
    return sum(1 for n in Counter(r["key"] for r in requests).values() if n > 1)


@pytest.mark.slow
def test_four_workers_one_killed_every_item_once(tmp_path: Path, pg_url: str, fake_server: LoggedServer) -> None:
    n = 20_000
    job = submit(tmp_path, pg_url, fake_server, n)
    workers = start_workers(tmp_path, pg_url, job, 4)
    try:
        wait_for(pg_url, n // 3, workers)
        held = held_by(pg_url, workers[0].pid)
        kill(workers[0])
        killed_at = time.time()
        stderr = finish(workers[1:])
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert pg_counts(pg_url) == Counter({"succeeded": n})
    export(tmp_path, pg_url, job, n)
    requests = fake_server.stop()
    assert all(r["outcome"] == "ok" for r in requests)
    resent = resent_keys(requests)
    # Only what the killed worker had in flight (or answered but not committed) is sent again.
    assert resent <= CONCURRENCY, resent
    # The killed worker held items; a live worker's sweep put them back once their lease expired.
    assert held > 0 and "whose lease expired" in stderr
    assert sum(1 for r in requests if float(r["received_at"]) > killed_at) > 0  # type: ignore[arg-type]
    print(f"\n{n} items, 4 workers, one SIGKILLed holding {held}: {len(requests)} requests, {resent} keys re-sent")


@pytest.mark.slow
def test_a_frozen_worker_sends_nothing_it_lost(tmp_path: Path, pg_url: str, fake_server: LoggedServer) -> None:
    """Issue 14, cases 2 and 6: a worker frozen (SIGSTOP) past its lease, its items swept back and
    worked by another, then woken: its heartbeat tells it which items it lost and it sends none of
    them again; an answer it had in flight lands only if the item has none yet. Re-sent records
    stay within its concurrency, every item is answered once in the ledger."""
    n = 4000
    job = submit(tmp_path, pg_url, fake_server, n)
    workers = start_workers(tmp_path, pg_url, job, 2)
    try:
        wait_for(pg_url, n // 4, workers)
        workers[0].send_signal(signal.SIGSTOP)
        # Past its lease the other worker sweeps its items back (if it froze inside a transaction,
        # once PostgreSQL has ended that session: PG_IDLE_IN_TRANSACTION_S, which it mostly does).
        deadline = time.monotonic() + float(LEASE.removesuffix("s")) + PG_IDLE_IN_TRANSACTION_S + 5
        while held_by(pg_url, workers[0].pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        workers[0].send_signal(signal.SIGCONT)
        stderr = finish(workers)
    finally:
        for p in workers:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.communicate()
    assert "whose lease expired" in stderr
    assert pg_counts(pg_url) == Counter({"succeeded": n})
    export(tmp_path, pg_url, job, n)
    requests = fake_server.stop()
    assert resent_keys(requests) <= CONCURRENCY, resent_keys(requests)


@pytest.mark.slow
def test_job_wide_rpm_is_held_across_workers(tmp_path: Path, pg_url: str, fake_server: LoggedServer) -> None:
    rpm, n = 1800, 1500  # 30/s: ~50 s of work whatever the number of workers
    job = submit(tmp_path, pg_url, fake_server, n, "--rpm", str(rpm))
    workers = start_workers(tmp_path, pg_url, job, 4)
    try:
        wait_for(pg_url, n // 3, workers)
        kill(workers[0])
        finish(workers[1:])
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert pg_counts(pg_url) == Counter({"succeeded": n})
    export(tmp_path, pg_url, job, n)
    requests = fake_server.stop()
    assert resent_keys(requests) <= CONCURRENCY
    times = sorted(float(r["received_at"]) for r in requests)  # type: ignore[arg-type]
    span = times[-1] - times[0]
    achieved = (len(times) - 1) / span * 60.0
    # In any 60 s window (here the run is shorter than a minute: all of it, and every 20 s window).
    windows = [sum(1 for t in times[i:] if t < start + 20.0) for i, start in enumerate(times)]
    print(f"\nrpm {rpm}: achieved {achieved:.0f}/min over {span:.1f} s, busiest 20 s {max(windows)} "
          f"(limit {rpm / 3:.0f}), {len(times)} requests")
    assert len(times) <= rpm * 1.05 * max(1.0, span / 60.0)
    assert max(windows) <= rpm / 3 * 1.05
    assert rpm * 0.95 <= achieved <= rpm * 1.0


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("pg_ctlcluster") is None or os.geteuid() != 0, reason="needs root and Debian's pg_ctlcluster"
)
def test_postgres_restart_mid_run_is_survived(tmp_path: Path, pg_url: str, fake_server: LoggedServer) -> None:
    n = 6000
    job = submit(tmp_path, pg_url, fake_server, n)
    workers = start_workers(tmp_path, pg_url, job, 2)
    try:
        wait_for(pg_url, n // 3, workers)
        before = pg_counts(pg_url)["succeeded"]
        try:
            restart = subprocess.run(["pg_ctlcluster", "15", "main", "restart"], capture_output=True, text=True,
                                     timeout=60)
            assert restart.returncode == 0, restart.stderr
        finally:
            ensure_postgres_running()
        stderr = finish(workers)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert before < n, "the restart happened mid-run"
    assert pg_counts(pg_url) == Counter({"succeeded": n})
    export(tmp_path, pg_url, job, n)
    requests = fake_server.stop()
    # The workers saw the database go, waited for it and carried on.
    assert "ledger unreachable" in stderr and "ledger reachable again" in stderr
    # Answers received while the database was down were kept and committed afterwards: at most
    # an item whose lease ran out meanwhile is sent again.
    resent = resent_keys(requests)
    assert resent <= 2 * CONCURRENCY
    print(f"\nPostgreSQL restarted at {before}/{n} done: {len(requests)} requests, {resent} keys re-sent")


def ensure_postgres_running() -> None:
    status = subprocess.run(["pg_ctlcluster", "15", "main", "status"], capture_output=True)
    if status.returncode != 0:
        subprocess.run(["pg_ctlcluster", "15", "main", "start"], capture_output=True, timeout=60)


@pytest.mark.slow
def test_sigterm_gives_the_items_back_and_exits_75(tmp_path: Path, pg_url: str, fake_server: LoggedServer) -> None:
    n = 3000
    job = submit(tmp_path, pg_url, fake_server, n)
    worker = start_cli(tmp_path, "worker", "--db", pg_url, "--concurrency", "8", "--quiet")  # every job
    try:
        wait_for(pg_url, 300, [worker])
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 75, stderr
    assert "SIGTERM" in stderr and "Traceback" not in stderr
    counts = pg_counts(pg_url)
    assert counts["running"] == 0 and counts["succeeded"] + counts["pending"] == n and counts["pending"] > 0
    log_file = tmp_path / "worker.jsonl"
    again = run_cli(tmp_path, "worker", job, "--db", pg_url, "--exit-when-idle", "--quiet", "--log-file", str(log_file))
    assert again.returncode == 0, again.stderr
    assert f"jobs {job}: " in again.stdout
    records = [orjson.loads(line) for line in log_file.read_bytes().splitlines()]
    assert any(r["logger"] == "batchrun.worker" and f"working job {job}" in r["message"] for r in records)
    export(tmp_path, pg_url, job, n)
    assert set(Counter(r["key"] for r in fake_server.stop()).values()) == {1}, "a graceful stop re-sends nothing"


def test_worker_log_file_that_cannot_be_opened_is_a_usage_error(tmp_path: Path, pg_url: str) -> None:
    proc = run_cli(tmp_path, "worker", "--db", pg_url, "--exit-when-idle", "--log-file", str(tmp_path / "no" / "x.jsonl"))
    assert proc.returncode == 2 and "--log-file" in proc.stderr and "Traceback" not in proc.stderr


def test_worker_refuses_a_sqlite_ledger(tmp_path: Path) -> None:
    proc = subprocess.run(batchrun_cmd("worker", "--db", str(tmp_path / "l.db")), capture_output=True, text=True,
                          env=cli_env(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "needs a PostgreSQL ledger" in proc.stderr and "batchrun resume" in proc.stderr
    assert not (tmp_path / "l.db").exists()
