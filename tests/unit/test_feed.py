"""JobRunner with an ingest beside it (a :class:`~batchrun.scheduler.Feed`): with nothing to claim it
waits for the ingest instead of ending, an ingest that fails stops the run with its error, and a
stopping run stops its ingest and waits for it before it ends. On the in-memory ledger, with a feed
the test drives; tests/acceptance/test_send_while_ingesting.py runs the real one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from batchrun.errors import InputError, LockLostError, StoppedError
from batchrun.scheduler import JobRunner, RunResult
from batchrun.states import ItemState, StopReason
from batchrun.testing.ledger import InMemoryLedger

from .test_scheduler import FakeChat, add_job, answer_after, make_spec, runner


class ScriptedFeed:
    """A feed the test ends (:meth:`finish`, :meth:`fail`); it stops by itself once ``should_stop`` says so."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self.done = False
        self.error: BaseException | None = None
        self.run_id: str | None = None
        self.joined_at: float | None = None
        self._on_batch: Callable[[int], None] = lambda n: None
        self._should_stop: Callable[[], bool] = lambda: False

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def start(
        self, run_id: str, on_batch: Callable[[int], None], should_stop: Callable[[], bool], taken: Callable[[], int]
    ) -> None:
        self.run_id, self._on_batch, self._should_stop = run_id, on_batch, should_stop

    def finish(self) -> None:
        self.done = True
        self._ended.set()
        self._on_batch(0)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._ended.set()
        self._on_batch(0)

    def join(self) -> None:
        while not self.ended:
            if self._should_stop():
                self.fail(StoppedError("stopped while reading in.jsonl at line 500"))
            time.sleep(0.005)
        self.joined_at = time.monotonic()


def with_feed(job_runner: JobRunner, feed: ScriptedFeed) -> JobRunner:
    job_runner.feed = feed
    return job_runner


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not seen in time"
        await asyncio.sleep(0.005)


def test_with_nothing_to_claim_the_run_waits_for_its_ingest_then_ends() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=4), 5)
    feed = ScriptedFeed()
    job_runner = with_feed(runner(ledger, job_id, FakeChat()), feed)

    async def main() -> tuple[RunResult, bool]:
        run = asyncio.create_task(job_runner.run())
        await until(lambda: ledger.counts(job_id)[ItemState.SUCCEEDED] == 5)
        await asyncio.sleep(0.1)
        waited = not run.done()  # everything stored is answered, but the ingest is still reading
        feed.finish()
        return await asyncio.wait_for(run, 5), waited

    result, waited = asyncio.run(main())
    assert waited, "a run does not end while its ingest may still store items"
    assert result.stop_reason is None and feed.run_id == result.run_id  # the ingest wrote under the run's lock
    assert feed.joined_at is not None


@pytest.mark.parametrize(
    ("error", "reason", "message"),
    [
        (InputError("in.jsonl: cannot read input: Input/output error"), StopReason.INPUT,
         "the rest of the input cannot be read: in.jsonl: cannot read input: Input/output error; "
         "the lines stored before it were worked, nothing after it was read"),
        (RuntimeError("the ingest thread broke"), StopReason.ERROR,
         "the ingest of the input stopped: RuntimeError: the ingest thread broke"),
        (LockLostError("job 1's lock was taken over by run abc"), StopReason.LOCK_LOST,
         "job 1's lock was taken over by run abc"),
    ],
    ids=["input-error", "bug", "lock-lost"],
)
def test_an_ingest_that_fails_stops_the_run_with_its_error(
    error: BaseException, reason: StopReason, message: str
) -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=2), 3)
    feed = ScriptedFeed()
    job_runner = with_feed(runner(ledger, job_id, FakeChat()), feed)

    async def main() -> RunResult:
        run = asyncio.create_task(job_runner.run())
        await until(lambda: ledger.counts(job_id)[ItemState.SUCCEEDED] == 3)
        feed.fail(error)
        return await asyncio.wait_for(run, 5)

    result = asyncio.run(main())
    assert result.stop_reason == reason and result.stop_message == message


def test_a_stopped_run_stops_its_ingest_and_waits_for_it() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=2), 50)
    feed = ScriptedFeed()
    job_runner = with_feed(runner(ledger, job_id, FakeChat(lambda body, asked: answer_after(0.01))), feed)

    async def main() -> tuple[RunResult, float]:
        run = asyncio.create_task(job_runner.run())
        await until(lambda: ledger.counts(job_id)[ItemState.SUCCEEDED] >= 2)
        job_runner.request_stop(StopReason.SIGNAL, "stopped by SIGTERM")
        result = await asyncio.wait_for(run, 5)
        return result, time.monotonic()

    result, returned_at = asyncio.run(main())
    assert result.stop_reason == StopReason.SIGNAL
    assert isinstance(feed.error, StoppedError) and not feed.done
    assert feed.joined_at is not None and feed.joined_at <= returned_at, "the ingest ended before the run did"
    assert ledger.counts(job_id)[ItemState.RUNNING] == 0
