"""Summaries from the ledger: counts by state, throughput, latency percentiles, tokens, cost, errors.

Every figure comes from an aggregate query (see
:class:`~batchrun.ledger.LedgerQueries`): percentiles are nearest-rank, computed by
the database, so a job of millions of items is never read into memory.

- :func:`job_status` — the ``status --json`` object;
- :func:`job_report` — that plus a latency histogram and throughput over time;
- :func:`compare_jobs` — two jobs side by side, and how many shared outputs differ;
- :func:`watch_status` — ``status --watch``;
- ``render_*`` — the text forms, with rich.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from batchrun.errors import ExportError
from batchrun.budget import budget_status
from batchrun.ledger.protocol import RunsReader, StatusReader, status_reader
from batchrun.ledger.records import AttemptTotals, Distribution, ErrorGroup, JobRecord, RunRow, pid_alive
from batchrun.states import FINISHED_STATES, OPEN_STATES, ItemState, job_state

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

    from batchrun.ledger import Ledger, LedgerQueries
    from batchrun.ledger.records import ShardRecord

PERCENTILES = (50, 90, 99)
# Attempt measures: total latency and TTFT of clean answers, queue wait of every request.
MEASURES = {"latency_ms": "latency", "queue_wait_ms": "queue wait", "ttft_ms": "TTFT"}
# The report's split of a clean answer's time (LedgerQueries.answer_split), in the order it passes.
SPLIT = {"queue_wait_ms": "queue wait (for a slot)", "ttfb_ms": "time to first byte", "latency_ms": "time to last byte"}
SPLIT_PERCENTILES = (50, 99)
NONE = "—"  # shown where there is no value (no streamed attempt, no answer yet)
HTML_GENERATOR = "batchrun report"  # <meta name="generator">: marks a file we may replace


def _distribution(d: Distribution) -> dict[str, Any]:
    return {
        **{f"p{p}": d.percentiles.get(p) for p in PERCENTILES},
        "mean": d.mean,
        "max": d.maximum,
        "count": d.count,
    }


def _groups(groups: list[ErrorGroup]) -> dict[str, dict[str, Any]]:
    return {
        "none" if g.key is None else str(g.key): {"attempts": g.attempts, "items": g.items, "example": g.example}
        for g in groups
    }


def _per_1k(value: float, items: int) -> float | None:
    return round(value * 1000.0 / items, 6) if items else None


def job_status(ledger: Ledger | StatusReader, job_id: int) -> dict[str, Any]:
    """The ``status --json`` object of one job, from an open ledger or a reader of one (the quick reader
    of ``batchrun status``: batchrun/ledger/quick.py).

    ``job_id``, ``total`` and ``counts`` (one key per state) are the contract
    scripts read; everything else is added around them.
    """
    return _status(status_reader(ledger), job_id)[0]


def _status(queries: StatusReader, job_id: int) -> tuple[dict[str, Any], dict[str, Distribution], AttemptTotals]:
    job = queries.get_job(job_id)
    counts = queries.counts(job_id)
    cached = queries.cached_count(job_id)
    totals = queries.attempt_totals(job_id)
    by_class = queries.errors_by_class(job_id)
    per_item = queries.requests_per_item(job_id)
    total = sum(counts.values())
    finished = sum(counts[s] for s in FINISHED_STATES)
    first, last = totals.first_started_at, totals.last_started_at
    elapsed = (last - first) if first and last and last > first else None
    # Reused answers (the response cache) cost no request: they count neither as
    # throughput nor as items the cost and error rate are spread over.
    answered = counts[ItemState.SUCCEEDED] - cached
    throughput = answered / elapsed if elapsed else None
    remaining = sum(counts[s] for s in OPEN_STATES)
    worked = answered + counts[ItemState.FAILED] + counts[ItemState.INVALID_OUTPUT]
    histogram = {"0": total - sum(per_item.values())} | {str(n): per_item[n] for n in sorted(per_item)}
    dists = queries.attempt_distributions(job_id, tuple(MEASURES), PERCENTILES)
    run = run_status(queries, job)
    live = run is not None and run["live"]
    data = {
        "job_id": job.id,
        "name": job.name,
        "input": job.input_path,
        "model": job.spec.provider.model,
        "base_url": job.spec.provider.base_url,
        "created_at": job.created_at,
        "total": total,
        "finished": finished,
        "done": remaining == 0 and job.ingest_done,
        "state": job_state(counts, job.ingest_done),  # as `list` says it: ingesting, work left, cancelled, ...
        "counts": counts,
        "cached": cached,  # succeeded items whose answer was reused from an earlier request (no request, no cost)
        "requests": totals.requests,
        "failed_requests": totals.requests - totals.clean,
        "tokens": {"input": totals.input_tokens, "output": totals.output_tokens, "cached": totals.cached_tokens},
        "cost_usd": round(totals.cost_usd, 6),
        "budget": budget_status(job.spec, totals.cost_usd),  # the budget as submitted; None without one
        "cost_per_1k_items": _per_1k(totals.cost_usd, worked),
        "error_rate": (counts[ItemState.FAILED] + counts[ItemState.INVALID_OUTPUT]) / worked if worked else None,
        **{m: _distribution(d) for m, d in dists.items()},
        "elapsed_s": elapsed,
        "throughput_per_s": throughput,
        # Only a run at work has an ETA; the rate is the job's over the time it was worked.
        "eta_s": remaining / throughput if throughput and remaining and live else None,
        "run": run,
        "errors": {str(g.key): g.items for g in by_class if g.items},
        "attempt_errors": {str(g.key): g.attempts for g in by_class if g.attempts},
        "retried": {str(g.key): g.retried for g in by_class if g.retried},
        "errors_by_class": _groups(by_class),
        "errors_by_status": _groups(queries.errors_by_status(job_id)),
        "attempts_histogram": histogram,
        "batch": batch_status(queries, job_id),
        "as_of": time.time(),
    }
    return data, dists, totals


RUN_SILENT_S = 30.0  # a run not heard of for this long is shown as dead


def run_state(run: RunRow, now: float, stale_after: float) -> str:
    """``ended``, ``dead`` (its process is gone from this host, or its heartbeat is older than
    ``stale_after``) or ``live``."""
    if run.ended_at is not None:
        return "ended"
    import socket  # here: only a run that has not ended needs the host's name

    if run.host == socket.gethostname() and not pid_alive(run.pid):
        return "dead"
    return "dead" if now - run.heartbeat_at > stale_after else "live"


def run_status(queries: RunsReader, job: JobRecord) -> dict[str, Any] | None:
    """The ``run`` object of ``status``: whether a run is at work on the job, and its latest run
    (None for a job no run has started)."""
    runs, now = queries.job_runs(job.id)
    if not runs:
        return None
    # A run beats at least every 10 s: three missed beats say it is gone (the lock's own staleness,
    # lease/2, may be half an hour; it decides takeovers, not what status shows).
    states = [run_state(run, now, min(job.spec.run.lock_stale_seconds, RUN_SILENT_S)) for run in runs]
    last, state = runs[0], states[0]
    return {
        "live": "live" in states,
        "live_runs": states.count("live"),
        # A worker never reads the input: only a live run of another command may still be storing it.
        "reading": any(st == "live" and r.command != "worker" for r, st in zip(runs, states)),
        "last": {
            "run_id": last.id, "command": last.command, "pid": last.pid, "host": last.host, "state": state,
            "started_at": last.started_at, "heartbeat_age_s": round(max(0.0, now - last.heartbeat_at), 3),
            "ended_at": last.ended_at, "exit_code": last.exit_code,
        },
    }


def batch_status(ledger: Ledger | StatusReader, job_id: int) -> dict[str, Any] | None:
    """Batch mode's part of ``status``: the job's shards, how its answers came, shard turnaround
    (None for a job that never had a shard)."""
    shards = status_reader(ledger)
    rows = shards.shards(job_id)
    if not rows:
        return None
    now = time.time()
    turnaround = shards.turnarounds(rows[0].kind)
    typical = turnaround[len(turnaround) // 2] if turnaround else None
    listed = []
    for shard in rows:
        started = shard.provider_created_at or shard.created_at
        eta = None
        if shard.is_open and typical is not None:
            eta = max(0.0, started + typical - now)
        listed.append({
            "shard": shard.id,
            "batch_id": shard.batch_id,
            "state": shard.state,
            "provider_status": shard.provider_status,
            "requests": shard.requests,
            "counts": dict(shard.counts),
            "age_s": now - shard.created_at,
            "turnaround_s": (shard.ended_at - started) if shard.ended_at else None,
            "eta_s": eta,
            "expires_at": shard.expires_at,
            "cancel_reason": shard.cancel_reason,
            "error": shard.error,
        })
    return {
        "shards": listed,
        "warnings": retention_warnings(job_id, rows, now),
        "at_provider": sum(s.requests for s in rows if s.is_open),
        "answered": shards.answered_by_route(job_id),
        "turnaround_s": {
            f"p{p}": turnaround[min(len(turnaround) - 1, len(turnaround) * p // 100)] if turnaround else None
            for p in PERCENTILES
        },
    }


def nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``raw`` (> 0)."""
    exponent = math.floor(math.log10(raw))
    for mantissa in (1, 2, 5, 10):
        step = mantissa * 10.0**exponent
        if step >= raw * (1 - 1e-12):
            return step
    return 10.0 ** (exponent + 1)  # pragma: no cover - the loop always returns


def latency_histogram(
    queries: LedgerQueries, job_id: int, dist: Distribution, bins: int = 30, *, measure: str = "latency_ms"
) -> dict[str, Any] | None:
    """Answered requests per bucket of latency (or of ``measure``: ``ttft_ms``), with a round bucket width.

    A long tail (the slowest request over 1.5 x P99) goes into one overflow
    bucket so that it does not squash the rest of the chart.
    """
    if not dist.count or dist.minimum is None or dist.maximum is None:
        return None
    p99 = dist.percentiles.get(99, dist.maximum)
    high = p99 if dist.maximum > 1.5 * p99 else dist.maximum
    width = nice_step(max((high - dist.minimum) / bins, 0.001))
    low = math.floor(dist.minimum / width) * width
    n = math.floor((high - low) / width) + 1
    counts = [0] * n
    overflow = 0
    for bucket, count in queries.attempt_histogram(job_id, measure, low, width).items():
        if bucket < n:
            counts[max(bucket, 0)] += count
        else:
            overflow += count
    return {"low_ms": low, "width_ms": width, "counts": counts, "overflow": overflow, "overflow_from_ms": low + n * width}


def throughput_timeline(queries: LedgerQueries, job_id: int, start: float | None, intervals: int = 40) -> dict[str, Any] | None:
    """Items that succeeded per time interval, from the job's first request to its last success."""
    n_ok, first, last = queries.succeeded_span(job_id)
    if not n_ok or first is None or last is None:
        return None
    start = min(start, first) if start is not None else first
    width = nice_step(max((last - start) / intervals, 0.01))
    n = math.floor((last - start) / width) + 1
    counts = [0] * n
    for bucket, count in queries.succeeded_per_interval(job_id, start, width).items():
        counts[min(max(bucket, 0), n - 1)] += count
    return {"start": start, "width_s": width, "counts": counts}


def job_report(ledger: Ledger, job_id: int) -> dict[str, Any]:
    """:func:`job_status` plus what only the report shows: the latency histogram, the TTFT histogram
    of streamed answers (None: none streamed), throughput over time, and the split of clean answers'
    time into queue wait, time to first byte and time to last byte (P50/P99)."""
    from batchrun.ledger import LedgerQueries

    data, dists, totals = _status(status_reader(ledger), job_id)
    queries = LedgerQueries(ledger.engine)
    data["latency_histogram"] = latency_histogram(queries, job_id, dists["latency_ms"])
    data["ttft_histogram"] = latency_histogram(queries, job_id, dists["ttft_ms"], measure="ttft_ms")
    data["throughput_timeline"] = throughput_timeline(queries, job_id, totals.first_started_at)
    data["latency_split"] = {
        measure: {**{f"p{p}": d.percentiles.get(p) for p in SPLIT_PERCENTILES}, "count": d.count}
        for measure, d in queries.answer_split(job_id, SPLIT_PERCENTILES).items()
    }
    return data


# -- compare -----------------------------------------------------------------

COMPARED_KEYS = (
    "job_id", "name", "model", "base_url", "total", "counts", "requests", "latency_ms", "ttft_ms",
    "error_rate", "tokens", "cost_usd", "cost_per_1k_items", "throughput_per_s",
)


def same_json(x: Any, y: Any) -> bool:
    """JSON equality: key order does not matter, but ``true`` is not ``1`` and ``1`` is ``1.0``."""
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same_json(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(same_json(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, int | float) and isinstance(y, int | float):
        return x == y
    return type(x) is type(y) and bool(x == y)


def _parsed_differ(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is not b
    try:
        return not same_json(orjson.loads(a), orjson.loads(b))
    except orjson.JSONDecodeError:
        return a != b


def compare_jobs(ledger: Ledger, job_a: int, job_b: int, *, examples: int = 5) -> dict[str, Any]:
    """Jobs A and B side by side, and how many outputs differ among the custom_ids both answered.

    Outputs are compared as parsed JSON when both jobs have a schema (so key
    order and code fences do not count as a difference), else as text.
    """
    spec_a, spec_b = ledger.get_job(job_a).spec, ledger.get_job(job_b).spec
    status_a, status_b = job_status(ledger, job_a), job_status(ledger, job_b)
    column = "parsed" if spec_a.output.schema is not None and spec_b.output.schema is not None else "output"
    from batchrun.ledger import LedgerQueries

    queries = LedgerQueries(ledger.engine)
    shared = queries.shared_outputs(job_a, job_b)
    differ = 0
    shown: list[str] = []
    for custom_id, value_a, value_b in queries.iter_output_differences(job_a, job_b, column):
        if column == "parsed" and not _parsed_differ(value_a, value_b):
            continue
        differ += 1
        if len(shown) < examples:
            shown.append(custom_id)
    return {
        "a": {k: status_a[k] for k in COMPARED_KEYS},
        "b": {k: status_b[k] for k in COMPARED_KEYS},
        "outputs": {
            "compared_on": column,
            "shared": shared.shared,
            "both_succeeded": shared.both_succeeded,
            "differ": differ,
            "same": shared.both_succeeded - differ,
            "examples": shown,
        },
    }


# -- text --------------------------------------------------------------------


def fmt_ms(value: float | None) -> str:
    return NONE if value is None else f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return NONE
    if value < 120:
        return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def fmt_money(value: float | None) -> str:
    return NONE if value is None else f"${value:,.4f}"


def fmt_rate(value: float | None) -> str:
    return NONE if value is None else f"{value:,.1f} items/s"


def fmt_pct(value: float | None) -> str:
    return NONE if value is None else f"{100 * value:.2f}%"


def _percentiles(d: dict[str, Any]) -> str:
    if not d["count"]:
        return NONE
    return "  ".join(f"p{p} {fmt_ms(d[f'p{p}'])}" for p in PERCENTILES) + f"  ({d['count']})"


def state_note(data: dict[str, Any]) -> str:
    """`` (done)``, `` (cancelled)``, `` (ingesting: ...)``... after the items' counts; none while work is left."""
    state = data["state"]
    if state == "ingesting":
        run = data.get("run")
        if run is not None and not run["reading"]:  # the run that read it is gone: nobody reads it
            return " (input read in part: the run reading it is gone; resume reads the rest)"
        return " (ingesting: the input is still being read, the total grows)"
    return "" if state == "work left" else f" ({state})"


def status_lines(data: dict[str, Any], *, ledger_url: str | None = None) -> list[str]:
    """``batchrun status`` as text, one fact a line; ``ledger_url`` aims the hints at the ledger shown."""
    from batchrun.hints import command

    counts = data["counts"]
    tokens = data["tokens"]
    lines = [
        f"job {data['job_id']}{' (' + data['name'] + ')' if data['name'] else ''}: {data['input']}",
        f"  model     {data['model'] or '(as in each input line)'} at {data['base_url']}",
        f"  items     {data['total']} total, {data['finished']} finished" + state_note(data),
        "  states    " + "  ".join(f"{k} {v}" for k, v in counts.items()),
    ]
    run = data.get("run")
    live = run is not None and run["live"]
    if counts["running"] and not live:
        resume = command(ledger_url, "resume", data["job_id"]) if ledger_url else f"batchrun resume {data['job_id']}"
        lines.append(f"  running   {counts['running']} left by a dead run, resume to continue: {resume}")
    if run is not None:
        lines.append("  run       " + run_line(run))
    if data.get("cached"):
        lines.append(f"  reused    {data['cached']} succeeded from the response cache (no request, no cost)")
    lines += [
        f"  requests  {data['requests']} ({data['failed_requests']} failed)",
        f"  tokens    {tokens['input']} in, {tokens['output']} out, {tokens['cached']} cached",
        f"  cost      {fmt_money(data['cost_usd'])}" + (
            f" ({fmt_money(data['cost_per_1k_items'])} per 1,000 items)" if data["cost_per_1k_items"] is not None else ""
        ),
    ]
    budget = data.get("budget")
    if budget:
        lines.append(f"  budget    ${budget['limit_usd']:g} as submitted, {fmt_money(budget['remaining_usd'])} of it left")
    lines += [
        f"  latency   {_percentiles(data['latency_ms'])}",
        f"  queue     {_percentiles(data['queue_wait_ms'])}",
        f"  ttft      {_percentiles(data['ttft_ms'])}",
        f"  rate      {fmt_rate(data['throughput_per_s'])}"
        + (f", eta {fmt_seconds(data['eta_s'])}" if data["eta_s"] is not None else "")
        + ("" if live or data["throughput_per_s"] is None else " while it was worked (no run at work now)"),
    ]
    if data["errors"]:
        lines.append("  errors    " + "  ".join(f"{k} {v}" for k, v in data["errors"].items()))
    if data["retried"]:  # failed attempts sent again: a class failed on its only attempt is not "retried"
        lines.append("  retried   " + "  ".join(f"{k} {v}" for k, v in data["retried"].items()))
    if data["errors_by_status"]:
        lines.append(
            "  statuses  "
            + "  ".join(
                f"{'no-response' if k == 'none' else k} {v['attempts']}" for k, v in data["errors_by_status"].items()
            )
        )
    lines.append("  attempts  " + "  ".join(f"{n}x {items}" for n, items in data["attempts_histogram"].items() if items))
    lines += batch_lines(data.get("batch"))
    return lines


def run_line(run: dict[str, Any]) -> str:
    """The ``run`` line of ``status``: the latest run, and whether it is at work."""
    last = run["last"]
    who = f"{last['command']} {last['run_id']} (pid {last['pid']} on {last['host']})"
    if last["state"] == "ended":
        said = f"ended (exit {last['exit_code']})"
    elif last["state"] == "dead":
        said = f"dead: no heartbeat for {fmt_seconds(last['heartbeat_age_s'])}"
    else:
        said = f"at work, heartbeat {fmt_seconds(last['heartbeat_age_s'])} ago"
    others = run["live_runs"] - (last["state"] == "live")
    return f"{who} {said}" + (f"; {others} more at work" if others > 0 else "")


RETENTION_WARNING_DAYS = 7.0  # warn this long before a provider drops uncollected results


def retention_warnings(job_id: int, shards: Sequence[ShardRecord], now: float) -> list[str]:
    """Uncollected shards whose results the provider will soon drop (OpenAI keeps batch files 30 days,
    Anthropic results 29): what to run before they are gone."""
    from batchrun.provider_registry import provider_entry

    warnings = []
    for shard in shards:
        if not shard.is_open or shard.batch_id is None:
            continue
        keep = provider_entry(shard.kind).batch_results_days * 86400.0
        since = shard.provider_created_at or shard.created_at
        left = since + keep - now
        if keep and left < RETENTION_WARNING_DAYS * 86400.0:
            when = f"in {fmt_seconds(left)}" if left > 0 else "any time now (or already)"
            warnings.append(
                f"shard {shard.id} ({shard.batch_id}): the provider drops its results {when}; "
                f"collect them with: batchrun resume {job_id}"
            )
    return warnings


def batch_lines(batch: dict[str, Any] | None) -> list[str]:
    """The shards of ``status``, a line each (the open ones; a count of the others)."""
    if not batch:
        return []
    shards = batch["shards"]
    open_ = [s for s in shards if s["state"] not in ("collected", "failed")]
    answered = batch["answered"]
    lines = [
        f"  batches   {len(shards)} shards, {len(open_)} open, {batch['at_provider']} items at the provider; "
        f"answered {answered['batch']} by batch, {answered['online']} online"
        + (f", {answered['cache']} from the response cache" if answered.get("cache") else "")
    ]
    for s in open_:
        counts = " ".join(f"{k}={v}" for k, v in s["counts"].items() if v)
        lines.append(
            f"    shard {s['shard']}: {s['state']}"
            + (f" ({s['provider_status']})" if s["provider_status"] else "")
            + f" {s['requests']} requests" + (f" {counts}" if counts else "")
            + (f" {s['batch_id']}" if s["batch_id"] else "")
            + f", {fmt_seconds(s['age_s'])} old"
            + (f", eta {fmt_seconds(s['eta_s'])}" if s["eta_s"] is not None else "")
            + (f", cancel: {s['cancel_reason']}" if s["cancel_reason"] else "")
        )
    lines += [f"  warning   {w}" for w in batch.get("warnings", ())]
    return lines


def status_line(data: dict[str, Any]) -> str:
    """One line of ``status --watch`` when not on a terminal."""
    c = data["counts"]
    lat = data["latency_ms"]
    errors = " ".join(f"{k}={v}" for k, v in data["attempt_errors"].items()) or "none"
    return (
        f"job {data['job_id']}: {data['finished']}/{data['total']} finished succeeded={c['succeeded']} "
        f"failed={c['failed']} invalid={c['invalid_output']} rejected={c['rejected']} pending={c['pending']} "
        f"running={c['running']} rate={fmt_rate(data['throughput_per_s'])} eta={fmt_seconds(data['eta_s'])} "
        f"p50={fmt_ms(lat['p50'])} p99={fmt_ms(lat['p99'])} cost={fmt_money(data['cost_usd'])} errors: {errors}"
        + (" (done)" if data["done"] else "" if data["run"] and data["run"]["live"] else " (no run at work)")
    )


def watch_status(
    ledger: Ledger | StatusReader,
    job_id: int,
    *,
    interval: float,
    out: IO[str],
    mode: str,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Show the job's status every ``interval`` seconds until it is done; returns the last status.

    ``mode``: ``live`` (a rich display that redraws in place), ``line`` (one
    plain line each time) or ``json`` (one JSON object a line).
    """
    if mode == "live":
        from rich.console import Console
        from rich.live import Live

        console = Console(file=out)
        data = job_status(ledger, job_id)
        with Live(_status_panel(data), console=console, auto_refresh=False) as live:
            while not data["done"]:
                sleep(interval)
                data = job_status(ledger, job_id)
                live.update(_status_panel(data), refresh=True)
        return data
    while True:
        data = job_status(ledger, job_id)
        out.write((orjson.dumps(data).decode() if mode == "json" else status_line(data)) + "\n")
        out.flush()
        if data["done"]:
            return data
        sleep(interval)


def _status_panel(data: dict[str, Any]) -> RenderableType:
    from rich.console import Group
    from rich.text import Text

    when = time.strftime("%H:%M:%S", time.localtime(data["as_of"]))
    footer = "done" if data["done"] else "Ctrl-C to stop watching (the job carries on)"
    return Group(Text("\n".join(status_lines(data))), Text(f"  as of {when}; {footer}", style="dim"))


def _table(title: str, *columns: str, right: Sequence[int] = (), header: bool = True) -> Table:
    # rich is imported where a table is drawn: `status` prints plain lines and starts without it.
    from rich.table import Table

    table = Table(title=title, title_justify="left", title_style="bold", show_header=header)
    for i, name in enumerate(columns):
        table.add_column(name, justify="right" if i in right else "left", overflow="fold")
    return table


def report_tables(data: dict[str, Any]) -> list[Table]:
    """The tables of ``batchrun report`` (the HTML page shows the same)."""
    from rich.text import Text

    overview = _table(f"Job {data['job_id']}" + (f" ({data['name']})" if data["name"] else ""), "", "", header=False)
    for key, value in overview_rows(data):
        overview.add_row(key, value)

    timing = _table("Timing", "", "count", *(f"p{p}" for p in PERCENTILES), "mean", "max", right=range(1, 7))
    for measure, label in MEASURES.items():
        d = data[measure]
        timing.add_row(label, f"{d['count']:,}", *(fmt_ms(d[f"p{p}"]) for p in PERCENTILES), fmt_ms(d["mean"]), fmt_ms(d["max"]))

    tables = [overview, timing]
    split = data.get("latency_split")
    if split and split["latency_ms"]["count"]:
        table = _table("Where the time went (clean answers)", "", *(f"p{p}" for p in SPLIT_PERCENTILES),
                       right=range(1, 1 + len(SPLIT_PERCENTILES)))
        for measure, label in SPLIT.items():
            table.add_row(label, *(fmt_ms(split[measure][f"p{p}"]) for p in SPLIT_PERCENTILES))
        table.caption = f"over {split['latency_ms']['count']:,} answers; bytes timed from sending"
        table.caption_justify = "left"
        tables.append(table)
    ttft = data.get("ttft_histogram")
    if ttft:
        table = _table("TTFT of streamed answers", "", header=False)
        table.add_row(Text(bucket_line(ttft)))
        tables.append(table)
    for title, key, groups in (
        ("Errors by class", "class", data["errors_by_class"]),
        ("Errors by HTTP status", "status", data["errors_by_status"]),
    ):
        table = _table(title, key, "failed attempts", "items", "example message", right=(1, 2))
        for name, g in groups.items():
            label = "no response" if name == "none" else name
            # Text, not markup: a message's "[request] max_input_tokens" is not a style tag.
            table.add_row(label, f"{g['attempts']:,}", f"{g['items']:,}", Text(g["example"]) if g["example"] else NONE)
        if not groups:
            table.add_row("none", "0", "0", NONE)
        elif any(g["example"] is None for g in groups.values()):
            table.caption = f"{NONE}: {NO_EXAMPLE}"
            table.caption_justify = "left"
        tables.append(table)

    attempts = _table("Requests per item", "requests", "items", right=(0, 1))
    for n, items in data["attempts_histogram"].items():
        if items:
            attempts.add_row(n, f"{items:,}")
    tables.append(attempts)
    batches = batch_table(data.get("batch"))
    if batches is not None:
        columns, rows, caption = batches
        table = _table("Provider batches (batch mode)", *columns, right=(0, 4, 5))
        for row in rows:
            table.add_row(*row)
        table.caption, table.caption_justify = caption, "left"
        tables.append(table)
    return tables


NO_EXAMPLE = "no message kept (attempts recorded before batchrun kept one, and no item still holds it)"
SPARKS = "▁▂▃▄▅▆▇█"


def bucket_line(hist: dict[str, Any]) -> str:
    """A histogram in one line: its range, a bar per bucket (blank: none), the slower ones, the bucket width."""
    counts, top = hist["counts"], max(hist["counts"]) or 1
    bars = "".join(" " if c == 0 else SPARKS[min(len(SPARKS) - 1, (c * len(SPARKS) - 1) // top)] for c in counts)
    high = hist["low_ms"] + len(counts) * hist["width_ms"]
    total = sum(counts) + hist["overflow"]
    return (
        f"{fmt_ms(hist['low_ms'])} |{bars}| {fmt_ms(high)}"
        + (f" +{hist['overflow']:,} slower" if hist["overflow"] else "")
        + f"  ({total:,} answers, {fmt_ms(hist['width_ms'])} buckets, tallest {top:,})"
    )


BATCH_COLUMNS = ("shard", "batch id", "state", "provider status", "requests", "turnaround")


def batch_table(batch: dict[str, Any] | None) -> tuple[tuple[str, ...], list[tuple[str, ...]], str] | None:
    """The shards of ``report`` (text and HTML alike): columns, a row per shard, and a caption with
    the turnaround percentiles and how the job's answers came."""
    if not batch:
        return None
    rows: list[tuple[str, ...]] = [
        (str(s["shard"]), s["batch_id"] or NONE, s["state"] + (f" ({s['cancel_reason']})" if s["cancel_reason"] else ""),
         s["provider_status"] or NONE, f"{s['requests']:,}", fmt_seconds(s["turnaround_s"]))
        for s in batch["shards"]
    ]
    turnaround = batch["turnaround_s"]
    answered = batch["answered"]
    caption = (
        "turnaround (created to ended) " + "  ".join(f"{k} {fmt_seconds(v)}" for k, v in turnaround.items())
        + f"; answered {answered['batch']:,} by batch, {answered['online']:,} online"
        + (f", {answered['cache']:,} from the response cache" if answered.get("cache") else "")
        + (f"; {batch['at_provider']:,} items at the provider now" if batch["at_provider"] else "")
    )
    return BATCH_COLUMNS, rows, caption


def overview_rows(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The job's overview as (label, text) rows: the first table of the text report and the page."""
    counts, tokens, budget = data["counts"], data["tokens"], data.get("budget")
    rows = [
        ("input", data["input"]),
        ("model", f"{data['model'] or '(as in each input line)'} at {data['base_url']}"),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["created_at"]))),
        ("items", f"{data['total']:,} total, {data['finished']:,} finished" + state_note(data)),
        ("states", "  ".join(f"{k} {v:,}" for k, v in counts.items() if v) or "no items"),
        *(
            [("reused", f"{data['cached']:,} succeeded from the response cache (no request, no cost)")]
            if data.get("cached")
            else []
        ),
        ("requests", f"{data['requests']:,} ({data['failed_requests']:,} failed)"),
        ("error rate", fmt_pct(data["error_rate"]) + " of items sent (failed or invalid)"),
        ("throughput", fmt_rate(data["throughput_per_s"]) + f" over {fmt_seconds(data['elapsed_s'])}"),
        ("eta", fmt_seconds(data["eta_s"])),
        ("tokens", f"{tokens['input']:,} in, {tokens['output']:,} out, {tokens['cached']:,} cached"),
        ("cost", f"{fmt_money(data['cost_usd'])} ({fmt_money(data['cost_per_1k_items'])} per 1,000 items)"),
    ]
    if budget:
        rows.append(("budget", f"${budget['limit_usd']:g} as submitted, {fmt_money(budget['remaining_usd'])} of it left"))
    return rows


def render_report(data: dict[str, Any], console: Console) -> None:
    for table in report_tables(data):
        console.print(table)
        console.print()


def _change(a: Any, b: Any) -> str:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or isinstance(a, bool):
        return ""
    if a == 0:
        return "" if b == 0 else "new"
    return f"{100 * (b - a) / a:+.1f}%"


def compare_table(data: dict[str, Any]) -> Table:
    """``batchrun compare`` as one table: A, B and B's change from A."""
    a, b = data["a"], data["b"]
    table = _table(f"Job {a['job_id']} (A) vs job {b['job_id']} (B)", "", "A", "B", "B vs A", right=(1, 2, 3))
    rows: list[tuple[str, Any, Any, Callable[[Any], str]]] = [
        ("model", a["model"], b["model"], str),
        ("items", a["total"], b["total"], lambda v: f"{v:,}"),
        ("succeeded", a["counts"]["succeeded"], b["counts"]["succeeded"], lambda v: f"{v:,}"),
        ("error rate", a["error_rate"], b["error_rate"], fmt_pct),
        ("requests", a["requests"], b["requests"], lambda v: f"{v:,}"),
    ]
    for p in PERCENTILES:
        rows.append((f"latency p{p}", a["latency_ms"][f"p{p}"], b["latency_ms"][f"p{p}"], fmt_ms))
    for p in PERCENTILES:
        rows.append((f"TTFT p{p}", a["ttft_ms"][f"p{p}"], b["ttft_ms"][f"p{p}"], fmt_ms))
    rows += [
        ("tokens in", a["tokens"]["input"], b["tokens"]["input"], lambda v: f"{v:,}"),
        ("tokens out", a["tokens"]["output"], b["tokens"]["output"], lambda v: f"{v:,}"),
        ("cost", a["cost_usd"], b["cost_usd"], fmt_money),
        ("cost per 1,000 items", a["cost_per_1k_items"], b["cost_per_1k_items"], fmt_money),
        ("throughput", a["throughput_per_s"], b["throughput_per_s"], fmt_rate),
    ]
    for label, va, vb, fmt in rows:
        table.add_row(label, NONE if va is None else fmt(va), NONE if vb is None else fmt(vb), _change(va, vb))
    return table


def render_compare(data: dict[str, Any], console: Console) -> None:
    console.print(compare_table(data))
    o = data["outputs"]
    what = "parsed JSON" if o["compared_on"] == "parsed" else "output text"
    console.print(
        f"\nShared custom_ids: {o['shared']:,}; both succeeded: {o['both_succeeded']:,}; "
        f"{what} differs for {o['differ']:,}"
        + (f", e.g. {', '.join(o['examples'])}" if o["examples"] else ""),
        highlight=False,
        soft_wrap=True,
    )


# -- files -------------------------------------------------------------------


def write_html_report(path: str | os.PathLike[str], page: str, *, force: bool = False) -> Path:
    """Write the page atomically; replace an existing file only if it is a batchrun report (or ``force``)."""
    target = Path(path).absolute()
    if target.is_dir():
        raise ExportError(f"{target} is a folder; give a file name for the report, e.g. report.html")
    if not target.parent.is_dir():
        raise ExportError(f"{target.parent}: no such folder for the report")
    if target.exists() and not force:
        try:
            head = target.read_bytes()[:2048].decode("utf-8", "replace")
        except OSError as exc:
            raise ExportError(f"{target}: cannot read the existing file: {exc.strerror}") from exc
        if f'<meta name="generator" content="{HTML_GENERATOR}">' not in head:
            raise ExportError(f"{target} exists and is not a batchrun report; choose another name or pass --force")
    from batchrun.export import write_atomic  # here: status and report load no writers

    try:
        write_atomic(target, [page.encode("utf-8")])  # the export's own atomic write, leftovers cleared
    except OSError as exc:
        raise ExportError(f"{target}: cannot write the report: {exc.strerror or exc}") from exc
    return target
