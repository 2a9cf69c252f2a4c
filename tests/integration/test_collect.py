"""The Python API over a job's results (batchrun/collect.py, batchrun/spool.py): records from an iterable,
spooled by content; results in input order and as they finish, sync and async, with Pydantic models."""

from __future__ import annotations

import asyncio
import decimal
import hashlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pydantic
import pytest

import batchrun.ingest
from batchrun.collect import Result, as_finished, as_finished_async, results, results_async
from batchrun.errors import InputError, SpecError, StoppedError
from batchrun.export import export_job
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.spec import JobSpec, parse_spec
from batchrun.spool import SPOOL_FOLDER, spool_dir, spool_records
from batchrun.states import ExitCode, ItemState
from batchrun.submission import resume, submit
from batchrun.testing import FakeProviderServer, Faults

from .test_structured import FAST
from .test_submission import handlers


class Label(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    label: str
    score: int


class Picky(pydantic.BaseModel):
    """A model whose own validator refuses what its JSON Schema lets through."""

    label: str
    score: int

    @pydantic.field_validator("score")
    @classmethod
    def odd(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError("score must be odd")
        return value


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(latency_s=0.02)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a PostgreSQL ledger's inputs are spooled: a folder of this test's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def job_spec(server: FakeProviderServer, **run: Any) -> JobSpec:
    return parse_spec(
        {"provider": {"base_url": server.base_url, "model": "m"}, "request": {"template": "Say {text}"},
         "run": {"concurrency": 4, **run}},
        where="test",
    )


def records(n: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "text": f"hello {i}"} for i in range(n)]


# ---------------------------------------------------------------- records from Python


def test_records_are_spooled_by_content_and_find_the_same_job(
    ledger: Ledger, server: FakeProviderServer, db_url: str, tmp_path: Path, cache_home: Path
) -> None:
    first = submit(ledger, job_spec(server), records(5), options=FAST)
    assert first.exit_code == ExitCode.OK and first.prepared is not None and first.prepared.created
    folder = tmp_path / SPOOL_FOLDER if ledger.is_sqlite else cache_home / "batchrun" / "inputs"
    assert spool_dir(ledger.url) == folder
    [spooled] = folder.glob("*.jsonl")
    assert spooled.name == hashlib.sha256(spooled.read_bytes()).hexdigest() + ".jsonl"
    assert ledger.get_job(first.job_id).input_path == str(spooled)
    # The same records, keys in another order and from a generator: the same content, the same job.
    again = submit(ledger, job_spec(server), ({"text": r["text"], "id": r["id"]} for r in records(5)), options=FAST)
    assert again.job_id == first.job_id and again.prepared is not None and not again.prepared.created
    assert len(server.log) == 5
    more = submit(ledger, job_spec(server), records(6), options=FAST)
    assert more.job_id != first.job_id


def test_resume_reads_the_spooled_records_of_an_interrupted_ingest(
    ledger: Ledger, server: FakeProviderServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batchrun.ingest, "INSERT_BATCH", 2)
    batches = iter(range(100))
    path = spool_records(spool_dir(ledger.url), records(7))
    with pytest.raises(StoppedError):  # a signal after the first batch
        prepare_job(ledger, job_spec(server), path, should_stop=lambda: next(batches) > 1)
    [(job, _)] = ledger.list_jobs()
    assert not job.ingest_done
    result = resume(ledger, job.id, options=FAST)
    assert result.exit_code == ExitCode.OK and result.counts[ItemState.SUCCEEDED] == 7


def test_records_that_are_not_dicts_or_not_json_are_refused_by_number(ledger: Ledger, server: FakeProviderServer) -> None:
    with pytest.raises(InputError, match=r"^record 2: expected a dict, got str \(for a pandas DataFrame"):
        submit(ledger, job_spec(server), [{"id": 1, "text": "a"}, "text"])
    with pytest.raises(InputError, match=r"^record 1: Type is not JSON serializable: object"):
        submit(ledger, job_spec(server), [{"id": 1, "text": object()}])
    with pytest.raises(InputError, match="got a single mapping"):
        submit(ledger, job_spec(server), {"id": 1, "text": "a"})
    assert ledger.list_jobs() == []


def test_decimals_and_models_in_records_are_written_as_json(ledger: Ledger, server: FakeProviderServer) -> None:
    result = submit(ledger, job_spec(server), [{"id": 1, "text": decimal.Decimal("1.10")},
                                               {"id": 2, "text": Label(label="x", score=3)}], options=FAST)
    assert [r.output for r in results(ledger, result.job_id)] == [
        "echo: Say 1.10", 'echo: Say {"label":"x","score":3}']


# ---------------------------------------------------------------- results in input order


def test_results_are_the_export_lines_in_input_order(ledger: Ledger, server: FakeProviderServer, tmp_path: Path) -> None:
    result = submit(ledger, job_spec(server), [*records(8), {"id": "r3", "text": "again"}, {"id": "x"}],
                    options=FAST, output=tmp_path / "out.jsonl")
    lines = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    got = list(results(ledger, result.job_id))
    assert [r.to_json() for r in got] == lines  # the duplicate r3 is in the errors file only, as in the export
    assert [r.custom_id for r in got] == [f"r{i}" for i in range(8)] + ["x"]
    assert got[0].ok and got[0].output == "echo: Say hello 0" and got[-1].status == ItemState.REJECTED
    assert got[-1].error is not None and got[-1].error["class"] == "missing_field"


def test_a_pydantic_model_makes_answers_instances_and_files_hold_their_json(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path
) -> None:
    result = submit(ledger, job_spec(server), records(6), schema=Label, options=FAST, output=tmp_path / "out.jsonl")
    assert result.exit_code == ExitCode.OK
    stored = ledger.get_job(result.job_id).spec.output
    assert stored.schema == Label.model_json_schema() and stored.schema_model == f"{__name__}:Label"
    got = list(results(ledger, result.job_id))
    assert all(isinstance(r.output, Label) for r in got)
    lines = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [r.to_json() for r in got] == lines
    assert [r.output for r in results(ledger, result.job_id, model=dict)] == [line["output"] for line in lines]
    picky = list(results(ledger, result.job_id, model=Picky))
    for row in picky:
        if isinstance(row.output, Picky):
            assert row.output.score % 2 == 1 and row.error is None
        else:  # the schema let it through, the model's validator did not: the JSON, and why
            assert row.status == ItemState.SUCCEEDED and isinstance(row.output, dict)
            assert row.error is not None and row.error["class"] == "model_invalid"
            assert "score must be odd" in row.error["message"]
    assert any(not isinstance(r.output, Picky) for r in picky) and any(isinstance(r.output, Picky) for r in picky)


def test_a_model_that_cannot_be_had_is_one_line_naming_it(ledger: Ledger, server: FakeProviderServer) -> None:
    spec = job_spec(server).with_output_schema(Label)
    job = prepare_job(ledger, spec, spool_records(spool_dir(ledger.url), records(1))).job_id
    with pytest.raises(SpecError, match=r"^model: expected a Pydantic model class .*, got the class int"):
        results(ledger, job, model=int)
    import batchrun.schemas

    batchrun.schemas._GIVEN.clear()  # another process: the class is found by importing its reference
    assert list(results(ledger, job))[0].status == ItemState.PENDING
    with ledger.engine.begin() as conn:
        from sqlalchemy import text

        data = orjson.loads(conn.execute(text("select spec_json from jobs")).scalar())
        data["output"]["schema_model"] = "no_such_module_here:Label"
        conn.execute(text("update jobs set spec_json = :s"), {"s": orjson.dumps(data).decode()})
    with pytest.raises(SpecError, match=r"^job \d+'s model 'no_such_module_here:Label': cannot import module"):
        results(ledger, job)


def test_results_async_reads_the_same_results(ledger: Ledger, server: FakeProviderServer) -> None:
    result = submit(ledger, job_spec(server), records(7), schema=Label, options=FAST)

    async def read() -> list[Result]:
        return [r async for r in results_async(ledger, result.job_id)]

    assert asyncio.run(read()) == list(results(ledger, result.job_id))


# ---------------------------------------------------------------- results as they finish


def test_as_finished_runs_the_job_and_yields_each_result_once_without_signal_handlers(
    ledger: Ledger, server: FakeProviderServer
) -> None:
    result = submit(ledger, job_spec(server), [*records(30), {"id": "bad"}], schema=Label, run=False)
    before = handlers()
    seen: list[Result] = []
    during: list[dict[int, Any]] = []
    finishing = as_finished(ledger, result.job_id, options=FAST)
    for row in finishing:
        seen.append(row)
        during.append(handlers())
    assert during[0] == before and during[-1] == before  # no handler of ours, in the caller's thread or not
    assert seen[0].custom_id == "bad"  # finished before the run: first
    assert sorted(r.custom_id for r in seen) == sorted([f"r{i}" for i in range(30)] + ["bad"])
    assert all(isinstance(r.output, Label) for r in seen if r.ok)
    assert finishing.result is not None and finishing.result.exit_code == ExitCode.SOME_FAILED
    assert {r.custom_id: r for r in seen} == {r.custom_id: r for r in results(ledger, result.job_id)}


@pytest.mark.slow
def test_as_finished_yields_while_the_run_works(ledger: Ledger, db_url: str) -> None:
    # 30 items two at a time, 0.2 s each: ~3 s of run after the first answer, so a loaded CI machine
    # that is slow to poll still hands the first one out long before the last is in (6 items raced)
    with FakeProviderServer(Faults(latency_s=0.2)) as slow:
        job = submit(ledger, job_spec(slow, concurrency=2), records(30), run=False).job_id
        with as_finished(ledger, job, options=FAST, poll_seconds=0.05) as finishing:
            first = next(finishing)
            counts = LedgerQueries(ledger.engine).counts(job)
            assert first.ok and counts[ItemState.SUCCEEDED] < 30  # handed out before the job was done
            rest = list(finishing)
    assert len(rest) == 29


@pytest.mark.slow
def test_leaving_as_finished_early_stops_the_run_and_resume_carries_on(ledger: Ledger, db_url: str) -> None:
    with FakeProviderServer(Faults(latency_s=0.2)) as slow:
        job = submit(ledger, job_spec(slow, concurrency=2), records(20), run=False).job_id
        taken = []
        with as_finished(ledger, job, options=FAST, poll_seconds=0.05) as finishing:
            for row in finishing:
                taken.append(row.custom_id)
                if len(taken) == 2:
                    break
        assert finishing.result is not None and finishing.result.exit_code == ExitCode.TEMPFAIL
        left = LedgerQueries(ledger.engine).counts(job)
        assert left[ItemState.PENDING] > 0 and left[ItemState.RUNNING] == 0
        done = [row.custom_id for row in as_finished(ledger, job, options=FAST)]
    assert sorted(done) == sorted(f"r{i}" for i in range(20))  # those finished before come first, once each
    assert len(slow.log) <= 20 + 2  # at most the run's concurrency sent again


def test_breaking_out_of_a_for_loop_stops_the_run(ledger: Ledger, db_url: str) -> None:
    with FakeProviderServer(Faults(latency_s=0.2)) as slow:
        job = submit(ledger, job_spec(slow, concurrency=2), records(20), run=False).job_id
        finishing = as_finished(ledger, job, options=FAST, poll_seconds=0.05)
        for _row in finishing:
            break  # no close(), no with: the loop's end is enough
        assert finishing.result is not None and finishing.result.exit_code == ExitCode.TEMPFAIL
        assert LedgerQueries(ledger.engine).counts(job)[ItemState.PENDING] > 0


def test_as_finished_works_inside_a_running_event_loop(ledger: Ledger, server: FakeProviderServer) -> None:
    job = submit(ledger, job_spec(server), records(5), run=False).job_id

    async def notebook_cell() -> list[str]:
        return [row.custom_id for row in as_finished(ledger, job, options=FAST)]

    assert sorted(asyncio.run(notebook_cell())) == [f"r{i}" for i in range(5)]


def test_as_finished_async_on_the_callers_loop(ledger: Ledger, db_url: str) -> None:
    with FakeProviderServer(Faults(latency_s=0.2)) as slow:
        job = submit(ledger, job_spec(slow, concurrency=2), records(12), schema=Label, run=False).job_id

        async def read_some() -> tuple[list[Result], Any]:
            before = signal.getsignal(signal.SIGTERM)
            got: list[Result] = []
            async with as_finished_async(ledger, job, options=FAST, poll_seconds=0.05) as finishing:
                async for row in finishing:
                    assert signal.getsignal(signal.SIGTERM) == before
                    got.append(row)
                    if len(got) == 3:
                        break
            return got, finishing.result

        got, stopped = asyncio.run(read_some())
        assert len(got) == 3 and all(isinstance(r.output, Label) for r in got)
        assert stopped is not None and stopped.exit_code == ExitCode.TEMPFAIL

        async def read_all() -> list[str]:
            return [row.custom_id async for row in as_finished_async(ledger, job, options=FAST)]

        assert sorted(asyncio.run(read_all())) == sorted(f"r{i}" for i in range(12))


def test_as_finished_raises_what_stopped_the_run(ledger: Ledger, server: FakeProviderServer) -> None:
    job = submit(ledger, job_spec(server), records(2), run=False).job_id
    run_id = ledger.start_run(job, "submit", exclusive=True, stale_after=60)  # another run holds the job
    with pytest.raises(batchrun.JobLockedError):
        list(as_finished(ledger, job, options=FAST))
    ledger.end_run(job, run_id, 0)


def test_exporting_a_model_job_needs_no_model(ledger: Ledger, server: FakeProviderServer, tmp_path: Path) -> None:
    result = submit(ledger, job_spec(server), records(3), schema=Label, options=FAST)
    import batchrun.schemas

    batchrun.schemas._GIVEN.clear()
    exported = export_job(ledger, result.job_id, tmp_path / "o.jsonl")
    assert exported.lines == 3
