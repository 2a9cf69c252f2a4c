"""Issue 14 with real processes: a run frozen (SIGSTOP) past its lock's staleness while another takes
the job over, then woken (SIGCONT); a kill during re-asks. Nothing lost, nothing answered twice
beyond the run's concurrency, output exact; both ledgers.

The specs here set ``[run] lease_seconds = 4``: the job lock is stale after 2 s, so a
freeze of 3 s stands for the minutes of a suspended laptop or a paused VM.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from batchrun.ledger import resolve_db_url
from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli

CONCURRENCY = 16
LEASE = 4.0  # the lock goes stale after LEASE / 2
SPEC = """
[provider]
kind = "openai"
base_url = "{base_url}"
model = "m"

[run]
concurrency = {concurrency}
lease_seconds = {lease}
grace_seconds = 2
"""
SCHEMA_SPEC = """
[provider]
kind = "openai"
base_url = "{base_url}"
model = "m"

[request]
template = "record {{n}}"

[output]
schema = {{ type = "object", properties = {{ answer = {{ type = "string" }} }}, required = ["answer"] }}
validation_retries = 2

[run]
concurrency = {concurrency}
lease_seconds = 60
grace_seconds = 2
"""


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = create_engine(resolve_db_url(db_url))
    yield eng
    eng.dispose()


def states(engine: Engine) -> Counter[str]:
    try:
        with engine.connect() as conn:
            return Counter(dict(conn.execute(text("select state, count(*) from items group by state")).all()))
    except Exception:  # not created yet
        return Counter()


def wait_until(predicate: object, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def write_spec(tmp_path: Path, server: FakeProviderServer, template: str = SPEC, **fields: object) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(template.format(base_url=server.base_url, concurrency=CONCURRENCY, lease=LEASE, **fields))
    return path


def batch_input(path: Path, n: int, *, bad_every: int = 0) -> set[str]:
    """``n`` OpenAI batch lines; every ``bad_every``-th a bad one (not JSON, or a repeated custom_id)."""
    ids = set()
    with open(path, "wb") as f:
        for i in range(1, n + 1):
            if bad_every and i % bad_every == 0:
                f.write(b"{not json\n" if i % (2 * bad_every) else orjson.dumps({**_line(1), "x": i}) + b"\n")
                continue
            f.write(orjson.dumps(_line(i)) + b"\n")
            ids.add(f"r{i}")
    return ids


def _line(i: int) -> dict[str, object]:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"record {i}"}]}}


def exported(path: Path) -> dict[str, dict[str, object]]:
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "one output line per custom_id"
    return by_id


def one_row_per_line(engine: Engine, n: int) -> None:
    with engine.connect() as conn:
        rows, lines, lo, hi = conn.execute(
            text("select count(*), count(distinct line), min(line), max(line) from items where job_id = 1")
        ).one()
    assert (rows, lines, lo, hi) == (n, n, 1, n), "every input line stored once"


@pytest.mark.slow
def test_a_frozen_run_taken_over_stops_and_pays_for_nothing_twice(
    tmp_path: Path, db_url: str, engine: Engine
) -> None:
    """Case 2: frozen past the lock's staleness, taken over by `resume`, then woken: the run exits 75
    within seconds and sends nothing it no longer owns; re-sent answers stay within its concurrency.

    A run frozen in the middle of a write holds that write: the resume waits for those rows
    (PostgreSQL) or for the file (SQLite) until the frozen run is woken. On SQLite the woken run
    may then renew its lock before the resume gets the file: the resume exits 75 (locked) and
    the woken run, still the holder, finishes the job itself.
    """
    n = 1500
    with FakeProviderServer(Faults(latency_s=0.05, latency_jitter_s=0.05, seed=5)) as server:
        spec, src, out = write_spec(tmp_path, server), tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        ids = batch_input(src, n)
        first = start_cli(tmp_path, "submit", str(spec), "--input", str(src), "--db", db_url, "--quiet")
        wait_until(lambda: states(engine)["succeeded"] >= 200, what="200 answers")
        first.send_signal(signal.SIGSTOP)
        time.sleep(LEASE / 2 + 1)
        second = start_cli(tmp_path, "resume", "1", "--db", db_url, "--output", str(out), "--quiet")
        try:
            second.wait(timeout=8)
        except subprocess.TimeoutExpired:
            pass  # waiting for rows (PostgreSQL) or the file (SQLite) the frozen run holds
        woken = time.monotonic()
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=60)
        stopped_in = time.monotonic() - woken
        _, second_err = second.communicate(timeout=60)

        assert "Traceback" not in err + second_err
        if second.returncode == 75:  # SQLite: the frozen run held the file's write lock; woken, it kept the job
            assert ("stayed locked" in second_err or "is being worked by" in second_err), second_err
            assert first.returncode == 0, err
            assert run_cli(tmp_path, "export", "1", "--db", db_url, "--output", str(out)).returncode == 0
        else:
            assert second.returncode == 0, second_err
            assert first.returncode == 75 and "taken over" in err, err
            assert stopped_in < 10
        by_id = exported(out)
        assert set(by_id) == ids
        assert all(line["output"] == f"echo: record {cid[1:]}" for cid, line in by_id.items())
        twice = sum(k - 1 for k in server.ok_by_key().values() if k > 1)
        assert twice <= CONCURRENCY, f"{twice} answers paid twice"
    assert states(engine) == Counter(succeeded=n)


@pytest.mark.slow
def test_an_overlapping_submit_during_a_frozen_ingest_stores_every_line_once(
    tmp_path: Path, db_url: str, engine: Engine
) -> None:
    """Case 1: the first submit freezes mid-ingest; a second submit of the same job takes the ingest
    over; the first, woken, writes nothing more. Every line is stored once (bad lines as one
    rejected row each), and the export lists every good record exactly once."""
    n = 16_000  # four batches: the freeze comes after the first
    with FakeProviderServer(Faults(seed=7)) as server:
        spec, src, out = write_spec(tmp_path, server), tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        ids = batch_input(src, n, bad_every=97)
        first = start_cli(tmp_path, "submit", str(spec), "--input", str(src), "--db", db_url, "--quiet",
                          "--no-run")
        wait_until(lambda: sum(states(engine).values()) > 0, what="the first batch")
        first.send_signal(signal.SIGSTOP)
        time.sleep(LEASE / 2 + 1)
        second = start_cli(tmp_path, "submit", str(spec), "--input", str(src), "--db", db_url, "--quiet",
                           "--output", str(out), "--concurrency", "128")
        try:
            second.wait(timeout=5)  # it may wait for the frozen one's write to end
        except subprocess.TimeoutExpired:
            pass
        first.send_signal(signal.SIGCONT)
        _, first_err = first.communicate(timeout=60)
        _, second_err = second.communicate(timeout=120)
        assert "Traceback" not in first_err + second_err
        assert first.returncode == 75 and "taken over" in first_err, first_err
        assert second.returncode in (1, 75), second_err  # 1: finished, the bad lines rejected
        if second.returncode == 75 or not out.exists():
            again = run_cli(tmp_path, "resume", "1", "--db", db_url, "--output", str(out), "--quiet",
                            "--concurrency", "128")
            assert again.returncode == 1, again.stderr
        one_row_per_line(engine, n)
        by_id = exported(out)
        good = {cid for cid, line in by_id.items() if line["status"] == "succeeded"}
        assert good == ids
        assert all(by_id[cid]["output"] == f"echo: record {cid[1:]}" for cid in ids)
        assert set(server.requests_by_key().values()) == {1}, "nothing was sent twice"
    counts = states(engine)
    assert counts["succeeded"] == len(ids) and counts["rejected"] == n - len(ids)


def resent_questions(server: FakeProviderServer, event_at: float) -> set[tuple[str, int]]:
    """Questions paid for before ``event_at`` (answered, or still open then) and asked again after it.

    A question is (record, how many invalid answers it carries): the first ask and each re-ask."""
    paid: set[tuple[str, int]] = set()
    asked_after: set[tuple[str, int]] = set()
    for record, body in zip(server.log, server.bodies, strict=True):
        question = (record.key or "", sum(m["role"] == "assistant" for m in body["messages"]))
        if record.received_at < event_at and (record.outcome == "ok" or record.finished_at >= event_at):
            paid.add(question)
        elif record.received_at >= event_at:
            asked_after.add(question)
    return paid & asked_after


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_stop_during_re_asks_re_sends_at_most_the_concurrency(
    tmp_path: Path, db_url: str, engine: Engine, how: signal.Signals
) -> None:
    """Case 7: re-ask state is committed before the re-ask is sent, so a resume carries on from the
    last committed re-ask instead of paying for the first answer again: after a kill at most the
    requests in flight are asked again; after SIGTERM (in-flight requests finish) none."""
    n = 300
    faults = Faults(latency_s=0.2, latency_jitter_s=0.05, p_schema_violation=1.0, output_faults_on_reask=False, seed=9)
    with FakeProviderServer(faults, record_bodies=True) as server:
        spec = write_spec(tmp_path, server, SCHEMA_SPEC)
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        src.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "n": i}) + b"\n" for i in range(n)))
        first = start_cli(tmp_path, "submit", str(spec), "--input", str(src), "--db", db_url, "--quiet")
        wait_until(lambda: states(engine)["succeeded"] >= 80, what="80 answers")
        first.send_signal(how)
        stopped_at = time.time()
        first.communicate(timeout=30)
        assert first.returncode == (-signal.SIGKILL if how == signal.SIGKILL else 75)
        time.sleep(0.3)  # the server notices the dropped connections
        resumed = run_cli(tmp_path, "resume", "1", "--db", db_url, "--output", str(out), "--quiet")
        assert resumed.returncode == 0, resumed.stderr
        assert len(exported(out)) == n
        resent = resent_questions(server, stopped_at)
        bound = CONCURRENCY if how == signal.SIGKILL else 0
        assert len(resent) <= bound, f"{len(resent)} paid questions asked again after {how.name}: {sorted(resent)[:5]}"
