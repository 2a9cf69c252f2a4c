"""The library behind the commands: find or create a job, work it, decide the exit code."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchrun import interrupt
from batchrun import tokens as token_count
from batchrun.batch import BatchOptions, BatchResult, BatchRunner
from batchrun.budget import budget_price, unbounded_answers
from batchrun.errors import (
    InputError,
    OutputInvalidError,
    SpecError,
    StoppedError,
    UsageError,
)
from batchrun.ingest import (
    BackgroundIngest,
    IngestStats,
    RequestBuilder,
    check_input,
    first_item_or_why,
    ingest,
)
from batchrun.input_hash import hash_input
from batchrun.ledger import JobRecord, Ledger, LedgerQueries, ride_out
from batchrun.ledger.shards import ShardLedger
from batchrun.pricing import Price, price_for
from batchrun.providers import provider_for
from batchrun.providers.http import Sender
from batchrun.scheduler import JobRunner, RunOptions, RunResult
from batchrun.spec import BATCH_DISCOUNT, JobSpec, Overrides
from batchrun.states import ExitCode, ItemState, StopReason, exit_code_for, no_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedJob:
    """A job ready to run: found again (``created`` False) or newly ingested."""

    job_id: int
    created: bool
    ingest: IngestStats | None


@dataclass(frozen=True)
class RunSummary:
    job_id: int
    exit_code: int
    counts: dict[str, int]
    result: RunResult | BatchResult
    at_provider: int = 0  # batch mode: items left in provider batches (a later run collects them)
    go_online: bool = False  # batch mode past its deadline: what is left goes online


def prepare_job(
    ledger: Ledger,
    spec: JobSpec,
    input_path: str | os.PathLike[str],
    *,
    new: bool = False,
    strict: bool = False,
    allow_empty: bool = False,
    ingest: bool = True,
    on_batch: Callable[[IngestStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> PreparedJob:
    """Find the job for this spec and input content, or create it and ingest the input.

    An interrupted ingest is carried on from its last stored line; with ``ingest``
    False it is left to the run (:func:`ingest_beside`). No job is created for an
    input that would have no item to send (InputError, exit 2): one whose every
    line is rejected, or an empty one unless ``allow_empty``. With ``strict``, a
    bad line refuses the whole file before any job is created.
    """
    _check_submittable(spec)
    path = Path(input_path)
    input_hash = hash_input(path)
    existing = None if new else ledger.find_job(spec, input_hash)
    if existing is not None and ledger.get_job(existing).ingest_done:
        return PreparedJob(existing, False, None)
    builder = _builder(spec)
    if existing is None:
        if strict:
            checked = check_input(path, builder)
            if checked.rejected:
                raise _bad_lines(path, checked)
            if not checked.lines and not allow_empty:
                raise _no_items(path, checked)
        else:
            nothing = first_item_or_why(path, builder)
            if nothing is not None and (nothing.lines or not allow_empty):
                raise _no_items(path, nothing)
    job_id, created = ledger.find_or_create_job(spec, input_path=str(path.absolute()), input_hash=input_hash, new=new)
    if not ingest:
        return PreparedJob(job_id, created, None)
    stats = _ingest_locked(ledger, job_id, path, builder, on_batch, should_stop)
    return PreparedJob(job_id, created, stats)


def _no_items(path: Path, read: IngestStats) -> InputError:
    """Why an input makes no job: it is empty, or every line of it is rejected (the commonest cause named)."""
    if not read.lines:
        return InputError(
            f"{path}: the input is empty, so no job was created (an upstream export that wrote nothing?); "
            "to submit an empty input anyway, add --allow-empty"
        )
    cause = read.most_common_cause()
    assert cause is not None  # every line was rejected
    lines, line, reason = cause
    share = "every line" if lines == read.lines else f"{lines} of them"
    return InputError(
        f"{path}: none of its {read.lines} lines can be sent, so no job was created; "
        f"the commonest cause ({share}), e.g. line {line}: {reason}"
    )


def _check_submittable(spec: JobSpec) -> None:
    """What a spec needs before its input is read: SpecError (exit 2) with nothing sent or created."""
    if spec.has_template and not spec.provider.model:
        raise SpecError(f"{spec.path or 'spec'}: [provider] model is required for a template job (or pass --model)")
    budget_price(spec)  # a budget needs a known price


def _bad_lines(path: Path, checked: IngestStats) -> InputError:
    shown = "\n".join(f"  {path}:{line}: {reason}" for line, reason in checked.rejections)
    return InputError(
        f"{path}: {checked.rejected} of {checked.lines} lines are bad (--strict), nothing was submitted:\n{shown}"
    )


@dataclass
class DryRun:
    """What submitting an input would send: counts, a token estimate and a cost range. Nothing is sent."""

    input_path: str
    model: str | None
    price: Price | None  # the job's price; None: each request at its own model's list price
    budget_usd: float  # 0: no budget
    unbounded_answers: bool  # requests set no max_tokens: the maximum is a guess, not a bound
    lines: int = 0
    to_send: int = 0
    rejected: int = 0
    rejections: list[tuple[int, str]] = field(default_factory=list)  # the first few (line, reason)
    prompt_tokens: int = 0  # counted with tiktoken where it can, else ~4 bytes of request JSON per token
    prompt_counted: int = 0  # requests whose prompt tiktoken counted
    max_output_tokens: int = 0  # the requests' answer limits (max_tokens)
    min_usd: float = 0.0  # every prompt, no answer
    max_usd: float = 0.0  # every prompt, every answer at its limit
    unpriced: int = 0  # requests whose model has no known price
    unpriced_models: set[str] = field(default_factory=set)
    mode: str = "online"  # [run] mode: batch quotes the batch price beside the online one
    batch_min_usd: float = 0.0  # the same requests through the provider's batch API
    batch_max_usd: float = 0.0

    @property
    def cost_min(self) -> float | None:
        """The least these requests can cost: their prompts only (None when some have no price)."""
        return None if self.unpriced else self.min_usd

    @property
    def cost_max(self) -> float | None:
        """Every prompt, every answer at its max_tokens (None when some have no price)."""
        return None if self.unpriced else self.max_usd

    def to_json(self) -> dict[str, Any]:
        counts = no_counts()
        counts[ItemState.PENDING] = self.to_send
        counts[ItemState.REJECTED] = self.rejected
        price = self.price
        return {
            "dry_run": True,
            "job_id": None,
            "input": self.input_path,
            "model": self.model,
            "total": self.lines,
            "counts": counts,
            "to_send": self.to_send,
            "rejected": self.rejected,
            "rejections": [{"line": line, "reason": reason} for line, reason in self.rejections],
            "tokens": {
                "prompt": self.prompt_tokens,
                "prompt_counted_requests": self.prompt_counted,
                "max_output": self.max_output_tokens,
            },
            "price": None
            if price is None
            else {
                "input_per_million": price.input,
                "output_per_million": price.output,
                "cached_input_per_million": price.cached_input,
            },
            "cost_usd": None if self.unpriced else {"min": self.min_usd, "max": self.max_usd},
            "unpriced": {"requests": self.unpriced, "models": sorted(self.unpriced_models)} if self.unpriced else None,
            "budget_usd": self.budget_usd or None,
            "unbounded_answers": self.unbounded_answers,
            "mode": self.mode,
            "batch_cost_usd": None if self.unpriced else {"min": self.batch_min_usd, "max": self.batch_max_usd},
        }


def dry_run(spec: JobSpec, input_path: str | os.PathLike[str], *, strict: bool = False) -> DryRun:
    """Read and render the whole input as ``submit`` would, and estimate what it would cost.

    Same checks, same rejections, the same request the first attempt of each
    item would send (structured-output request included); no ledger is opened
    and nothing is sent. With ``strict``, a bad line raises InputError as submit does.
    Requests are priced at the job's price, else (input lines naming their own
    models) at the list price of each request's ``model``, as the run would cost them.
    """
    _check_submittable(spec)
    path = Path(input_path)
    builder = _builder(spec)
    provider = builder.provider
    report = DryRun(
        input_path=str(path),
        model=spec.provider.model,
        price=spec.price(),
        budget_usd=spec.run.budget_usd,
        unbounded_answers=unbounded_answers(spec),
        mode=spec.run.mode,
    )
    batch_price = spec.batch_price()
    listed: dict[str, Price | None] = {}
    waited: set[str] = set()

    def estimate(url: str | None, body: str) -> None:
        request = provider.prepare(url, body)
        model = spec.provider.model or orjson.loads(request.content).get("model")  # the spec's model is in every body
        model = model if isinstance(model, str) else "(none)"
        if model not in waited:  # tiktoken's table, when it has one for the model: counted, not guessed
            waited.add(model)
            token_count.COUNTER.wait_for(model, timeout=token_count.TABLE_WAIT_SECONDS)
        tokens = provider.estimate_tokens(request)
        prompt, answer = tokens.prompt, tokens.answer
        report.prompt_tokens += prompt
        report.prompt_counted += tokens.counted
        report.max_output_tokens += answer
        price, at_batch = report.price, batch_price
        if price is None:
            if model not in listed:
                listed[model] = price_for(model)
            price = listed[model]
            if price is None:
                report.unpriced += 1
                if len(report.unpriced_models) < 5:
                    report.unpriced_models.add(model)
                return
            at_batch = price.scaled(BATCH_DISCOUNT)
        report.min_usd += price.cost(prompt, 0)
        report.max_usd += price.cost(prompt, answer)
        if at_batch is not None:
            report.batch_min_usd += at_batch.cost(prompt, 0)
            report.batch_max_usd += at_batch.cost(prompt, answer)

    checked = check_input(path, builder, on_item=estimate)
    if strict and checked.rejected:
        raise _bad_lines(path, checked)
    report.lines, report.to_send, report.rejected = checked.lines, checked.accepted, checked.rejected
    report.rejections = checked.rejections
    return report


def _builder(spec: JobSpec) -> RequestBuilder:
    provider = provider_for(spec, read_key=False)
    for warning in provider.warnings:
        log.warning("%s", warning)
    return RequestBuilder(spec, provider)


def _ingest_locked(
    ledger: Ledger,
    job_id: int,
    path: Path,
    builder: RequestBuilder,
    on_batch: Callable[[IngestStats], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> IngestStats | None:
    """Ingest under the job lock, so an overlapping submit cannot ingest the same file twice.

    Every batch renews the lock and is fenced by it: an ingest that stalled past
    the lock's staleness and was taken over writes nothing more (LockLostError, exit 75).
    A signal that came while the input was read stops here, before anything is sent.
    """
    run_id = ledger.start_run(job_id, "ingest", exclusive=True, stale_after=builder.spec.run.lock_stale_seconds)
    code = ExitCode.TEMPFAIL
    try:
        if ledger.get_job(job_id).ingest_done:  # the run we waited for finished it
            code = ExitCode.OK
            return None
        stats = ingest(ledger, job_id, path, builder, run_id=run_id, on_batch=on_batch, should_stop=should_stop)
        ride_out(ledger, lambda: ledger.finish_ingest(job_id, run_id=run_id), what="ingest")
        code = ExitCode.OK
    finally:
        ledger.end_run(job_id, run_id, code)
    if should_stop and should_stop():
        raise StoppedError(
            f"stopped after reading {path} (job {job_id}: every line stored, nothing sent); "
            "run the same command again to carry on"
        )
    return stats


def finish_interrupted_ingest(
    ledger: Ledger,
    job_id: int,
    should_stop: Callable[[], bool] | None = None,
    input_path: str | os.PathLike[str] | None = None,
) -> IngestStats | None:
    """Carry on an ingest a crash interrupted (or :func:`prepare_job` left), to its end, before any run.

    From ``input_path`` (the file just submitted), else the job's own input file,
    refused (InputError) if it is gone or its content changed: the job's identity
    is that content.
    """
    job = ledger.get_job(job_id)
    if job.ingest_done:
        return None
    path = Path(input_path) if input_path is not None else _own_input(job)
    return _ingest_locked(ledger, job_id, path, _builder(job.spec), should_stop=should_stop)


def ingests_beside(ledger: Ledger, job_id: int, overrides: Overrides | None) -> bool:
    """Whether the job's run would take the rest of its ingest beside it: an online run (batch mode ingests first)."""
    job = ledger.get_job(job_id)
    return not job.ingest_done and effective_spec(job, overrides).run.mode != "batch"


def ingest_beside(
    ledger: Ledger, job_id: int, input_path: str | os.PathLike[str] | None = None
) -> BackgroundIngest | None:
    """The rest of job ``job_id``'s ingest, to run beside its run (None: its input is all in).

    ``input_path`` is the file just submitted (its content is the job's); without it, the
    job's own input file, refused (InputError) if it is gone or its content changed.
    """
    job = ledger.get_job(job_id)
    if job.ingest_done:
        return None
    path = Path(input_path) if input_path is not None else _own_input(job)
    return BackgroundIngest(ledger, job_id, path, _builder(job.spec))


def follow_key_source(ledger: Ledger, job_id: int, spec: JobSpec) -> None:
    """Job ``job_id``, made to read its API key where ``spec`` (submitted again) says: where the key
    comes from is not the job's identity, and a later ``resume`` (from cron, say) reads it there too."""
    wanted, stored = spec.provider, ledger.get_job(job_id).spec.provider
    if (wanted.api_key_env, wanted.api_key_file) != (stored.api_key_env, stored.api_key_file):
        ledger.set_key_source(job_id, wanted.api_key_env, wanted.api_key_file)


def _own_input(job: JobRecord) -> Path:
    """The job's input file, as long as its content is still the job's."""
    path = Path(job.input_path)
    if not path.is_file() or hash_input(path) != job.input_hash:
        raise InputError(
            f"job {job.id} was interrupted while reading its input and {path} is gone or has changed; "
            "submit the original file again to finish it"
        )
    return path


def effective_spec(job: JobRecord, overrides: Overrides | None) -> JobSpec:
    return job.spec.with_overrides(overrides) if overrides else job.spec


async def run_job(
    ledger: Ledger,
    job_id: int,
    *,
    overrides: Overrides | None = None,
    options: RunOptions | None = None,
    sender: Sender | None = None,
    on_start: Callable[[JobRunner | BatchRunner], None] | None = None,
    handle_signals: bool = False,
    batch: BatchOptions | None = None,
    feed: BackgroundIngest | None = None,
) -> RunSummary:
    """Work a job until it is finished or stopped; the run's end is recorded with its exit code.

    ``feed`` is the rest of the job's ingest (:func:`ingest_beside`), run beside an online
    run under its job lock: items are sent as their batch is stored, and the job is not
    finished before its whole input is in. A batch-mode job takes none (ingest it first).

    ``on_start`` gets each runner before work begins (to show progress, or to stop
    it with its ``request_stop``). With ``handle_signals``, SIGINT/SIGTERM stop the
    run for its duration (:func:`batchrun.interrupt.stop_on_signals`). A job in
    batch mode (``[run] mode``) goes through the provider's batch API
    (:class:`~batchrun.batch.BatchRunner`; ``batch`` says how, e.g. whether to wait
    for it), and online once its ``[batch] deadline`` has passed. An online job collects what an earlier batch-mode run left at the
    provider once its own work is done.
    """
    job = ledger.get_job(job_id)
    spec = effective_spec(job, overrides)
    batch = batch or BatchOptions(command=(options or RunOptions()).command)
    if spec.run.mode == "batch":
        if feed is not None:
            raise UsageError(f"job {job_id} runs in batch mode: its input is ingested before the run, not beside it")
        summary = await _run_batch(ledger, job, spec, batch, on_start, handle_signals)
        if not summary.go_online or summary.result.stop_reason is not None:
            return summary
        spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, mode="online"))
    summary = await _run_online(ledger, job, spec, options, sender, on_start, handle_signals, feed)
    if summary.result.stop_reason is None and ShardLedger(ledger).shards(job_id, open_only=True):
        collect = dataclasses.replace(batch, create=False)
        return await _run_batch(ledger, job, spec, collect, on_start, handle_signals)
    return summary


async def _run_online(
    ledger: Ledger,
    job: JobRecord,
    spec: JobSpec,
    options: RunOptions | None,
    sender: Sender | None,
    on_start: Callable[[JobRunner | BatchRunner], None] | None,
    handle_signals: bool,
    feed: BackgroundIngest | None = None,
) -> RunSummary:
    provider = provider_for(spec)
    runner = JobRunner(ledger, job, spec, provider, options, sender=sender, feed=feed)
    if runner.admission.spend is not None and unbounded_answers(spec):
        log.warning(
            "the spec sets no [request] max_tokens, so the budget reserves the provider's default guess of an "
            "answer's size for each request; longer answers can take the spend past the budget"
        )
    if on_start:
        on_start(runner)
    with _signals(runner, handle_signals):
        result = await runner.run()
    return _ended(ledger, job.id, result.run_id, result.stop_reason, result)


async def _run_batch(
    ledger: Ledger,
    job: JobRecord,
    spec: JobSpec,
    options: BatchOptions,
    on_start: Callable[[JobRunner | BatchRunner], None] | None,
    handle_signals: bool,
) -> RunSummary:
    runner = BatchRunner(ledger, job, spec, options)
    if on_start:
        on_start(runner)
    with _signals(runner, handle_signals):
        result = await runner.run()
    summary = _ended(ledger, job.id, result.run_id, result.stop_reason, result)
    return dataclasses.replace(summary, at_provider=result.at_provider, go_online=result.go_online)


def _signals(runner: JobRunner | BatchRunner, handle: bool) -> contextlib.AbstractContextManager[None]:
    """SIGINT/SIGTERM stop ``runner`` for the block, when asked to handle them."""
    if not handle:
        return contextlib.nullcontext()
    return interrupt.stop_on_signals(runner, lambda: runner.spec.run.grace_seconds)


def _ended(
    ledger: Ledger, job_id: int, run_id: str, stop_reason: StopReason | None, result: RunResult | BatchResult
) -> RunSummary:
    """A run's end: its exit code from the job's counts, recorded."""
    counts = LedgerQueries(ledger.engine).counts(job_id)
    code = exit_code_for(counts, stop_reason, ingest_done=ledger.get_job(job_id).ingest_done)
    ledger.end_run(job_id, run_id, code)
    return RunSummary(job_id, code, counts, result)


@dataclass(frozen=True)
class RevalidateReport:
    checked: int
    to_succeeded: list[str]
    to_invalid: list[str]
    skipped: int


def revalidate_job(ledger: Ledger, job_id: int, schema: Mapping[str, Any] | None = None) -> RevalidateReport:
    """Re-check stored answers against the job's schema (or ``schema``) with no API calls.

    Items move between ``succeeded`` and ``invalid_output``; truncated and
    refused answers stay invalid (no schema makes them whole).
    """
    from batchrun.validate import OutputValidator

    schema = schema if schema is not None else ledger.get_job(job_id).spec.output.schema
    if schema is None:
        raise UsageError(f"job {job_id} has no output schema; pass one with --schema")
    validator = OutputValidator(schema)
    changes: list[tuple[int, str, str | None, str | None, str | None, str | None]] = []
    to_succeeded: list[str] = []
    to_invalid: list[str] = []
    checked = skipped = 0
    for row in LedgerQueries(ledger.engine).iter_items(job_id):
        if row.state not in (ItemState.SUCCEEDED, ItemState.INVALID_OUTPUT):
            continue
        if row.error_class in ("truncated", "refusal") or row.output is None:
            skipped += 1
            continue
        checked += 1
        try:
            parsed = validator.check(row.output).parsed
        except OutputInvalidError as invalid:
            errors = orjson.dumps(invalid.errors).decode() if invalid.errors else None
            changes.append((row.item_id, ItemState.INVALID_OUTPUT, None, invalid.error_class, invalid.message, errors))
            if row.state == ItemState.SUCCEEDED:
                to_invalid.append(row.custom_id)
        else:
            changes.append((row.item_id, ItemState.SUCCEEDED, orjson.dumps(parsed).decode(), None, None, None))
            if row.state == ItemState.INVALID_OUTPUT:
                to_succeeded.append(row.custom_id)
        if len(changes) >= 1000:
            ledger.set_verdicts(changes)
            changes.clear()
    ledger.set_verdicts(changes)
    return RevalidateReport(checked, to_succeeded, to_invalid, skipped)
