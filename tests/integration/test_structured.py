"""Structured outputs end to end: schema in the spec, parse, re-ask, classify, export, revalidate."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.export import export_job
from batchrun.jobs import RunSummary, prepare_job, revalidate_job, run_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.report import job_status
from batchrun.scheduler import RunOptions
from batchrun.spec import JobSpec, load_spec
from batchrun.testing import FakeProviderServer, Faults
from batchrun.states import ExitCode, ItemState

FAST = RunOptions(backoff_initial=0.01, backoff_max=0.05, flush_interval=0.05)
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "reasons": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["label", "score", "reasons"],
    "additionalProperties": False,
}


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=2), record_bodies=True) as srv:
        yield srv


def make_spec(tmp_path: Path, server: FakeProviderServer, retries: int = 2, max_tokens: int = 200) -> JobSpec:
    (tmp_path / "label.schema.json").write_bytes(orjson.dumps(SCHEMA))
    path = tmp_path / "label.toml"
    path.write_text(
        f"""
[provider]
base_url = "{server.base_url}"
model = "m"
[request]
template = "Classify: {{text}}"
max_tokens = {max_tokens}
[output]
schema = "label.schema.json"
validation_retries = {retries}
[pricing]
input_per_million = 1.0
output_per_million = 2.0
[run]
concurrency = 8
max_attempts = 6
"""
    )
    return load_spec(path)


def submit(ledger: Ledger, spec: JobSpec, write_jsonl: Callable[..., Path], n: int) -> int:
    return prepare_job(ledger, spec, write_jsonl([{"id": f"m{i}", "text": f"message {i}"} for i in range(n)])).job_id


def run(ledger: Ledger, job_id: int) -> RunSummary:
    return asyncio.run(run_job(ledger, job_id, options=FAST))


def rows(ledger: Ledger, job_id: int) -> dict[str, object]:
    return {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_id)}


def test_valid_fenced_and_prose_answers_are_parsed_without_reasking(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(p_fenced=0.3, p_prose=0.3, seed=4)
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl, 60)
    assert run(ledger, job_id).exit_code == ExitCode.OK
    assert {"fenced", "prose"} <= {r.output_fault for r in server.log}
    assert set(server.requests_by_key().values()) == {1}
    sent = server.bodies[0]
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"] == {"name": "output", "schema": SCHEMA, "strict": True}
    out = tmp_path / "out.jsonl"
    export_job(ledger, job_id, out)
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert all(isinstance(x["output"], dict) and x["output"]["label"] in ("spam", "ham") for x in lines)


def test_reask_with_feedback_fixes_the_answer(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(p_schema_violation=1.0, output_faults_on_reask=False)
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl, 5)
    assert run(ledger, job_id).exit_code == ExitCode.OK
    assert set(server.requests_by_key().values()) == {2}
    reask = [b for b in server.bodies if len(b["messages"]) > 1][0]
    assert reask["messages"][-2]["role"] == "assistant"
    assert "$: 'label' is a required property" in reask["messages"][-1]["content"]
    for row in rows(ledger, job_id).values():
        assert row.state == ItemState.SUCCEEDED and row.attempts == 2  # type: ignore[attr-defined]
    with ledger.engine.connect() as conn:
        per_attempt = conn.exec_driver_sql("select error_class, count(*), sum(output_tokens) from attempts group by error_class").all()
    classes = {c: (n, t) for c, n, t in per_attempt}
    assert classes["schema_invalid"][0] == 5 and classes[None][0] == 5  # each re-ask is an attempt with its own usage
    assert classes["schema_invalid"][1] > 0
    with ledger.engine.connect() as conn:
        costs = conn.exec_driver_sql("select input_tokens, output_tokens, cost_usd from attempts").all()
    assert all(c == pytest.approx((i * 1.0 + o * 2.0) / 1e6) for i, o, c in costs)  # and its own cost
    expected = sum((r.prompt_tokens * 1.0 + r.completion_tokens * 2.0) / 1e6 for r in server.log)
    assert job_status(ledger, job_id)["cost_usd"] == pytest.approx(expected)
    item_costs = sum(r.cost_usd for r in LedgerQueries(ledger.engine).iter_items(job_id))  # type: ignore[misc]
    assert item_costs == pytest.approx(expected)


def test_invalid_every_time_ends_invalid_output_with_raw_text_and_paths(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(p_schema_violation=1.0)
    job_id = submit(ledger, make_spec(tmp_path, server, retries=2), write_jsonl, 4)
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.SOME_FAILED
    assert summary.counts[ItemState.INVALID_OUTPUT] == 4
    assert set(server.requests_by_key().values()) == {3}  # 1 + validation_retries
    row = rows(ledger, job_id)["m0"]
    assert row.error_class == "schema_invalid"  # type: ignore[attr-defined]
    assert orjson.loads(row.output)["score"] is not None  # type: ignore[attr-defined]  # the raw answer is kept
    assert orjson.loads(row.validation_errors) == [{"path": "$", "message": "'label' is a required property"}]  # type: ignore[attr-defined]
    errors = tmp_path / "errors.jsonl"
    export_job(ledger, job_id, tmp_path / "out.jsonl", errors=errors)
    err = orjson.loads(errors.read_bytes().splitlines()[0])
    assert err["status"] == "invalid_output" and err["validation_errors"][0]["path"] == "$" and err["raw"]
    assert job_status(ledger, job_id)["errors"] == {"schema_invalid": 4}


@pytest.mark.parametrize(("fault", "error_class", "requests"), [("refusal", "refusal", 1), ("not_json", "not_json", 2)])
def test_refusals_and_prose_are_classified(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path],
    fault: str, error_class: str, requests: int,
) -> None:
    server.faults = Faults(**{f"p_{fault}": 1.0})  # type: ignore[arg-type]
    job_id = submit(ledger, make_spec(tmp_path, server, retries=1), write_jsonl, 3)
    assert run(ledger, job_id).exit_code == ExitCode.SOME_FAILED
    assert {r.error_class for r in rows(ledger, job_id).values()} == {error_class}  # type: ignore[attr-defined]
    assert set(server.requests_by_key().values()) == {requests}  # a refusal is not re-asked


def test_truncated_then_selective_retry_with_more_tokens(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = submit(ledger, make_spec(tmp_path, server, retries=0, max_tokens=3), write_jsonl, 6)
    assert run(ledger, job_id).exit_code == ExitCode.SOME_FAILED
    assert {r.error_class for r in rows(ledger, job_id).values()} == {"truncated"}  # type: ignore[attr-defined]
    assert ledger.retry(job_id, [ItemState.INVALID_OUTPUT], {"error_class": "truncated", "custom_id": "m1"}, max_tokens=400) == 1
    assert run(ledger, job_id).exit_code == ExitCode.SOME_FAILED
    state = rows(ledger, job_id)
    assert state["m1"].state == ItemState.SUCCEEDED  # type: ignore[attr-defined]
    assert server.bodies[-1]["max_tokens"] == 400
    assert all(state[f"m{i}"].state == ItemState.INVALID_OUTPUT for i in (0, 2, 3, 4, 5))  # type: ignore[attr-defined]
    assert ledger.get_job(job_id).spec.request.max_tokens == 3  # the spec stays as submitted


@pytest.mark.slow
def test_random_bad_answers_each_end_valid_or_invalid_within_the_bound(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(p_truncated_json=0.15, p_schema_violation=0.15, p_500=0.05, p_reset=0.02, seed=9)
    job_id = submit(ledger, make_spec(tmp_path, server, retries=2), write_jsonl, 300)
    run(ledger, job_id)
    retryable: dict[str, int] = {}
    for rec in server.log:
        if rec.outcome != "ok":
            retryable[rec.key] = retryable.get(rec.key, 0) + 1  # type: ignore[index]
    for key, n in server.requests_by_key().items():
        assert n <= 1 + 2 + retryable.get(key, 0), key
    final = rows(ledger, job_id)
    assert {r.state for r in final.values()} <= {ItemState.SUCCEEDED, ItemState.INVALID_OUTPUT}  # type: ignore[attr-defined]
    assert any(r.state == ItemState.INVALID_OUTPUT for r in final.values())  # type: ignore[attr-defined]
    for row in final.values():
        if row.state == ItemState.SUCCEEDED:  # type: ignore[attr-defined]
            parsed = orjson.loads(row.parsed)  # type: ignore[attr-defined]
            assert set(parsed) == {"label", "score", "reasons"}
        else:
            assert row.output is not None and row.error_class in ("truncated", "schema_invalid")  # type: ignore[attr-defined]


def test_revalidate_moves_items_both_ways_without_calls(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(p_schema_violation=0.5, seed=3)
    job_id = submit(ledger, make_spec(tmp_path, server, retries=0), write_jsonl, 20)
    run(ledger, job_id)
    before = rows(ledger, job_id)
    invalid = {k for k, r in before.items() if r.state == ItemState.INVALID_OUTPUT}  # type: ignore[attr-defined]
    assert invalid and len(invalid) < 20
    sent = len(server.log)
    looser = {**SCHEMA, "required": ["score"]}
    report = revalidate_job(ledger, job_id, looser)
    assert set(report.to_succeeded) == invalid and report.to_invalid == []
    stricter = {**SCHEMA, "properties": {**SCHEMA["properties"], "score": {"type": "integer", "maximum": -1}}}
    report = revalidate_job(ledger, job_id, stricter)
    assert len(report.to_invalid) == 20 and report.to_succeeded == []
    assert len(server.log) == sent  # no API calls
    report = revalidate_job(ledger, job_id)
    assert set(report.to_succeeded) == set(before) - invalid
