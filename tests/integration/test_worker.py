"""``Worker`` in-process over real PostgreSQL and the real local server: several jobs, shared fairly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchrun.errors import JobNotFoundError
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.spec import Overrides
from batchrun.testing import FakeProviderServer, Faults
from batchrun.worker import Worker, WorkerOptions
from batchrun.states import ExitCode, ItemState

from .test_scheduler import batch_lines, submit

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_ledger(pg_url: str) -> Iterator[Ledger]:
    led = Ledger.open(pg_url)
    try:
        yield led
    finally:
        led.close()


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(latency_s=0.01, seed=5)) as srv:
        yield srv


@pytest.mark.slow
def test_every_job_is_served_side_by_side(
    pg_ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    first = submit(pg_ledger, server, write_jsonl(batch_lines(400, "a"), "a.jsonl"))
    second = submit(pg_ledger, server, write_jsonl(batch_lines(400, "b"), "b.jsonl"))
    worker = Worker(pg_ledger, options=WorkerOptions(concurrency=8, poll_interval=0.2, exit_when_idle=True))
    shares: list[dict[int, int]] = []

    async def go() -> int:
        async def watch() -> None:
            while True:
                shares.append({j: r.admission.controller.limit for j, r in worker.runners.items()})
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            return (await worker.run()).exit_code
        finally:
            watcher.cancel()

    assert asyncio.run(go()) == ExitCode.OK
    for job_id in (first, second):
        assert LedgerQueries(pg_ledger.engine).counts(job_id)[ItemState.SUCCEEDED] == 400
    assert {first: 4, second: 4} in shares, "both jobs at once, the worker's slots split evenly"
    keys = [r.key or "" for r in server.log]
    # Fair: the second job did not wait for the first to finish.
    assert max(i for i, k in enumerate(keys) if k.startswith("a")) > min(i for i, k in enumerate(keys) if k.startswith("b"))
    assert len(keys) == 800


def test_unknown_job_and_stop_with_work_left(
    pg_ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    with pytest.raises(JobNotFoundError):
        asyncio.run(Worker(pg_ledger, [99]).run())
    job_id = submit(pg_ledger, server, write_jsonl(batch_lines(2000)))
    worker = Worker(pg_ledger, [job_id], overrides=Overrides(concurrency=999), options=WorkerOptions(concurrency=4))

    async def go() -> int:
        asyncio.get_running_loop().call_later(1.0, worker.request_stop, "signal", "test")
        return (await worker.run()).exit_code

    assert asyncio.run(go()) == ExitCode.TEMPFAIL
    counts = LedgerQueries(pg_ledger.engine).counts(job_id)
    assert counts[ItemState.RUNNING] == 0 and 0 < counts[ItemState.SUCCEEDED] < 2000
