"""``--budget-usd`` as a user meets it: exit 4 at the cap, status shows it, resume with more finishes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli

SPEC = """
name = "budgeted"
[provider]
base_url = "{base_url}"
model = "m"
[request]
template = "Say {{text}}"
max_tokens = 40
[pricing]
input_per_million = 1000.0
output_per_million = 4000.0
[run]
concurrency = 16
{run}
"""


def write_spec(tmp_path: Path, server: FakeProviderServer, run: str = "", name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(SPEC.format(base_url=server.base_url, run=run))
    return path


def write_records(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": f"hello {i:03d} " * 8}) + b"\n" for i in range(n)))
    return path


def billed(server: FakeProviderServer) -> float:
    return sum(r.prompt_tokens * 1000.0 + r.completion_tokens * 4000.0 for r in server.log if r.status == 200) / 1e6


@pytest.mark.slow
def test_budget_stops_with_exit_4_and_resume_with_more_finishes(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.02)
    spec, records, db, out = write_spec(tmp_path, server), write_records(tmp_path, 80), tmp_path / "l.db", tmp_path / "out.jsonl"

    first = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out),
                    "--budget-usd", "5", "--quiet")

    assert first.returncode == 4, first.stderr
    assert first.stdout.splitlines()[0] == "1"
    assert "batchrun: budget of $5.00 reached: $" in first.stderr
    assert "carry on with a larger total budget: batchrun resume 1 --budget-usd AMOUNT" in first.stderr
    assert "Traceback" not in first.stderr
    assert not out.exists()  # exported only when the job is finished
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--db", str(db), "--json").stdout)
    spent = status["cost_usd"]
    assert 0 < spent <= 5 and spent == pytest.approx(billed(server))
    assert status["budget"] == {"limit_usd": 5.0, "spent_usd": spent, "remaining_usd": pytest.approx(5 - spent)}
    assert status["counts"]["pending"] + status["counts"]["succeeded"] == 80 and status["counts"]["pending"] > 0
    text = run_cli(tmp_path, "status", "1", "--db", str(db)).stdout
    assert "budget    $5 as submitted" in text

    again = run_cli(tmp_path, "resume", "1", "--db", str(db), "--quiet")  # the budget is the job's total: still spent
    assert again.returncode == 4
    sent = len(server.log)

    more = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out), "--budget-usd", "50", "--json")

    assert more.returncode == 0, more.stderr
    assert orjson.loads(more.stdout)["counts"]["succeeded"] == 80
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(80))  # each once
    assert len(server.log) == sent + status["counts"]["pending"]  # only what was left was sent
    assert set(server.requests_by_key().values()) == {1}
    final = orjson.loads(run_cli(tmp_path, "status", "1", "--db", str(db), "--json").stdout)
    assert final["cost_usd"] == pytest.approx(billed(server)) and final["cost_usd"] <= 50


@pytest.mark.slow
def test_spec_budget_and_bad_budgets(tmp_path: Path, server: FakeProviderServer) -> None:
    records, db = write_records(tmp_path, 30), tmp_path / "l.db"
    in_spec = write_spec(tmp_path, server, "budget_usd = 2.0")
    proc = run_cli(tmp_path, "submit", str(in_spec), "--input", str(records), "--db", str(db), "--quiet", "--json")
    assert proc.returncode == 4
    assert orjson.loads(proc.stdout)["stop_reason"] == "budget"
    assert 0 < billed(server) <= 2.0

    for run, message in (
        ("budget_usd = 0", "[run] budget_usd = 0.0: expected a total in USD > 0"),
        ("budget_usd = -3", "[run] budget_usd = -3.0: expected a total in USD > 0"),
        ("budget_usd = inf", "[run] budget_usd = inf: expected a finite number"),
        ("budget_usd = 'ten'", "[run] budget_usd = 'ten': expected a number"),
    ):
        bad = run_cli(tmp_path, "submit", str(write_spec(tmp_path, server, run, "bad.toml")), "--input", str(records),
                      "--db", str(db))
        assert bad.returncode == 2 and message in bad.stderr, (run, bad.stderr)
    for value in ("0", "-1", "nan", "lots"):
        flag = run_cli(tmp_path, "submit", str(write_spec(tmp_path, server)), "--input", str(records), "--db", str(db),
                       "--budget-usd", value)
        assert flag.returncode == 2 and "--budget-usd" in flag.stderr, (value, flag.stderr)
    infinite = run_cli(tmp_path, "resume", "1", "--db", str(db), "--budget-usd", "inf")
    assert infinite.returncode == 2 and "--budget-usd = inf: expected a total in USD > 0" in infinite.stderr


@pytest.mark.slow
def test_budget_without_a_price_exits_2_and_sends_nothing(tmp_path: Path, server: FakeProviderServer) -> None:
    records, db = write_records(tmp_path, 5), tmp_path / "l.db"
    unpriced = tmp_path / "unpriced.toml"
    unpriced.write_text(SPEC.format(base_url=server.base_url, run="").split("[pricing]")[0].replace('"m"', '"my-model"'))
    proc = run_cli(tmp_path, "submit", str(unpriced), "--input", str(records), "--db", str(db), "--budget-usd", "1")
    assert proc.returncode == 2
    assert "a budget needs a price, and model 'my-model' has no built-in list price: add a [pricing] table" in proc.stderr
    assert "Traceback" not in proc.stderr
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(orjson.dumps({
        "custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
    }) + b"\n")
    no_model = run_cli(tmp_path, "submit", "--input", str(batch), "--base-url", server.base_url, "--db", str(db),
                       "--budget-usd", "1")
    assert no_model.returncode == 2 and "the job names no model (each input line does)" in no_model.stderr
    assert "or pass --model" in no_model.stderr
    assert server.log == []
    assert orjson.loads(run_cli(tmp_path, "list", "--json", "--db", str(db)).stdout) == []  # no job either

    with_model = run_cli(tmp_path, "submit", "--input", str(batch), "--base-url", server.base_url, "--db", str(db),
                         "--model", "gpt-4o-mini", "--budget-usd", "1")
    assert with_model.returncode == 0, with_model.stderr  # a listed price: the budget holds
    assert len(server.log) == 1


def test_help_documents_the_flags(tmp_path: Path) -> None:
    submit = run_cli(tmp_path, "submit", "--help").stdout
    assert "--budget-usd USD" in submit and "--dry-run" in submit and "exit 4" in submit
    resume = run_cli(tmp_path, "resume", "--help").stdout
    assert "--budget-usd USD" in resume and "batchrun resume 3 --budget-usd 20" in resume
