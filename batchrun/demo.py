"""``batchrun demo``: the bundled example job against a local fake endpoint."""

from __future__ import annotations

from pathlib import Path

from batchrun.bundled import bundled_dir
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger, default_db_path
from batchrun.spec import Overrides, load_spec
from batchrun.testing import FakeOpenAIServer, Faults

DEMO_SPEC = "summarize.toml"
DEMO_INPUT = "summarize.jsonl"
# Enough trouble to show retries and the shared 429 pause, little enough to finish in seconds.
DEMO_FAULTS = Faults(latency_s=0.05, latency_jitter_s=0.15, p_429=0.01, retry_after_s=0.5, p_500=0.03, p_reset=0.01)


def demo_server() -> FakeOpenAIServer:
    return FakeOpenAIServer(DEMO_FAULTS)


def prepare_demo(ledger: Ledger, base_url: str) -> tuple[int, Path]:
    """Create a fresh demo job against ``base_url``; return its id and where its output goes."""
    jobs_dir = bundled_dir("jobs")
    spec = load_spec(jobs_dir / DEMO_SPEC, Overrides(base_url=base_url))
    prepared = prepare_job(ledger, spec, jobs_dir / DEMO_INPUT, new=True)
    out_dir = default_db_path().parent / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    return prepared.job_id, out_dir / f"job-{prepared.job_id}-results.jsonl"
