"""Live progress of a run: a rich display on a terminal, a log line every few seconds otherwise."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from batchrun.scheduler import JobRunner

FINAL = ("succeeded", "failed", "invalid_output")


def _line(runner: JobRunner, todo: int) -> str:
    s = runner.stats
    done = sum(s.done[k] for k in FINAL)
    elapsed = max(1e-9, time.time() - s.started_at)
    rate = done / elapsed
    eta = f"{(todo - done) / rate:.0f}s" if rate > 0 and todo > done else "-"
    errors = ", ".join(f"{k}={v}" for k, v in s.errors.most_common(4)) or "none"
    paused = f" paused {s.paused_for:.1f}s" if s.paused_for > 0 else ""
    return (
        f"done {done}/{todo} ok={s.done['succeeded']} failed={s.done['failed']} "
        f"rate={rate:.1f}/s eta={eta} in_flight={s.in_flight} window={s.window}{paused} "
        f"tokens={s.input_tokens}+{s.output_tokens} cost=${s.cost_usd:.4f} errors: {errors}"
    )


async def show_progress(runner: JobRunner, todo: int, *, stream: TextIO | None = None, interval: float = 10.0) -> None:
    """Render progress until cancelled. ``todo`` is the number of items this run has to work."""
    stream = stream or sys.stderr
    if not stream.isatty():
        try:
            while True:
                await asyncio.sleep(interval)
                print(f"batchrun: job {runner.job.id}: {_line(runner, todo)}", file=stream, flush=True)
        finally:
            print(f"batchrun: job {runner.job.id}: {_line(runner, todo)}", file=stream, flush=True)
    console = Console(file=stream)
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
            s = runner.stats
            done = sum(s.done[k] for k in FINAL)
            errors = " ".join(f"{k}:{v}" for k, v in s.errors.most_common(3))
            paused = f" [yellow]paused {s.paused_for:.0f}s[/]" if s.paused_for > 0 else ""
            progress.update(
                task,
                completed=done,
                detail=f"in flight {s.in_flight}/{s.window}  ${s.cost_usd:.4f}  failed {s.done['failed']}  {errors}{paused}",
            )
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                done = sum(s.done[k] for k in FINAL)
                progress.update(task, completed=done)
                raise
