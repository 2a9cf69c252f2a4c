"""Live progress of a run: a rich display on a terminal, a log line every few seconds
otherwise, and structured progress records for ``--log-file``."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, TextIO

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from batchrun.scheduler import JobRunner
from batchrun.states import WORKED_STATES

DEFAULT_INTERVAL_S = 10.0
log = logging.getLogger("batchrun.progress")


def snapshot(runner: JobRunner, todo: int) -> dict[str, Any]:
    """Where the run stands: counts, rate, ETA, spend, errors by class, concurrency and rate-limit state."""
    s = runner.stats
    todo += s.fed  # items the ingest beside the run has stored since it started
    done = sum(s.done[k] for k in WORKED_STATES)
    elapsed = max(1e-9, time.time() - s.started_at)
    rate = done / elapsed
    rate_limits: dict[str, float] = {}
    admission = runner.admission
    if admission.request_budget is not None and admission.request_budget.rate is not None:
        rate_limits["rpm_now"] = round(admission.request_budget.rate * 60.0, 1)
    if admission.token_budget is not None:
        rate_limits["tpm_now"] = round(admission.token_budget.rate * 60.0, 1)
    return {
        "job_id": runner.job.id,
        "run_id": runner.run_id,
        "elapsed_s": round(elapsed, 3),
        "todo": todo,
        "done": done,
        "succeeded": s.done["succeeded"],
        "failed": s.done["failed"],
        "invalid_output": s.done["invalid_output"],
        "cached": s.cached,  # succeeded from the response cache (counted in done and succeeded)
        "rate_per_s": round(rate, 3),
        "eta_s": round((todo - done) / rate, 1) if rate > 0 and todo > done else None,
        "requests": s.requests,
        "in_flight": s.in_flight,
        "concurrency_now": s.window,
        "concurrency_max": runner.spec.run.concurrency,
        "paused_for_s": round(s.paused_for, 3),
        **rate_limits,
        "input_tokens": s.input_tokens,
        "output_tokens": s.output_tokens,
        "cost_usd": round(s.cost_usd, 6),
        "errors": dict(s.errors.most_common()),
    }


def _line(snap: dict[str, Any]) -> str:
    errors = ", ".join(f"{k}={v}" for k, v in list(snap["errors"].items())[:4]) or "none"
    paused = f" paused {snap['paused_for_s']:.1f}s" if snap["paused_for_s"] > 0 else ""
    eta = f"{snap['eta_s']:.0f}s" if snap["eta_s"] is not None else "-"
    return (
        f"done {snap['done']}/{snap['todo']} ok={snap['succeeded']}"
        + (f" (reused {snap['cached']})" if snap["cached"] else "")
        + f" failed={snap['failed']} "
        f"rate={snap['rate_per_s']:.1f}/s eta={eta} in_flight={snap['in_flight']} window={snap['concurrency_now']}{paused} "
        f"tokens={snap['input_tokens']}+{snap['output_tokens']} cost=${snap['cost_usd']:.4f} errors: {errors}"
    )


def _emit(runner: JobRunner, todo: int, stream: TextIO | None) -> None:
    snap = snapshot(runner, todo)
    log.info("progress", extra={"progress": snap})
    if stream is not None:
        print(f"batchrun: job {runner.job.id}: {_line(snap)}", file=stream, flush=True)


async def show_progress(
    runner: JobRunner,
    todo: int,
    *,
    stream: TextIO | None = None,
    interval: float = DEFAULT_INTERVAL_S,
    quiet: bool = False,
) -> None:
    """Render progress until cancelled. ``todo`` is the number of items this run has to work.

    Every ``interval`` seconds a ``progress`` log record carries :func:`snapshot`
    (``--log-file`` writes it as a JSON line); on a terminal a live bar is drawn,
    otherwise the same figures go to ``stream`` as one line. ``quiet``: log records only.
    """
    stream = stream or sys.stderr
    if quiet or not stream.isatty():
        out = None if quiet else stream
        try:
            while True:
                await asyncio.sleep(interval)
                _emit(runner, todo, out)
        finally:
            _emit(runner, todo, out)
    console = Console(file=stream)
    next_record = time.monotonic() + interval
    with Progress(
        TextColumn(f"job {runner.job.id}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[detail]}"),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("run", total=todo, detail="")
        while True:
            snap = snapshot(runner, todo)
            errors = " ".join(f"{k}:{v}" for k, v in list(snap["errors"].items())[:3])
            paused = f" [yellow]paused {snap['paused_for_s']:.0f}s[/]" if snap["paused_for_s"] > 0 else ""
            progress.update(
                task,
                completed=snap["done"],
                total=snap["todo"],
                detail=f"in flight {snap['in_flight']}/{snap['concurrency_now']}  ${snap['cost_usd']:.4f}  "
                f"failed {snap['failed']}" + (f"  reused {snap['cached']}" if snap["cached"] else "")
                + f"  {errors}{paused}",
            )
            if time.monotonic() >= next_record:
                log.info("progress", extra={"progress": snap})
                next_record += interval
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                progress.update(task, completed=sum(runner.stats.done[k] for k in WORKED_STATES))
                log.info("progress", extra={"progress": snapshot(runner, todo)})
                raise


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per log record: time, level, logger, message, and the record's
    structured extras (``progress``, ``job``, ``item``, ``attempt``)."""

    EXTRAS = ("progress", "job", "item", "attempt")

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in self.EXTRAS:
            value = record.__dict__.get(key)
            if value is not None:
                entry[key] = value
        if record.exc_text:
            entry["exception"] = record.exc_text
        elif record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()
