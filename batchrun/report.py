"""Summaries from the ledger: counts by state, throughput, latency percentiles, tokens, errors."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from batchrun.budget import budget_status
from batchrun.ledger import ItemState, Ledger


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def job_status(ledger: Ledger, job_id: int) -> dict[str, Any]:
    """The ``status --json`` object of one job."""
    job = ledger.get_job(job_id)
    counts = ledger.counts(job_id)
    stats = ledger.item_stats(job_id)
    lat = stats["latencies_ms"]
    total = sum(counts.values())
    finished = sum(counts[s] for s in ItemState.FINAL)
    first, last = stats["first_attempt_at"], stats["last_attempt_at"]
    elapsed = (last - first) if first and last and last > first else None
    throughput = counts[ItemState.SUCCEEDED] / elapsed if elapsed else None
    remaining = counts[ItemState.PENDING] + counts[ItemState.RUNNING]
    return {
        "job_id": job.id,
        "name": job.name,
        "input": job.input_path,
        "model": job.spec.provider.model,
        "base_url": job.spec.provider.base_url,
        "created_at": job.created_at,
        "total": total,
        "finished": finished,
        "done": remaining == 0 and job.ingest_done,
        "counts": counts,
        "requests": stats["attempts"],
        "tokens": {"input": stats["input_tokens"], "output": stats["output_tokens"], "cached": stats["cached_tokens"]},
        "cost_usd": round(stats["cost_usd"], 6),
        "budget": budget_status(job.spec, stats["cost_usd"]),  # the budget as submitted; None without one
        "latency_ms": {
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "mean": sum(lat) / len(lat) if lat else None,
        },
        "throughput_per_s": throughput,
        "eta_s": remaining / throughput if throughput and remaining else None,
        "errors": stats["errors"],
        "attempt_errors": stats["attempt_errors"],
        "as_of": time.time(),
    }
