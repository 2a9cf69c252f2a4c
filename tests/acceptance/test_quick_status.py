"""``status`` and ``list`` on a SQLite ledger at the schema head read it with sqlite3 (batchrun/ledger/quick.py):
the same bytes as through SQLAlchemy, on a ledger of real jobs in several states (answered with retries and
errors, streamed, all refused, killed mid-run, never run); and any other ledger goes through SQLAlchemy."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.ledger import Ledger
from batchrun.ledger.basics import SCHEMA_HEAD
from batchrun.ledger.quick import QuickReader, open_quick_reader
from batchrun.ledger.reading import LedgerReader
from batchrun.listing import LIST_HEADER, list_jobs, list_line
from batchrun.report import job_status, status_lines
from batchrun.testing import BatchFaults, FakeProviderServer, Faults

from .conftest import run_cli, start_cli
from .test_batch_cli import SPEC as BATCH_SPEC
from .test_kill_resume import write_batch_input
from .test_status_cli import wait_for_running

# What depends on the moment it is read (a clock, or how long ago a heartbeat was), left out of CLI output.
MOMENT_KEYS = ("as_of", "heartbeat_age_s", "age_s")
MOMENT_LINES = ("  run ", "    shard ")

SPEC = """
name = "streamed"

[provider]
kind = "openai"
base_url = "{base_url}"
model = "m"
api_key_env = "OPENAI_API_KEY"

[pricing]
input_per_million = 0.15
output_per_million = 0.6

[request]
template = "Say {{word}}"
max_tokens = 16

[run]
concurrency = 4
max_attempts = 2
stream = true
budget_usd = 5.0
"""


def submit(tmp_path: Path, *args: str, code: int = 0) -> None:
    proc = run_cli(tmp_path, "submit", *args, "--quiet")
    assert proc.returncode == code, proc.stderr


@pytest.fixture(scope="module")
def ledger_of_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A ledger with six jobs: 1 streamed, retried, some failed, a bad line, a budget; 2 stopped by the
    provider refusing its first requests (400); 3 killed mid-run (a dead run, items left running);
    4 submitted, never run; 5 in batch mode, collected; 6 in batch mode, its shard at the provider."""
    tmp_path = tmp_path_factory.mktemp("quick")
    db = tmp_path / "ledger.db"
    with FakeProviderServer(Faults(seed=7)) as server:
        server.faults = Faults(seed=7, p_500=0.2, p_429=0.05, retry_after_s=0.01, latency_s=0.002, latency_jitter_s=0.01)
        spec = tmp_path / "job.toml"
        spec.write_text(SPEC.format(base_url=server.base_url))
        records = tmp_path / "words.jsonl"
        records.write_text("".join(orjson.dumps({"id": f"w{i}", "word": f"word {i}"}).decode() + "\n" for i in range(40))
                           + "{not json\n")
        submit(tmp_path, str(spec), "--input", str(records), "--db", str(db), code=1)  # 1: some items failed

        server.faults = Faults(seed=7, status_override=400)
        refused = tmp_path / "refused.jsonl"
        write_batch_input(refused, 12)
        submit(tmp_path, "--input", str(refused), "--base-url", server.base_url, "--db", str(db), code=3)

        server.faults = Faults(seed=7, latency_s=1.0)  # answers take long: items stay running when the run is killed
        killed = tmp_path / "killed.jsonl"
        write_batch_input(killed, 200, pad=" killed")
        proc = start_cli(tmp_path, "submit", "--input", str(killed), "--base-url", server.base_url, "--db", str(db),
                         "--concurrency", "8", "--quiet")
        try:
            wait_for_running(db)
            time.sleep(0.3)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]

        never = tmp_path / "never.jsonl"
        write_batch_input(never, 5, pad=" never")
        submit(tmp_path, "--input", str(never), "--base-url", server.base_url, "--db", str(db), "--no-run")
    # Batch mode: one job whose shard came back and was collected, one whose shard is still at the provider.
    for n, turnaround, wait, code in ((6, 0.2, "--wait", 0), (9, 60.0, "--no-wait", 75)):
        with FakeProviderServer(Faults(seed=1), batch_faults=BatchFaults(turnaround_s=turnaround, seed=1)) as server:
            spec = tmp_path / f"batch{n}.toml"
            spec.write_text(BATCH_SPEC.format(base_url=server.base_url))
            data = tmp_path / f"batch{n}.jsonl"
            data.write_bytes(b"".join(orjson.dumps({"id": f"b{i}", "text": f"hello {i}"}) + b"\n" for i in range(n)))
            submit(tmp_path, str(spec), "--input", str(data), "--mode", "batch", wait, "--db", str(db), code=code)
    yield db


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """One moment for both readers (``as_of``, heartbeat ages, shard ages)."""
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)


def both_readers(db: Path) -> tuple[LedgerReader, QuickReader, Ledger]:
    ledger = Ledger.open(db)
    quick = open_quick_reader(str(db))
    assert quick is not None
    return LedgerReader(ledger), quick, ledger


@pytest.mark.slow
def test_status_and_list_are_the_same_through_both_readers(ledger_of_jobs: Path, frozen_clock: None) -> None:
    sql, quick, ledger = both_readers(ledger_of_jobs)
    try:
        seen = []
        for job_id in (1, 2, 3, 4, 5, 6):
            via_sql, via_quick = job_status(sql, job_id), job_status(quick, job_id)
            assert orjson.dumps(via_quick) == orjson.dumps(via_sql), job_id
            assert status_lines(via_quick) == status_lines(via_sql), job_id
            seen.append(via_quick)
        assert [job.to_json() for job in list_jobs(quick)] == [job.to_json() for job in list_jobs(sql)]
        assert [list_line(job) for job in list_jobs(quick)] == [list_line(job) for job in list_jobs(sql)]
    finally:
        quick.close()
        ledger.close()
    # The ledger holds what the comparison is meant to cover.
    streamed, refused, killed, never, collected, at_provider = seen
    assert streamed["ttft_ms"]["count"] > 0 and streamed["retried"] and streamed["counts"]["failed"] > 0
    assert streamed["counts"]["rejected"] == 1 and streamed["budget"] is not None and streamed["errors_by_status"]
    assert refused["counts"]["pending"] == 12 and refused["errors_by_status"]["400"]["attempts"] >= 3
    assert killed["counts"]["running"] > 0 and killed["run"]["last"]["state"] == "dead" and killed["eta_s"] is None
    assert never["run"]["last"]["command"] == "ingest" and never["counts"]["pending"] == 5
    assert collected["batch"]["answered"]["batch"] == 6 and collected["batch"]["turnaround_s"]["p50"] is not None
    assert at_provider["batch"]["at_provider"] == 9 and at_provider["batch"]["shards"][0]["eta_s"] is not None


def without_moments(value: object) -> object:
    if isinstance(value, dict):
        moments = (*MOMENT_KEYS, "eta_s") if "shard" in value else MOMENT_KEYS  # a shard's eta counts from now
        return {k: without_moments(v) for k, v in value.items() if k not in moments}
    if isinstance(value, list):
        return [without_moments(v) for v in value]
    return value


@pytest.mark.slow
def test_the_commands_print_what_the_ledger_says(ledger_of_jobs: Path, tmp_path: Path) -> None:
    """The CLI (which takes the quick reader here: tests/unit/test_startup.py) against SQLAlchemy's answers."""
    db = str(ledger_of_jobs)
    with Ledger.open(db) as ledger:
        expected = {job_id: job_status(ledger, job_id) for job_id in (1, 2, 3, 4, 5, 6)}
        listed = list_jobs(ledger)
    for job_id, data in expected.items():
        proc = run_cli(tmp_path, "status", str(job_id), "--json", "--db", db)
        assert proc.returncode == 0, proc.stderr
        assert without_moments(orjson.loads(proc.stdout)) == without_moments(data)
        text = run_cli(tmp_path, "status", str(job_id), "--db", db).stdout.splitlines()
        # Every line but the run's and a shard's (a heartbeat's or a shard's age is of the moment it is read).
        assert [line for line in text if not line.startswith(MOMENT_LINES)] == [
            line for line in status_lines(data, ledger_url=ledger.url) if not line.startswith(MOMENT_LINES)
        ]
        assert len(text) == len(status_lines(data, ledger_url=ledger.url))
    killed = run_cli(tmp_path, "status", "3", "--db", db).stdout
    running = expected[3]["counts"]["running"]
    assert f"running   {running} left by a dead run, resume to continue: batchrun resume 3 --db {db}\n" in killed
    assert "dead: no heartbeat for" in killed and "eta" not in killed
    newest = orjson.loads(run_cli(tmp_path, "status", "--json", "--db", db).stdout)  # no JOB: the newest job
    assert without_moments(newest) == without_moments(expected[6])
    assert run_cli(tmp_path, "list", "--db", db).stdout == "\n".join([LIST_HEADER, *map(list_line, listed)]) + "\n"
    assert orjson.loads(run_cli(tmp_path, "list", "--json", "--db", db).stdout) == [job.to_json() for job in listed]


def test_the_quick_reader_knows_only_the_head_revision(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    Ledger.open(db).close()
    reader = open_quick_reader(str(db))
    assert reader is not None
    reader.close()
    older, newer = f"{int(SCHEMA_HEAD) - 1:04d}", f"{int(SCHEMA_HEAD) + 1:04d}"
    for revision in (older, newer, "ffff"):  # an older schema, or one a newer batchrun migrated to
        conn = sqlite3.connect(db)
        with conn:
            conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
        conn.close()
        assert open_quick_reader(str(db)) is None, revision
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (SCHEMA_HEAD,))
        conn.execute("DROP TABLE alembic_version")
    conn.close()
    assert open_quick_reader(str(db)) is None  # not a ledger it knows
    (tmp_path / "notes.txt").write_text("not a database\n")
    assert open_quick_reader(str(tmp_path / "notes.txt")) is None
    assert open_quick_reader(str(tmp_path / "missing.db")) is None
    assert not (tmp_path / "missing.db").exists()  # read-only: nothing is created


@pytest.mark.slow
@pytest.mark.postgres
def test_a_postgresql_ledger_is_read_through_sqlalchemy(pg_url: str, tmp_path: Path) -> None:
    assert open_quick_reader(pg_url) is None
    with Ledger.open(pg_url) as ledger:
        from batchrun.spec import Overrides, spec_for_batch_input

        job_id = ledger.create_job(spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m")),
                                   input_path="in.jsonl", input_hash="h")
    env_db = pg_url
    proc = run_cli(tmp_path, "status", str(job_id), "--json", "--db", env_db)
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["job_id"] == job_id
    listed = orjson.loads(run_cli(tmp_path, "list", "--json", "--db", env_db).stdout)
    assert [job["job_id"] for job in listed] == [job_id]


@pytest.mark.slow
def test_a_distribution_read_on_its_own_thread_raises_in_the_caller(ledger_of_jobs: Path) -> None:
    reader = open_quick_reader(str(ledger_of_jobs))
    assert reader is not None
    with reader:
        both = reader.attempt_distributions(1, ("latency_ms", "ttft_ms"))
        assert both["ttft_ms"] == reader.attempt_distribution(1, "ttft_ms") and both["ttft_ms"].count > 0
        with pytest.raises(ValueError, match="cost_usd"):
            reader.attempt_distributions(1, ("latency_ms", "cost_usd"))
