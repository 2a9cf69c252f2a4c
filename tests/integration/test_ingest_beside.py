"""The Python API sends while the input is read (issue 18), on SQLite and PostgreSQL: the first request
goes out before ``jobs.ingest_done``, every record is answered once, and the job is finished only
once its whole input is in. A run that stops takes its ingest with it; resume carries both on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.errors import InputError, LockLostError
from batchrun.jobs import ingest_beside, ingests_beside, prepare_job
from batchrun.ledger import Ledger
from batchrun.scheduler import JobRunner
from batchrun.spec import JobSpec, Overrides, parse_spec
from batchrun.states import ExitCode, ItemState, StopReason
from batchrun.submission import resume, submit
from batchrun.testing import FakeProviderServer, Faults

from .test_collect import cache_home  # noqa: F401  (autouse: a PostgreSQL ledger's spooled records stay in tmp_path)
from .test_structured import FAST

N = 6_000


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(latency_s=0.005)) as srv:
        yield srv


def job_spec(server: FakeProviderServer) -> JobSpec:
    return parse_spec(
        {"provider": {"base_url": server.base_url, "model": "m"}, "request": {"template": "Say {text}"},
         "run": {"concurrency": 16}},
        where="test",
    )


def write_records(path: Path, n: int) -> Path:
    with open(path, "wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"r{i}", "text": f"hello {i} " + "pad " * 200}) + b"\n")
    return path


@pytest.mark.slow
def test_the_first_request_goes_out_before_the_input_is_all_in(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path
) -> None:
    n = 2 * N  # on a loaded machine 6,000 lines were all stored (not yet marked done) before the first request
    src = write_records(tmp_path / "in.jsonl", n)
    seen: list[tuple[bool, int]] = []  # (ingest_done, items stored) when the first request was seen

    async def watch(runner: JobRunner, todo: int) -> None:
        while not server.log:
            await asyncio.sleep(0.001)
        job = ledger.get_job(runner.job.id)
        seen.append((job.ingest_done, sum(ledger.counts(job.id).values())))

    result = submit(ledger, job_spec(server), src, options=FAST, on_start=watch, output=tmp_path / "out.jsonl")
    assert seen and not seen[0][0] and seen[0][1] < n, seen
    assert result.exit_code == ExitCode.OK and result.counts[ItemState.SUCCEEDED] == n
    job = ledger.get_job(result.job_id)
    assert job.ingest_done and job.total == n
    assert set(server.ok_by_key().values()) == {1} and len(server.ok_by_key()) == n
    assert len((tmp_path / "out.jsonl").read_bytes().splitlines()) == n


@pytest.mark.slow
def test_a_run_stopped_mid_ingest_leaves_it_for_resume(ledger: Ledger, server: FakeProviderServer, tmp_path: Path) -> None:
    n = 2 * N
    src = write_records(tmp_path / "in.jsonl", n)

    def stop_early(runner: JobRunner, todo: int) -> None:
        async def stop() -> None:
            while not runner.stats.done[ItemState.SUCCEEDED]:
                await asyncio.sleep(0.001)
            runner.request_stop(StopReason.STOP, "the test stopped it")

        asyncio.ensure_future(stop())

    first = submit(ledger, job_spec(server), src, options=FAST, on_start=stop_early)
    assert first.exit_code == ExitCode.TEMPFAIL and first.stop_reason == StopReason.STOP
    job = ledger.get_job(first.job_id)
    assert not job.ingest_done and first.total < n
    assert first.counts[ItemState.RUNNING] == 0
    again = resume(ledger, first.job_id, options=FAST, output=tmp_path / "out.jsonl")
    assert again.exit_code == ExitCode.OK and again.counts[ItemState.SUCCEEDED] == n
    assert ledger.get_job(first.job_id).ingest_done
    assert set(server.ok_by_key().values()) == {1} and len(server.ok_by_key()) == n
    lines = [orjson.loads(x) for x in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(n)]


def test_no_run_ingests_the_whole_input_first(ledger: Ledger, server: FakeProviderServer, tmp_path: Path) -> None:
    src = write_records(tmp_path / "in.jsonl", 3000)
    stored = submit(ledger, job_spec(server), src, run=False)
    assert stored.prepared is not None and stored.prepared.ingest is not None and stored.prepared.ingest.accepted == 3000
    assert ledger.get_job(stored.job_id).ingest_done and stored.total == 3000 and not server.log


def test_the_ingest_has_ended_when_it_last_wakes_the_run_and_writes_only_under_its_lock(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path
) -> None:
    src = write_records(tmp_path / "in.jsonl", 1200)
    prepared = prepare_job(ledger, job_spec(server), src, ingest=False)
    stranger = ingest_beside(ledger, prepared.job_id, src)
    assert stranger is not None
    stranger.start("not-the-lock-holder", lambda n: None, lambda: False, lambda: 0)
    stranger.join()
    assert isinstance(stranger.error, LockLostError) and not stranger.done  # fenced: nothing written
    assert sum(ledger.counts(prepared.job_id).values()) == 0

    run_id = ledger.start_run(prepared.job_id, "submit", exclusive=True)
    feed = ingest_beside(ledger, prepared.job_id, src)
    assert feed is not None
    woken: list[tuple[int, bool]] = []  # (new items, ended) at each wake-up
    feed.start(run_id, lambda n: woken.append((n, feed.ended)), lambda: False, lambda: 0)
    feed.join()
    assert feed.done and feed.error is None
    assert woken[0] == (500, False) and woken[-1] == (0, True), woken  # the run, woken last, sees it ended
    assert sum(n for n, _ in woken) == 1200
    assert ledger.get_job(prepared.job_id).ingest_done


def test_only_an_online_run_takes_the_ingest_beside_it(ledger: Ledger, server: FakeProviderServer, tmp_path: Path) -> None:
    src = write_records(tmp_path / "in.jsonl", 10)
    prepared = prepare_job(ledger, job_spec(server), src, ingest=False)
    assert ingests_beside(ledger, prepared.job_id, None)
    assert not ingests_beside(ledger, prepared.job_id, Overrides(mode="batch"))  # batch mode ingests first
    batch = submit(ledger, job_spec(server), src, overrides=Overrides(mode="batch"), run=False)
    assert batch.job_id == prepared.job_id and ledger.get_job(prepared.job_id).ingest_done
    assert not ingests_beside(ledger, prepared.job_id, None)  # nothing left to read


def test_records_that_make_no_job_are_an_input_error(ledger: Ledger, server: FakeProviderServer) -> None:
    with pytest.raises(InputError, match="the input is empty, so no job was created"):
        submit(ledger, job_spec(server), [])
    with pytest.raises(InputError, match=r"none of its 2 lines can be sent.*'text' is missing from the record "
                                         r"\(did you mean 'texts'\?\)"):
        submit(ledger, job_spec(server), [{"texts": "a"}, {"texts": "b"}])
    assert ledger.list_jobs() == []
    empty = submit(ledger, job_spec(server), [], allow_empty=True)
    assert empty.exit_code == ExitCode.OK and empty.total == 0 and not server.log
