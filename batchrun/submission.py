"""Submit and resume: a job from its input to its exported output, in one call each.

- :func:`submit`: find the job for a spec and input content or create it and ingest
  the input, refuse output files it may not replace, run it (unless ``run=False``),
  and export it once it is finished. An online run sends while the input is still
  being read: the ingest goes on beside it, on a thread, and each stored batch is
  workable at once (``run=False`` and batch mode ingest the whole input first). The
  input is a file (JSONL, CSV, Parquet) or any iterable of dicts, spooled to a file
  first (batchrun/spool.py) so that the same records find the same job;
- :func:`resume`: carry on a job (an ingest a crash interrupted, beside the run), and export it;
- :func:`submit_async`, :func:`resume_async`: the same from a running event loop; the
  synchronous ledger phases (ingest, export) run in a thread.

Each returns a :class:`SubmitResult`, whose :meth:`~SubmitResult.to_json` is the
``--json`` object of ``batchrun submit`` and ``batchrun resume``.

Signals are the caller's unless it asks (``handle_signals=True``, as the command
does): then a SIGINT/SIGTERM stops the call at its next clean point (before the
job is stored, between insert batches, before the run, between export lines) with
exit 75, and during the run stops claiming and drains (batchrun/interrupt.py).
The async forms never install handlers: the loop is the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrun import interrupt
from batchrun.batch import BatchOptions, BatchRunner
from batchrun.errors import BatchrunError, ExportError, ExportWriteError, StoppedError, UsageError
from batchrun.eventloop import run_sync
from batchrun.export import (
    ExportResult,
    check_format,
    check_target,
    export_command,
    export_job,
    refuse_input,
)
from batchrun.hints import command
from batchrun.ingest import BackgroundIngest, IngestStats
from batchrun.jobs import (
    PreparedJob,
    RunSummary,
    finish_interrupted_ingest,
    follow_key_source,
    ingest_beside,
    ingests_beside,
    prepare_job,
    run_job,
)
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.providers import missing_api_key
from batchrun.providers.http import Sender
from batchrun.scheduler import JobRunner, RunOptions
from batchrun.spec import JobSpec, Overrides
from batchrun.states import ExitCode, ItemState, StopReason

PathArg = str | os.PathLike[str]
# An input file, or the records themselves (each a dict, as a JSONL line would be).
InputArg = PathArg | Iterable[Mapping[str, Any]]
# Called when the run starts, with the runner and how many items it has to work; an awaitable
# it returns (a progress display) runs beside the run and is cancelled when the run ends.
OnStart = Callable[[JobRunner, int], Awaitable[None] | None]
OnPrepared = Callable[[PreparedJob], None]


@dataclass(frozen=True)
class SubmitResult:
    """How a submit or resume ended: the job's counts, the exit code, what was written.

    ``error`` is what stopped the call after the job was known (a signal before
    the run, an export stopped or refused); its message says how to carry on, and
    ``exit_code`` is its code. The job's results are safe in the ledger either way.
    """

    job_id: int
    counts: dict[str, int]
    cached: int  # items that succeeded with an answer reused from the response cache
    exit_code: int
    stop_reason: StopReason | None = None
    stop_message: str | None = None  # why the run stopped early, when it did
    export: ExportResult | None = None
    error: BatchrunError | None = None
    ran: bool = False  # a run worked the job (False: --no-run, or stopped before the run)
    prepared: PreparedJob | None = None  # submit: whether the job was created, and its ingest

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object: the same keys on every path, null where one does not apply.

        ``job_id``, ``total``, ``counts`` (one key per item state), ``cached``,
        ``exit_code``, ``stop_reason``, ``output`` and ``errors_file`` (the files written).
        """
        export = self.export
        return {
            "job_id": self.job_id,
            "total": self.total,
            "counts": self.counts,
            "cached": self.cached,
            "exit_code": int(self.exit_code),
            "stop_reason": str(self.stop_reason) if self.stop_reason else None,
            "output": str(export.path) if export else None,
            "errors_file": str(export.errors_path) if export and export.errors_path else None,
        }


@dataclass(frozen=True)
class _Target:
    """Where a finished job is exported (nowhere without ``output``); ``fmt`` None: not said (results)."""

    output: PathArg | None
    fmt: str | None
    errors: PathArg | None
    force: bool

    def __post_init__(self) -> None:
        if self.output is not None and str(self.output) == "-":
            raise UsageError("--output -: a submit or resume writes its output to a file; "
                             "for standard output, run: batchrun export JOB --output -")

    @property
    def format(self) -> str:
        return self.fmt or "results"

    def for_job(self, ledger: Ledger, job_id: int) -> _Target:
        """This target checked for the job and remembered by it; without ``output``, the one the job
        remembers (its format and errors file unless given now). Refuses an unknown format and output
        files we may not replace, before anything is sent."""
        target = self
        if self.output is None:
            remembered = ledger.export_target(job_id)
            if remembered is not None:
                output, fmt, remembered_errors = remembered
                target = _Target(output, self.fmt or fmt, self.errors or remembered_errors, self.force)
        if target.output:
            check_format(target.format)
        for path in (target.output, target.errors):
            if not path:
                continue
            try:
                check_target(ledger, job_id, Path(path).absolute(), force=target.force)
            except ExportError as exc:
                flag = "--output" if path == target.output else "--errors"
                if target is self or (flag == "--errors" and self.errors is not None):
                    raise  # given now, not remembered
                fix = f"give {flag} FILE"
                if not Path(path).absolute().parent.is_dir():
                    fix = f"make the folder again, or {fix}"
                raise ExportError(f"{exc} (where job {job_id} was exported before, remembered as its {flag}); nothing "
                                  f"was sent: {fix}") from None
        if self.output is not None:
            errors = str(Path(self.errors).absolute()) if self.errors else None
            ledger.set_export_target(job_id, str(Path(self.output).absolute()), self.format, errors)
        return target


def submit(
    ledger: Ledger,
    spec: JobSpec,
    input_path: InputArg,
    *,
    output: PathArg | None = None,
    fmt: str | None = None,
    errors: PathArg | None = None,
    force: bool = False,
    schema: type | Mapping[str, Any] | None = None,
    new: bool = False,
    strict: bool = False,
    allow_empty: bool = False,
    run: bool = True,
    overrides: Overrides | None = None,
    options: RunOptions | None = None,
    sender: Sender | None = None,
    batch: BatchOptions | None = None,
    handle_signals: bool = False,
    require_key: bool = False,
    on_prepared: OnPrepared | None = None,
    on_start: OnStart | None = None,
) -> SubmitResult:
    """Submit ``input_path`` under ``spec`` and work it to the end; export to ``output`` when it is finished.

    ``input_path`` is a file, or an iterable of dicts (spooled to a file in the ledger's folder).
    ``schema`` (a Pydantic model class, or a JSON Schema) replaces the spec's ``[output] schema``.
    The same spec and input content find the existing job and carry it on (``new``:
    always a new job); ``strict`` refuses the whole input if a line is bad. An input
    with no line to send (empty, unless ``allow_empty``, or every line rejected)
    creates no job: InputError.
    ``overrides`` are the run-time settings that win over the stored spec.
    ``on_prepared`` gets the job once it is stored, before the run. With ``require_key`` (the
    command line), a run whose API key variable is not set is refused (SpecError, exit 2) before
    the job is stored.
    """
    target = _Target(output, fmt, errors, force)
    spec = spec.with_output_schema(schema) if schema is not None else spec
    if require_key and run:
        _require_key(spec)
    if isinstance(input_path, (str, os.PathLike)) and str(input_path) != "-":
        for path in (output, errors):
            if path:  # refused before the job is stored
                refuse_input(path, input_path)
    if handle_signals:
        interrupt.stop_point("before the job was stored (nothing was sent); run the same command again to carry on")
    path = input_file(ledger, input_path)
    with _holding(handle_signals) as should_stop:
        prepared, feed = _prepare(ledger, spec, path, new, strict, allow_empty, run, overrides, should_stop)
        target = _check_target(ledger, target, prepared, feed, path, should_stop)
    if on_prepared:
        on_prepared(prepared)
    if not run:
        return _as_stored(ledger, prepared.job_id, prepared)
    if not prepared.created:  # about to run it (its key checked, with require_key): it reads the key there now
        follow_key_source(ledger, prepared.job_id, spec)
    return _run_and_export(
        ledger, prepared.job_id, target, prepared, handle_signals,
        overrides=overrides, options=options or RunOptions(command="submit"), sender=sender, batch=batch,
        on_start=on_start, feed=feed,
    )


def resume(
    ledger: Ledger,
    job_id: int,
    *,
    output: PathArg | None = None,
    fmt: str | None = None,
    errors: PathArg | None = None,
    force: bool = False,
    overrides: Overrides | None = None,
    options: RunOptions | None = None,
    sender: Sender | None = None,
    batch: BatchOptions | None = None,
    handle_signals: bool = False,
    require_key: bool = False,
    on_start: OnStart | None = None,
) -> SubmitResult:
    """Carry on job ``job_id``: finish an ingest a crash interrupted, work what is left, export to ``output``.

    Finished items are never sent again; pending ones and those a dead run left
    running are. JobNotFoundError for an unknown job; with ``require_key``, SpecError
    (exit 2) before anything is sent when the job's API key variable is not set.
    """
    target = _Target(output, fmt, errors, force)
    if handle_signals:
        interrupt.stop_point(f"before the run started; carry on with: {command(ledger.url, 'resume', job_id)}")
    job = ledger.get_job(job_id)
    if require_key:
        _require_key(job.spec, job_id)
    target = target.for_job(ledger, job_id)
    with _holding(handle_signals) as should_stop:
        feed, _ = _rest_of_ingest(ledger, job_id, None, True, overrides, should_stop)
    return _run_and_export(
        ledger, job_id, target, None, handle_signals,
        overrides=overrides, options=options or RunOptions(command="resume"), sender=sender, batch=batch,
        on_start=on_start, feed=feed,
    )


async def submit_async(
    ledger: Ledger,
    spec: JobSpec,
    input_path: InputArg,
    *,
    output: PathArg | None = None,
    fmt: str | None = None,
    errors: PathArg | None = None,
    force: bool = False,
    schema: type | Mapping[str, Any] | None = None,
    new: bool = False,
    strict: bool = False,
    allow_empty: bool = False,
    run: bool = True,
    overrides: Overrides | None = None,
    options: RunOptions | None = None,
    sender: Sender | None = None,
    batch: BatchOptions | None = None,
    on_prepared: OnPrepared | None = None,
    on_start: OnStart | None = None,
) -> SubmitResult:
    """:func:`submit` on the running loop: the ingest and the export run in a thread; no signal handlers."""
    target = _Target(output, fmt, errors, force)
    spec = spec.with_output_schema(schema) if schema is not None else spec
    path = await asyncio.to_thread(input_file, ledger, input_path)
    prepared, feed = await asyncio.to_thread(
        _prepare, ledger, spec, path, new, strict, allow_empty, run, overrides, None
    )
    target = await asyncio.to_thread(_check_target, ledger, target, prepared, feed, path, None)
    if on_prepared:
        on_prepared(prepared)
    if not run:
        return await asyncio.to_thread(_as_stored, ledger, prepared.job_id, prepared)
    summary = await _work(ledger, prepared.job_id, overrides, options or RunOptions(command="submit"), sender,
                          batch, on_start, feed, handle_signals=False)
    return await asyncio.to_thread(_finish, ledger, summary, target, _read_beside(prepared, feed), None)


async def resume_async(
    ledger: Ledger,
    job_id: int,
    *,
    output: PathArg | None = None,
    fmt: str | None = None,
    errors: PathArg | None = None,
    force: bool = False,
    overrides: Overrides | None = None,
    options: RunOptions | None = None,
    sender: Sender | None = None,
    batch: BatchOptions | None = None,
    on_start: OnStart | None = None,
) -> SubmitResult:
    """:func:`resume` on the running loop: the ingest and the export run in a thread; no signal handlers."""
    target = _Target(output, fmt, errors, force)
    await asyncio.to_thread(ledger.get_job, job_id)
    target = await asyncio.to_thread(target.for_job, ledger, job_id)
    feed, _ = await asyncio.to_thread(_rest_of_ingest, ledger, job_id, None, True, overrides, None)
    summary = await _work(ledger, job_id, overrides, options or RunOptions(command="resume"), sender,
                          batch, on_start, feed, handle_signals=False)
    return await asyncio.to_thread(_finish, ledger, summary, target, None, None)


def input_file(ledger: Ledger, input_path: InputArg) -> PathArg:
    """The file to submit: ``input_path`` itself, or the records spooled to a file named by their content."""
    if isinstance(input_path, (str, os.PathLike)):
        return input_path
    from batchrun.spool import spool_dir, spool_records

    return spool_records(spool_dir(ledger.url), input_path)


def _require_key(spec: JobSpec, job_id: int | None = None) -> None:
    missing = missing_api_key(spec, job_id=job_id)
    if missing is not None:
        raise missing


def _prepare(
    ledger: Ledger,
    spec: JobSpec,
    path: PathArg,
    new: bool,
    strict: bool,
    allow_empty: bool,
    run: bool,
    overrides: Overrides | None,
    should_stop: Callable[[], bool] | None,
) -> tuple[PreparedJob, BackgroundIngest | None]:
    """The job for ``path`` (found or created), and the rest of its ingest when it goes on beside the run."""
    prepared = prepare_job(ledger, spec, path, new=new, strict=strict, allow_empty=allow_empty, ingest=False)
    feed, stats = _rest_of_ingest(ledger, prepared.job_id, path, run, overrides, should_stop)
    return (dataclasses.replace(prepared, ingest=stats) if stats is not None else prepared), feed


def _rest_of_ingest(
    ledger: Ledger,
    job_id: int,
    path: PathArg | None,
    run: bool,
    overrides: Overrides | None,
    should_stop: Callable[[], bool] | None,
) -> tuple[BackgroundIngest | None, IngestStats | None]:
    """What is left of the job's ingest: beside an online run (the feed), else done here and now (its stats).

    ``path``: the file just submitted (else the job's own, checked unchanged).
    """
    if run and ingests_beside(ledger, job_id, overrides):
        return ingest_beside(ledger, job_id, path), None
    return None, finish_interrupted_ingest(ledger, job_id, should_stop, input_path=path)


def _check_target(
    ledger: Ledger,
    target: _Target,
    prepared: PreparedJob,
    feed: BackgroundIngest | None,
    path: PathArg,
    should_stop: Callable[[], bool] | None,
) -> _Target:
    """:meth:`_Target.for_job`; a refused target still leaves the job wholly stored (as a submit that
    ingests before its run does), so that fixing the command carries it on with nothing to read."""
    try:
        return target.for_job(ledger, prepared.job_id)
    except BatchrunError:
        if feed is not None:
            finish_interrupted_ingest(ledger, prepared.job_id, should_stop, input_path=path)
        raise


def _read_beside(prepared: PreparedJob | None, feed: BackgroundIngest | None) -> PreparedJob | None:
    """The submitted job with what the ingest beside its run read (its rejected lines, for messages)."""
    if prepared is None or feed is None or feed.stats is None:
        return prepared
    return dataclasses.replace(prepared, ingest=feed.stats)


def _holding(handle_signals: bool) -> contextlib.AbstractContextManager[Callable[[], bool] | None]:
    """The ``should_stop`` of a synchronous phase: a signal, when the caller asked for them."""
    return interrupt.holding() if handle_signals else contextlib.nullcontext()


def _as_stored(ledger: Ledger, job_id: int, prepared: PreparedJob | None) -> SubmitResult:
    """The job as it is in the ledger, not run (``--no-run``)."""
    queries = LedgerQueries(ledger.engine)
    return SubmitResult(job_id, queries.counts(job_id), queries.cached_count(job_id), ExitCode.OK, prepared=prepared)


def _run_and_export(
    ledger: Ledger,
    job_id: int,
    target: _Target,
    prepared: PreparedJob | None,
    handle_signals: bool,
    *,
    overrides: Overrides | None,
    options: RunOptions,
    sender: Sender | None,
    batch: BatchOptions | None,
    on_start: OnStart | None,
    feed: BackgroundIngest | None = None,
) -> SubmitResult:
    name = interrupt.received() if handle_signals else None
    resume_command = command(ledger.url, "resume", job_id)
    if name is not None:  # the last stop point before the run
        stored = _as_stored(ledger, job_id, prepared)
        return dataclasses.replace(
            stored, exit_code=ExitCode.TEMPFAIL, stop_reason=StopReason.SIGNAL,
            error=StoppedError(f"stopped by {name} before the run started; carry on with: {resume_command}"),
        )
    if handle_signals:
        interrupt.carry_on_with(resume_command)
    summary = run_sync(_work(ledger, job_id, overrides, options, sender, batch, on_start, feed,
                             handle_signals=handle_signals))
    prepared = _read_beside(prepared, feed)
    with _holding(handle_signals) as should_stop:
        return _finish(ledger, summary, target, prepared, should_stop)


async def _work(
    ledger: Ledger,
    job_id: int,
    overrides: Overrides | None,
    options: RunOptions,
    sender: Sender | None,
    batch: BatchOptions | None,
    on_start: OnStart | None,
    feed: BackgroundIngest | None,
    *,
    handle_signals: bool,
) -> RunSummary:
    """The run, with what ``on_start`` returned running beside it (online runs: a batch-mode
    run reports through ``batch.on_event``)."""
    todo = 0
    if on_start is not None:
        counts = await asyncio.to_thread(LedgerQueries(ledger.engine).counts, job_id)
        todo = counts[ItemState.PENDING] + counts[ItemState.RUNNING]
    beside: asyncio.Future[None] | None = None

    def started(runner: JobRunner | BatchRunner) -> None:
        nonlocal beside
        if not isinstance(runner, JobRunner) or beside is not None:
            return
        shown = on_start(runner, todo) if on_start is not None else None
        if shown is not None:
            beside = asyncio.ensure_future(shown)

    try:
        return await run_job(ledger, job_id, overrides=overrides, options=options, sender=sender, on_start=started,
                             handle_signals=handle_signals, batch=batch, feed=feed)
    finally:
        if beside is not None:
            beside.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beside


def _finish(
    ledger: Ledger,
    summary: RunSummary,
    target: _Target,
    prepared: PreparedJob | None,
    should_stop: Callable[[], bool] | None,
) -> SubmitResult:
    """Export a finished job (succeeded, or some items failed) and say how the call ended."""
    exported = None
    error: BatchrunError | None = None  # the job is finished, its output file is not
    job_id, output = summary.job_id, target.output
    if output and summary.exit_code in (ExitCode.OK, ExitCode.SOME_FAILED):
        try:
            exported = export_job(ledger, job_id, output, fmt=target.format, errors=target.errors, force=target.force,
                                  should_stop=should_stop)
        except StoppedError as exc:
            again = export_command(job_id, output, target.format, target.errors, ledger_url=ledger.url)
            error = StoppedError(f"{interrupt.received() or 'signal'}: {exc.message}; job {job_id} is finished; "
                                 f"write the output with: {again}")
        except ExportWriteError as exc:
            error = exc
    stop_reason = summary.result.stop_reason or (StopReason.SIGNAL if isinstance(error, StoppedError) else None)
    return SubmitResult(
        job_id,
        summary.counts,
        LedgerQueries(ledger.engine).cached_count(job_id),
        error.exit_code if error is not None else summary.exit_code,
        stop_reason=stop_reason,
        stop_message=summary.result.stop_message,
        export=exported,
        error=error,
        ran=True,
        prepared=prepared,
    )
