"""The response cache against the real fake server: only requests never answered reach it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
from sqlalchemy import text

from batchrun.export import export_job
from batchrun.jobs import RunSummary, prepare_job, run_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.report import job_status, status_lines
from batchrun.scheduler import RunOptions
from batchrun.spec import JobSpec, Overrides, load_spec
from batchrun.testing import FakeProviderServer, Faults, Refusals
from batchrun.states import ExitCode, ItemState

FAST = RunOptions(backoff_initial=0.01, backoff_max=0.05, flush_interval=0.05)
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer"}},
    "required": ["label", "score"],
    "additionalProperties": False,
}


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=3)) as srv:
        yield srv


@pytest.fixture
def make_spec(tmp_path: Path) -> Callable[..., JobSpec]:
    def make(
        base_url: str,
        *,
        template: str = "Summarise: {text}",
        schema: bool = False,
        run: str = "",
        provider: str = "",
        request: str = "",
        name: str = "job",
    ) -> JobSpec:
        (tmp_path / "label.schema.json").write_bytes(orjson.dumps(SCHEMA))
        path = tmp_path / f"{name}.toml"
        output = '[output]\nschema = "label.schema.json"\nvalidation_retries = 0\n' if schema else ""
        path.write_text(
            f"""
[provider]
base_url = "{base_url}"
model = "m"
{provider}
[request]
template = "{template}"
max_tokens = 100
{request}
[pricing]
input_per_million = 1.0
output_per_million = 2.0
[run]
concurrency = 16
{run}
{output}
"""
        )
        return load_spec(path)

    return make


def records(n: int, start: int = 0) -> list[dict[str, object]]:
    return [{"id": f"r{i}", "text": f"record {i}"} for i in range(start, start + n)]


def submit(ledger: Ledger, spec: JobSpec, path: Path, *, new: bool = False) -> int:
    return prepare_job(ledger, spec, path, new=new).job_id


def run(ledger: Ledger, job_id: int, **over: object) -> RunSummary:
    return asyncio.run(run_job(ledger, job_id, overrides=Overrides(**over), options=FAST))  # type: ignore[arg-type]


def sent(server: FakeProviderServer, since: int = 0) -> list[str | None]:
    return [rec.key for rec in server.log[since:]]


def results(ledger: Ledger, job_id: int, path: Path) -> dict[str, dict[str, object]]:
    export_job(ledger, job_id, path, fmt="results", force=True)
    return {line["custom_id"]: line for line in map(orjson.loads, path.read_bytes().splitlines())}


def test_next_day_only_new_records_reach_the_server(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec],
    write_jsonl: Callable[..., Path],
) -> None:
    spec = make_spec(server.base_url)
    day1 = submit(ledger, spec, write_jsonl(records(100), "day1.jsonl"))
    assert run(ledger, day1).exit_code == ExitCode.OK
    assert sorted(sent(server)) == sorted(f"Summarise: record {i}" for i in range(100))
    day1_out = results(ledger, day1, tmp_path / "day1.out")
    day1_cost = job_status(ledger, day1)["cost_usd"]

    seen = len(server.log)
    day2 = submit(ledger, spec, write_jsonl(records(110), "day2.jsonl"))
    assert day2 != day1  # new content, new job
    summary = run(ledger, day2)
    assert summary.exit_code == ExitCode.OK
    assert summary.counts[ItemState.SUCCEEDED] == 110
    assert sorted(sent(server, seen)) == sorted(f"Summarise: record {i}" for i in range(100, 110))

    out = results(ledger, day2, tmp_path / "day2.out")
    assert len(out) == 110
    for i in range(100):
        line = out[f"r{i}"]
        assert line["cached"] is True
        assert line["output"] == day1_out[f"r{i}"]["output"] == f"echo: Summarise: record {i}"
        assert line["status"] == "succeeded" and line["attempts"] == 0
        usage = line["usage"]
        assert isinstance(usage, dict) and usage["cost_usd"] == 0
        assert usage["input_tokens"] == day1_out[f"r{i}"]["usage"]["input_tokens"]  # type: ignore[index]
    for i in range(100, 110):
        assert "cached" not in out[f"r{i}"]
        assert out[f"r{i}"]["attempts"] == 1
    assert all("cached" not in line for line in day1_out.values())

    status = job_status(ledger, day2)
    assert status["cached"] == 100
    assert status["counts"]["succeeded"] == 110
    assert status["requests"] == 10
    assert status["latency_ms"]["count"] == 10  # reused answers are not latencies
    assert status["attempts_histogram"] == {"0": 100, "1": 10}
    assert status["tokens"]["input"] == sum(rec.prompt_tokens for rec in server.log[seen:])
    assert status["cost_usd"] == pytest.approx(day1_cost / 100 * 10, rel=0.05)  # only the new records are paid
    assert any(line.strip().startswith("reused    100") for line in status_lines(status))
    assert job_status(ledger, day1)["cached"] == 0

    # Day 3, the same again: everything reused, each pointing at the item that paid for it.
    seen = len(server.log)
    day3 = submit(ledger, spec, write_jsonl(records(110), "day2.jsonl"), new=True)
    assert run(ledger, day3).exit_code == ExitCode.OK
    assert len(server.log) == seen
    rows = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(day3)}
    originals = {r.custom_id: r.item_id for r in LedgerQueries(ledger.engine).iter_items(day1)}
    originals |= {r.custom_id: r.item_id for r in LedgerQueries(ledger.engine).iter_items(day2) if r.cached_from is None}
    assert {cid: r.cached_from for cid, r in rows.items()} == originals


def test_no_cache_sends_everything_and_still_files_the_answers(
    tmp_path: Path, ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec],
    write_jsonl: Callable[..., Path],
) -> None:
    spec = make_spec(server.base_url)
    assert run(ledger, submit(ledger, spec, write_jsonl(records(30), "day1.jsonl"))).exit_code == ExitCode.OK
    seen = len(server.log)
    day2 = submit(ledger, spec, write_jsonl(records(33), "day2.jsonl"))
    assert run(ledger, day2, cache=False).exit_code == ExitCode.OK
    assert sorted(sent(server, seen)) == sorted(f"Summarise: record {i}" for i in range(33))
    assert job_status(ledger, day2)["cached"] == 0
    assert all("cached" not in line for line in results(ledger, day2, tmp_path / "out").values())

    # [run] cache = false in the spec does the same; its answers are still there for later runs.
    off = make_spec(server.base_url, run="cache = false", name="off")
    seen = len(server.log)
    day3 = submit(ledger, off, write_jsonl(records(34), "day3.jsonl"))
    assert run(ledger, day3).exit_code == ExitCode.OK
    assert len(server.log) - seen == 34
    seen = len(server.log)
    day4 = submit(ledger, spec, write_jsonl(records(35), "day4.jsonl"))
    assert run(ledger, day4).exit_code == ExitCode.OK
    assert sent(server, seen) == ["Summarise: record 34"]


@pytest.mark.slow
def test_a_different_model_template_or_base_url_is_a_different_request(
    ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec], write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl(records(20))
    assert run(ledger, submit(ledger, make_spec(server.base_url), path)).exit_code == ExitCode.OK
    for spec, over in (
        (make_spec(server.base_url), {"model": "m2"}),
        (make_spec(server.base_url, template="Shorten: {text}", name="t2"), {}),
        (make_spec(server.base_url, request="temperature = 0.5", name="t3"), {}),
        (make_spec(server.base_url, schema=True, name="t4"), {}),
    ):
        seen = len(server.log)
        job = submit(ledger, spec.with_overrides(Overrides(**over)), path)  # type: ignore[arg-type]
        assert run(ledger, job).exit_code == ExitCode.OK
        assert len(server.log) - seen == 20, over or spec.request
        assert job_status(ledger, job)["cached"] == 0
    with FakeProviderServer() as other:
        job = submit(ledger, make_spec(other.base_url, name="other"), path)
        assert run(ledger, job).exit_code == ExitCode.OK
        assert len(other.log) == 20


def test_failed_and_invalid_answers_are_never_reused(
    ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec], write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl(records(12))
    server.refusals = Refusals(over_context="")  # every request refused, each its own way
    failed = submit(ledger, make_spec(server.base_url), path)
    assert run(ledger, failed).counts[ItemState.FAILED] == 12
    server.refusals = Refusals()
    server.faults = Faults(p_schema_violation=1.0, seed=1)
    structured = make_spec(server.base_url, schema=True, name="s")
    invalid = submit(ledger, structured, path)
    assert run(ledger, invalid).counts[ItemState.INVALID_OUTPUT] == 12

    server.faults = Faults()
    seen = len(server.log)
    again = submit(ledger, make_spec(server.base_url), path, new=True)
    assert run(ledger, again).exit_code == ExitCode.OK
    again_s = submit(ledger, structured, path, new=True)
    assert run(ledger, again_s).exit_code == ExitCode.OK
    assert len(server.log) - seen == 24
    assert job_status(ledger, again)["cached"] == job_status(ledger, again_s)["cached"] == 0

    # Now that they succeeded, a structured answer is reused and parsed by the job's own validator.
    seen = len(server.log)
    third = submit(ledger, structured, path, new=True)
    assert run(ledger, third).exit_code == ExitCode.OK
    assert len(server.log) == seen
    rows = list(LedgerQueries(ledger.engine).iter_items(third))
    assert all(r.cached_from is not None and r.parsed is not None for r in rows)
    assert {r.custom_id: r.parsed for r in rows} == {r.custom_id: r.parsed for r in LedgerQueries(ledger.engine).iter_items(again_s)}


def test_a_reused_answer_the_job_no_longer_accepts_is_sent_again(
    ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec], write_jsonl: Callable[..., Path]
) -> None:
    """`revalidate --schema` can leave a succeeded answer a job's validator refuses; it is asked again."""
    path = write_jsonl(records(5))
    structured = make_spec(server.base_url, schema=True, name="s")
    first = submit(ledger, structured, path)
    assert run(ledger, first).exit_code == ExitCode.OK
    with ledger.engine.begin() as conn:  # an answer that passed an older schema
        conn.execute(
            text("UPDATE items SET output = :output WHERE job_id = :job AND custom_id = 'r0'"),
            {"output": '{"label": "maybe", "score": 1}', "job": first},
        )
    seen = len(server.log)
    second = submit(ledger, structured, path, new=True)
    assert run(ledger, second).exit_code == ExitCode.OK
    assert len(server.log) - seen == 1
    assert job_status(ledger, second)["cached"] == 4


def test_the_api_key_is_not_part_of_the_request(
    monkeypatch: pytest.MonkeyPatch, ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec],
    write_jsonl: Callable[..., Path],
) -> None:
    spec = make_spec(server.base_url, provider='api_key_env = "CACHE_TEST_KEY"')
    server.api_key = "sk-first-key-1234567890"
    monkeypatch.setenv("CACHE_TEST_KEY", server.api_key)
    assert run(ledger, submit(ledger, spec, write_jsonl(records(10), "day1.jsonl"))).exit_code == ExitCode.OK
    server.api_key = "sk-second-key-0987654321"
    monkeypatch.setenv("CACHE_TEST_KEY", server.api_key)
    seen = len(server.log)
    day2 = submit(ledger, spec, write_jsonl(records(11), "day2.jsonl"))
    assert run(ledger, day2).exit_code == ExitCode.OK
    assert sent(server, seen) == ["Summarise: record 10"]
    with ledger.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT request_hash FROM items WHERE request_hash IS NOT NULL").scalars().all()
    assert len(stored) == 21 and all(len(h) == 64 for h in stored)


def test_streaming_on_or_off_asks_the_same_question(
    ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec], write_jsonl: Callable[..., Path]
) -> None:
    plain = make_spec(server.base_url)
    assert run(ledger, submit(ledger, plain, write_jsonl(records(10), "day1.jsonl"))).exit_code == ExitCode.OK
    streamed = make_spec(server.base_url, run="stream = true", name="streamed")
    seen = len(server.log)
    day2 = submit(ledger, streamed, write_jsonl(records(12), "day2.jsonl"))
    assert run(ledger, day2).exit_code == ExitCode.OK
    assert sorted(sent(server, seen)) == ["Summarise: record 10", "Summarise: record 11"]
    assert all(rec.stream for rec in server.log[seen:])
    assert job_status(ledger, day2)["ttft_ms"]["count"] == 2


def test_a_partly_failed_day_pays_only_for_what_failed(
    ledger: Ledger, server: FakeProviderServer, make_spec: Callable[..., JobSpec], write_jsonl: Callable[..., Path]
) -> None:
    spec = make_spec(server.base_url, run="max_attempts = 1")
    server.faults = Faults(p_500=0.3, seed=5)
    day1 = submit(ledger, spec, write_jsonl(records(40), "day1.jsonl"))
    assert run(ledger, day1).exit_code == ExitCode.SOME_FAILED
    failed = {r.custom_id for r in LedgerQueries(ledger.engine).iter_items(day1) if r.state == ItemState.FAILED}
    assert failed
    server.faults = Faults()
    seen = len(server.log)
    day2 = submit(ledger, spec, write_jsonl(records(40), "day2.jsonl"), new=True)
    assert run(ledger, day2).exit_code == ExitCode.OK
    assert sorted(sent(server, seen)) == sorted(f"Summarise: record {cid[1:]}" for cid in failed)
