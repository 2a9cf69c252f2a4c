"""Live progress of a run: a rich display on a terminal, a log line every few seconds
otherwise, and structured progress records for ``--log-file``."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from datetime import datetime
from collections.abc import Mapping
from typing import Any, TextIO

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Column

from batchrun.scheduler import JobRunner
from batchrun.states import WORKED_STATES

DEFAULT_INTERVAL_S = 10.0
log = logging.getLogger("batchrun.progress")


def snapshot(runner: JobRunner, todo: int, before: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Where the run stands: counts, rate, ETA, spend, errors by class, concurrency and rate-limit state.

    ``done``/``todo``/``succeeded``/``failed`` are this run's; ``job_done``/``job_total``/``job_succeeded``/
    ``job_failed`` add the items the job had finished before it (``before``, by state): a resume shows
    200/200 ok=200, not 122/122 ok=122 nor 200/200 ok=122.
    """
    s = runner.stats
    before = before or {}
    earlier = sum(before.get(k, 0) for k in WORKED_STATES)
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
        "job_done": earlier + done,
        "job_total": earlier + todo,
        "succeeded": s.done["succeeded"],
        "failed": s.done["failed"],
        "job_succeeded": before.get("succeeded", 0) + s.done["succeeded"],
        "job_failed": before.get("failed", 0) + s.done["failed"],
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


def _eta(snap: dict[str, Any]) -> str:
    """The ETA as H:MM:SS, hours unbounded (a day and more is 25:00:00, not 01:00:00)."""
    if snap["eta_s"] is None:
        return "-"
    minutes, seconds = divmod(int(snap["eta_s"]), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}"


def _done_before(runner: JobRunner) -> dict[str, int]:
    """Items of the job finished by earlier runs, by state (what the job counts, less this run's own)."""
    counts = runner.ledger.counts(runner.job.id)
    return {k: max(0, counts[k] - runner.stats.done[k]) for k in WORKED_STATES}


def _line(snap: dict[str, Any]) -> str:
    errors = ", ".join(f"{k}={v}" for k, v in list(snap["errors"].items())[:4]) or "none"
    paused = f" paused {snap['paused_for_s']:.1f}s" if snap["paused_for_s"] > 0 else ""
    eta = f"{snap['eta_s']:.0f}s" if snap["eta_s"] is not None else "-"
    return (
        f"done {snap['job_done']}/{snap['job_total']} ok={snap['job_succeeded']}"
        + (f" (reused {snap['cached']})" if snap["cached"] else "")
        + f" failed={snap['job_failed']} "
        f"rate={snap['rate_per_s']:.1f}/s eta={eta} in_flight={snap['in_flight']} window={snap['concurrency_now']}{paused} "
        f"tokens={snap['input_tokens']}+{snap['output_tokens']} cost=${snap['cost_usd']:.4f} errors: {errors}"
    )


def _emit(runner: JobRunner, todo: int, before: Mapping[str, int], stream: TextIO | None) -> None:
    snap = snapshot(runner, todo, before)
    log.info("progress", extra={"progress": snap})
    if stream is not None:  # a timestamp per line: cron mail and log files are read later
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        print(f"{stamp} batchrun: job {runner.job.id}: {_line(snap)}", file=stream, flush=True)


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
    out = None if quiet else stream
    try:
        while not runner.run_id:  # nothing to show before the run holds the job: an overlapping run says only that
            await asyncio.sleep(0.05)
        before = await asyncio.to_thread(_done_before, runner)
    except asyncio.CancelledError:
        if runner.run_id:  # a run over before the display began (all from the cache): its figures still go out
            try:
                _emit(runner, todo, _done_before(runner), out)
            except Exception:  # noqa: BLE001 (the ledger may be why the run stopped: its result comes first)
                log.debug("no last progress record", exc_info=True)
        raise
    if quiet or not stream.isatty():
        try:
            while True:
                await asyncio.sleep(interval)
                _emit(runner, todo, before, out)
        finally:
            _emit(runner, todo, before, out)
    console = Console(file=stream)
    next_record = time.monotonic() + interval
    # Most important first: done/total, rate and ETA keep their width; at 80 columns the bar shrinks
    # and the detail (in flight, spend, failures, errors) is cut from its end with an ellipsis.
    with Progress(
        TextColumn(f"job {runner.job.id}"),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TextColumn("eta {task.fields[eta]}"),
        BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=5)),
        TextColumn("{task.fields[detail]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1, min_width=0)),
        console=console,
        transient=False,
        expand=True,
    ) as progress:
        first = snapshot(runner, todo, before)
        task = progress.add_task("run", total=first["job_total"], detail="", rate="", eta="-")
        while True:
            snap = snapshot(runner, todo, before)
            errors = " ".join(f"{k}:{v}" for k, v in list(snap["errors"].items())[:3])
            paused = f" [yellow]paused {snap['paused_for_s']:.0f}s[/]" if snap["paused_for_s"] > 0 else ""
            progress.update(
                task,
                completed=snap["job_done"],
                total=snap["job_total"],
                rate=f"{snap['rate_per_s']:.1f}/s",
                eta=_eta(snap),
                # failures and spend before the in-flight figures: the detail is cut from its end
                detail=f"failed {snap['job_failed']}  ${snap['cost_usd']:.4f}  "
                f"in flight {snap['in_flight']}/{snap['concurrency_now']}"
                + (f"  reused {snap['cached']}" if snap["cached"] else "") + f"  {errors}{paused}",
            )
            if time.monotonic() >= next_record:
                log.info("progress", extra={"progress": snap})
                next_record += interval
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                last = snapshot(runner, todo, before)
                progress.update(task, completed=last["job_done"])
                log.info("progress", extra={"progress": last})
                raise


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per log record: time, level, logger, message, and the record's
    structured extras (``progress``, ``run``, ``job``, ``item``, ``attempt``)."""

    EXTRAS = ("progress", "run", "job", "item", "attempt")

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
