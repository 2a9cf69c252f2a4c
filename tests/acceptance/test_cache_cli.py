"""The nightly re-run from the command line: yesterday's file plus 10% new records pays only for the new ones."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import run_cli

SPEC = """
name = "nightly"
[provider]
base_url = "{base_url}"
model = "m"
[request]
template = "Label {{text}}"
max_tokens = 50
[pricing]
input_per_million = 1.0
output_per_million = 4.0
[run]
concurrency = 8
"""


def write_records(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": f"item {i}"}) + b"\n" for i in range(n)))
    return path


@pytest.mark.slow
def test_next_day_same_file_plus_ten_percent_only_new_records_reach_the_server(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(base_url=server.base_url))
    db = str(tmp_path / "ledger.db")
    day1 = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path / "day1.jsonl", 200)),
                   "--db", db, "--output", str(tmp_path / "day1.out"), "--json")
    assert day1.returncode == 0, day1.stderr
    assert orjson.loads(day1.stdout)["cached"] == 0
    assert len(server.log) == 200

    out2 = tmp_path / "day2.out"
    day2 = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path / "day2.jsonl", 220)),
                   "--db", db, "--output", str(out2), "--json")
    assert day2.returncode == 0, day2.stderr
    result = orjson.loads(day2.stdout)
    assert result["job_id"] == 2 and result["counts"]["succeeded"] == 220 and result["cached"] == 200
    new = server.log[200:]
    assert sorted(rec.key or "" for rec in new) == sorted(f"Label item {i}" for i in range(200, 220))

    lines = {x["custom_id"]: x for x in map(orjson.loads, out2.read_bytes().splitlines())}
    assert len(lines) == 220
    assert sum(1 for x in lines.values() if x.get("cached") is True) == 200
    assert all(lines[f"r{i}"].get("cached") is True for i in range(200))
    assert all("cached" not in lines[f"r{i}"] for i in range(200, 220))

    status = orjson.loads(run_cli(tmp_path, "status", "2", "--db", db, "--json").stdout)
    assert status["cached"] == 200 and status["requests"] == 20
    assert status["tokens"]["input"] == sum(rec.prompt_tokens for rec in new)
    assert status["tokens"]["output"] == sum(rec.completion_tokens for rec in new)
    expected = sum(rec.prompt_tokens * 1.0 + rec.completion_tokens * 4.0 for rec in new) / 1e6
    assert abs(status["cost_usd"] - expected) < 1e-9
    assert "reused    200" in run_cli(tmp_path, "status", "2", "--db", db).stdout

    # --no-cache: the same file again as a new job sends every record.
    day3 = run_cli(tmp_path, "submit", str(spec), "--input", str(tmp_path / "day2.jsonl"), "--db", db,
                   "--new", "--no-cache", "--json")
    assert day3.returncode == 0, day3.stderr
    assert orjson.loads(day3.stdout)["cached"] == 0
    assert len(server.log) == 200 + 20 + 220


def test_help_explains_the_cache(tmp_path: Path) -> None:
    for command in ("submit", "resume"):
        text = run_cli(tmp_path, command, "--help").stdout
        assert "--no-cache" in text
    assert "response cache" in " ".join(run_cli(tmp_path, "submit", "--help").stdout.split())
