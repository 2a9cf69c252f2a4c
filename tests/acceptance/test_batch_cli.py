"""Batch mode from the command line: --mode, --wait/--no-wait under cron, status and cancel of shards,
the dry run's batch price, and `batchrun demo --mode batch`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.testing import BatchFaults, FakeProviderServer, Faults

from .conftest import run_cli

SPEC = """
[provider]
base_url = "{base_url}"
model = "gpt-4o-mini"
[request]
template = "Say {{text}}"
max_tokens = 30
[batch]
poll_interval = 0.1
poll_max = 0.3
"""


@pytest.fixture
def slow_batches() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=1), batch_faults=BatchFaults(turnaround_s=30.0, seed=1)) as srv:
        yield srv


def write_job(tmp_path: Path, server: FakeProviderServer, n: int) -> tuple[Path, Path]:
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(base_url=server.base_url))
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": f"hello {i}"}) + b"\n" for i in range(n)))
    return spec, data


@pytest.mark.slow
def test_no_wait_leaves_the_batch_at_the_provider_and_a_later_run_collects_it(tmp_path: Path) -> None:
    with FakeProviderServer(Faults(seed=1), batch_faults=BatchFaults(turnaround_s=1.0, seed=1)) as server:
        spec, data = write_job(tmp_path, server, 12)
        db = str(tmp_path / "l.db")
        out = tmp_path / "out.jsonl"
        first = run_cli(tmp_path, "submit", str(spec), "--input", str(data), "--mode", "batch", "--no-wait",
                        "--db", db, "--output", str(out), "--json")
        assert first.returncode == 75, first.stderr
        result = orjson.loads(first.stdout)
        assert result["counts"]["submitted"] == 12 and result["stop_reason"] == "at_provider"
        # the hint names the ledger (issue 17): pasted as is, it collects this job, not the default ledger's
        assert f"12 items at the provider in 1 batches; `batchrun resume 1 --db {db}` collects them" in first.stderr
        status = orjson.loads(run_cli(tmp_path, "status", "1", "--db", db, "--json").stdout)
        assert status["batch"]["at_provider"] == 12 and status["batch"]["shards"][0]["state"] == "live"
        text = run_cli(tmp_path, "status", "1", "--db", db).stdout
        assert "12 items at the provider" in text and "shard 1: live" in text
        # The next cron run (the same submit) collects it once it has ended.
        for _ in range(40):
            again = run_cli(tmp_path, "submit", str(spec), "--input", str(data), "--mode", "batch", "--no-wait",
                            "--db", db, "--output", str(out))
            if again.returncode != 75:
                break
        assert again.returncode == 0, again.stderr
        lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(12))
        assert {x["status"] for x in lines} == {"succeeded"}
        assert server.billed_by_key() and set(server.billed_by_key().values()) == {1}
        status = orjson.loads(run_cli(tmp_path, "status", "1", "--db", db, "--json").stdout)
        assert status["batch"]["answered"] == {"batch": 12, "online": 0, "cache": 0}


@pytest.mark.slow
def test_cancel_cancels_the_live_batch_at_the_provider(tmp_path: Path, slow_batches: FakeProviderServer) -> None:
    spec, data = write_job(tmp_path, slow_batches, 8)
    db = str(tmp_path / "l.db")
    first = run_cli(tmp_path, "submit", str(spec), "--input", str(data), "--mode", "batch", "--no-wait", "--db", db)
    assert first.returncode == 75, first.stderr
    cancelled = run_cli(tmp_path, "cancel", "1", "--db", db)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "1 provider batches (8 items) cancelled at the provider" in cancelled.stderr
    assert any(call.endswith("/cancel") for call in slow_batches.batch_calls())
    for _ in range(40):
        done = run_cli(tmp_path, "resume", "1", "--db", db, "--no-wait", "--json")
        if done.returncode != 75:
            break
    assert done.returncode == 1, done.stderr  # finished; what the batch never worked is cancelled
    counts = orjson.loads(done.stdout)["counts"]
    assert counts["cancelled"] + counts["succeeded"] == 8 and counts["cancelled"] > 0


@pytest.mark.slow
def test_the_dry_run_quotes_the_batch_price(tmp_path: Path, slow_batches: FakeProviderServer) -> None:
    spec, data = write_job(tmp_path, slow_batches, 10)
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(data), "--mode", "batch", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    report = orjson.loads(proc.stdout)
    assert report["mode"] == "batch"
    assert report["batch_cost_usd"]["max"] == pytest.approx(report["cost_usd"]["max"] / 2)
    text = run_cli(tmp_path, "submit", str(spec), "--input", str(data), "--mode", "batch", "--dry-run").stdout
    assert "through the provider's batch API" in text


@pytest.mark.slow
def test_demo_in_batch_mode(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "demo", "--mode", "batch", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "requests created as" in proc.stderr or "found at the provider" in proc.stderr
    output_line = next(line for line in proc.stdout.splitlines() if line.startswith("output: "))
    path = Path(output_line.removeprefix("output: ").split(" (")[0])
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert len(lines) == 200 and {x["status"] for x in lines} == {"succeeded"}
