"""``batchrun worker``: a long-lived process working jobs of a PostgreSQL ledger beside other workers.

The whole loop, in one place:

- every ``poll_interval`` the worker sweeps the jobs it serves for items whose
  lease expired (their worker died) back to ``pending``, then asks the ledger
  which jobs have items pending or running;
- each job with pending items gets a :class:`~batchrun.scheduler.JobRunner`
  (a non-exclusive run: claims with ``FOR UPDATE SKIP LOCKED`` and leases,
  renews them by heartbeat); the worker's ``concurrency`` is split evenly among
  the jobs it is working, each capped by its own spec;
- a runner ends when its job has nothing left to claim; the job is picked up
  again if items come back (a dead worker's, or ``batchrun retry``);
- a stop (signal, ``max_runtime``) stops claiming everywhere, lets requests in
  flight finish within the jobs' grace period and puts the rest back to
  ``pending``; with ``exit_when_idle`` the worker also ends once no job it
  serves has items pending or running (nothing left to do or to wait for).

Exit codes: 0 when it ended idle (nothing left) or was stopped with nothing
left; 75 when stopped with work left, or when the ledger stayed unreachable
longer than ``ledger_retry_seconds``.

A job the worker cannot work (a spec error such as a missing API key, a key the
provider refuses, an endpoint down for ``outage_seconds``) is left alone for
``job_backoff_seconds`` and retried after that; the other jobs go on.

SQLite is refused (:func:`refuse_sqlite`): its ledger serves one run per job on
one machine (use ``submit``/``resume`` there).

:func:`serve` is ``batchrun worker`` in one call: the refusal before the ledger is
opened, the worker, the event loop and, when asked, the signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchrun import interrupt
from batchrun.errors import BatchrunError, LedgerWriteError, UsageError
from batchrun.eventloop import run_sync
from batchrun.jobs import effective_spec
from batchrun.ledger import (
    LEDGER_RETRY_SECONDS,
    AsyncLedger,
    Ledger,
    LedgerQueries,
    is_database_error,
    resolve_db_url,
)
from batchrun.providers import missing_api_key, provider_for
from batchrun.scheduler import JobRunner, RunOptions
from batchrun.spec import Overrides
from batchrun.states import ExitCode, StopReason, exit_code_for

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 32


@dataclass(frozen=True)
class WorkerOptions:
    """How a worker behaves; the jobs' own specs (with the overrides) say how each job is sent."""

    concurrency: int = DEFAULT_CONCURRENCY  # requests in flight in this process, shared by its jobs
    poll_interval: float = 2.0
    exit_when_idle: bool = False
    max_runtime: float = 0.0  # 0: until stopped
    lease_seconds: float | None = None  # None: each job's spec (120 s by default)
    ledger_retry_seconds: float = LEDGER_RETRY_SECONDS
    job_backoff_seconds: float = 300.0
    transport: str = "aiohttp"
    require_key: bool = False  # a job whose API key variable is not set is backed off, naming it (the command)


@dataclass
class WorkerStats:
    """Live figures of a worker, for logs and progress."""

    started_at: float = field(default_factory=time.time)
    runs: int = 0
    done: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class WorkerResult:
    exit_code: int
    stop_reason: StopReason | None
    stop_message: str | None
    jobs: tuple[int, ...]  # the jobs this worker worked on
    done: dict[str, int]  # items it finished (or released), by state


class Worker:
    """Serves ``job_ids`` (or every job) of a PostgreSQL ledger until stopped or idle."""

    def __init__(
        self,
        ledger: Ledger,
        job_ids: Sequence[int] | None = None,
        *,
        overrides: Overrides | None = None,
        options: WorkerOptions | None = None,
    ) -> None:
        refuse_sqlite(ledger.url)
        self.ledger = ledger
        self.job_ids = sorted(set(job_ids)) if job_ids else None
        # The worker's own --concurrency and --max-runtime are worker-wide, not per job.
        self.overrides = (overrides or Overrides()).without("concurrency", "max_runtime")
        self.options = options or WorkerOptions()
        self.stats = WorkerStats()
        self.runners: dict[int, JobRunner] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._backoff: dict[int, float] = {}
        self._worked: set[int] = set()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._stop_reason: StopReason | None = None
        self._stop_message: str | None = None
        self._db = AsyncLedger(
            ledger, ride_out_seconds=self.options.ledger_retry_seconds, thread_name="batchrun-worker"
        )

    # -- control ------------------------------------------------------------

    def request_stop(self, reason: StopReason, message: str | None = None) -> None:
        """Stop claiming everywhere and wind down (first reason wins)."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_message = message
            log.info("stopping worker: %s", message or reason)
        self._stop.set()
        self._wake.set()
        for runner in self.runners.values():
            runner.request_stop(reason, message)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def grace_seconds(self) -> float:
        """The longest grace period of the jobs being worked (what a stop may take)."""
        return max((r.spec.run.grace_seconds for r in self.runners.values()), default=0.0)

    # -- the loop -----------------------------------------------------------

    async def run(self, *, handle_signals: bool = False) -> WorkerResult:
        """Work until stopped (or idle with ``exit_when_idle``); raises JobNotFoundError for an unknown JOB.

        With ``handle_signals``, SIGINT/SIGTERM stop it for its duration
        (:func:`batchrun.interrupt.stop_on_signals`): stop claiming, drain within
        the jobs' grace period; a second signal exits at once.
        """
        signals = interrupt.stop_on_signals(self, lambda: self.grace_seconds) if handle_signals else None
        with signals or contextlib.nullcontext():
            return await self._run()

    async def _run(self) -> WorkerResult:
        deadline = None
        try:
            for job_id in self.job_ids or ():
                await self._db.call(self.ledger.get_job, job_id)
            if self.options.max_runtime > 0:
                deadline = asyncio.get_running_loop().call_later(
                    self.options.max_runtime,
                    self.request_stop,
                    StopReason.DEADLINE,
                    f"--max-runtime of {self.options.max_runtime:g} s reached",
                )
            try:
                await self._poll()
            finally:
                for runner in self.runners.values():
                    runner.request_stop(self._stop_reason or StopReason.STOP, self._stop_message)
                if self._tasks:
                    await asyncio.wait(list(self._tasks.values()))
            code = await self._exit_code()
        except LedgerWriteError as exc:
            self.request_stop(StopReason.LEDGER, exc.message)
            await self._drain()
            code = ExitCode.TEMPFAIL
        except Exception as exc:
            if not isinstance(exc, BatchrunError) and is_database_error(exc):
                message = (
                    f"the ledger stayed unreachable for {self.options.ledger_retry_seconds:g} s: "
                    f"{type(exc).__name__}: {exc}. What was committed is safe; start the worker again"
                )
                self.request_stop(StopReason.LEDGER, message)
                await self._drain()
                code = ExitCode.TEMPFAIL
            else:
                self.request_stop(StopReason.ERROR, f"{type(exc).__name__}: {exc}")
                await self._drain()
                raise
        finally:
            if deadline is not None:
                deadline.cancel()
            self._db.close(wait=False)
        return WorkerResult(code, self._stop_reason, self._stop_message, tuple(sorted(self._worked)), dict(self.stats.done))

    async def _drain(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    async def _poll(self) -> None:
        while not self.stopping:
            swept = await self._db.call(self.ledger.requeue_expired_jobs, self.job_ids)
            if swept:
                log.warning("put %d items whose lease expired (their worker is gone) back to pending", swept)
            open_jobs = await self._db.call(self.ledger.open_jobs, self.job_ids)
            now = time.monotonic()
            for job_id, has_pending in open_jobs:
                if has_pending and job_id not in self._tasks and self._backoff.get(job_id, 0.0) <= now:
                    self._start(job_id)
            if not open_jobs and not self._tasks and self.options.exit_when_idle:
                self._stop_reason = self._stop_reason or StopReason.IDLE
                self._stop_message = self._stop_message or "nothing left to do in the jobs served"
                return
            try:
                await asyncio.wait_for(self._wake.wait(), self.options.poll_interval)
            except TimeoutError:
                pass
            self._wake.clear()

    def _start(self, job_id: int) -> None:
        task = asyncio.create_task(self._serve(job_id), name=f"batchrun-job-{job_id}")
        self._tasks[job_id] = task

        def ended(t: asyncio.Task[None]) -> None:
            self._tasks.pop(job_id, None)
            self._wake.set()
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if isinstance(exc, LedgerWriteError):
                    self.request_stop(StopReason.LEDGER, exc.message)
                else:
                    self.request_stop(StopReason.ERROR, f"job {job_id}: {type(exc).__name__}: {exc}")

        task.add_done_callback(ended)

    def _rebalance(self) -> None:
        """Split the worker's concurrency evenly among the jobs it is working."""
        if not self.runners:
            return
        share, extra = divmod(self.options.concurrency, len(self.runners))
        for i, runner in enumerate(self.runners.values()):
            runner.set_concurrency(max(1, share + (1 if i < extra else 0)))

    async def _serve(self, job_id: int) -> None:
        """One run of one job: until it has nothing left to claim or the worker stops."""
        job = await self._db.call(self.ledger.get_job, job_id)
        try:
            spec = effective_spec(job, self.overrides)
            spec = dataclasses.replace(
                spec,
                run=dataclasses.replace(
                    spec.run, max_runtime=0.0, concurrency=min(spec.run.concurrency, self.options.concurrency)
                ),
            )
            missing = missing_api_key(spec, job_id=job_id) if self.options.require_key else None
            if missing is not None:
                raise missing
            provider = provider_for(spec)
        except BatchrunError as exc:
            self._back_off(job_id, exc.message)
            return
        if spec.run.mode == "batch":
            self._back_off(job_id, f"it is in batch mode ([run] mode = \"batch\"): `batchrun resume {job_id}` works "
                                   "it through the provider's batch API; workers send online requests")
            return
        runner = JobRunner(
            self.ledger,
            job,
            spec,
            provider,
            RunOptions(
                command="worker",
                exclusive=False,
                transport=self.options.transport,
                lease_seconds=self.options.lease_seconds,
                ledger_retry_seconds=self.options.ledger_retry_seconds,
            ),
        )
        if self.stopping:
            return
        self.runners[job_id] = runner
        self._worked.add(job_id)
        self.stats.runs += 1
        self._rebalance()
        log.info("working job %d (%s)", job_id, job.name or job.input_path)
        try:
            result = await runner.run()
        finally:
            self.runners.pop(job_id, None)
            self._rebalance()
            self.stats.done.update(runner.stats.done)
        counts = await self._db.call(LedgerQueries(self.ledger.engine).counts, job_id)
        code = exit_code_for(counts, result.stop_reason, ingest_done=job.ingest_done)
        await self._db.call(self.ledger.end_run, job_id, result.run_id, code)
        if result.stop_reason in (StopReason.AUTH, StopReason.REFUSED, StopReason.OUTAGE, StopReason.ERROR,
                                  StopReason.BUDGET):
            self._back_off(job_id, result.stop_message or result.stop_reason or "")

    def _back_off(self, job_id: int, why: str) -> None:
        wait = self.options.job_backoff_seconds
        log.error("job %d cannot be worked now: %s; trying it again in %g s", job_id, why, wait)
        self._backoff[job_id] = time.monotonic() + wait

    async def _exit_code(self) -> int:
        if self._stop_reason == StopReason.IDLE:
            return ExitCode.OK
        if self._stop_reason == StopReason.LEDGER:
            return ExitCode.TEMPFAIL
        try:
            left = await self._db.call(self.ledger.open_jobs, self.job_ids)
        except Exception as exc:  # the ledger is gone: whether work is left is unknown, so assume it is
            log.warning("cannot tell whether work is left: %s", exc)
            return ExitCode.TEMPFAIL
        return ExitCode.TEMPFAIL if left else ExitCode.OK


def refuse_sqlite(url: str) -> None:
    """UsageError (exit 2) for a SQLite ledger: it serves one run per job on one machine."""
    if url.startswith("sqlite"):
        raise UsageError(
            "batchrun worker needs a PostgreSQL ledger (--db postgresql+psycopg://... or BATCHRUN_DB); a SQLite "
            "ledger serves one run per job on one machine: use `batchrun submit` / `batchrun resume JOB` there"
        )


def serve(
    db: str | os.PathLike[str] | None,
    job_ids: Sequence[int] | None = None,
    *,
    overrides: Overrides | None = None,
    options: WorkerOptions | None = None,
    handle_signals: bool = False,
    on_start: Callable[[Worker], None] | None = None,
) -> WorkerResult:
    """Work ``job_ids`` (or every job with work) of the PostgreSQL ledger ``db`` until stopped or idle.

    A SQLite ledger is refused before it is opened (nothing is created). With
    ``handle_signals``, a SIGINT/SIGTERM before the loop stops here (StoppedError,
    exit 75, nothing claimed), and during it as :meth:`Worker.run` says.
    ``on_start`` gets the worker before it starts.
    """
    refuse_sqlite(resolve_db_url(db))
    where = "before the worker started (nothing was claimed); start a worker again"
    if handle_signals:
        interrupt.stop_point(where)
    with Ledger.open(db) as ledger:
        worker = Worker(ledger, job_ids, overrides=overrides, options=options)
        if on_start:
            on_start(worker)
        if handle_signals:
            interrupt.stop_point(where)
        return run_sync(worker.run(handle_signals=handle_signals))
