"""``batchrun demo``: the bundled example job against a local fake endpoint."""

from __future__ import annotations

import hashlib
from pathlib import Path

from batchrun.bundled import bundled_dir
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger, default_db_path
from batchrun.spec import Overrides, load_spec
from batchrun.testing import FakeProviderServer, Faults

EXAMPLES = {"summarize": ("summarize.toml", "summarize.jsonl"), "triage": ("triage.toml", "triage.jsonl")}
# Enough trouble to show retries, the shared 429 pause and re-asks; little enough to finish in seconds.
DEMO_FAULTS = Faults(
    latency_s=0.05, latency_jitter_s=0.15, p_429=0.01, retry_after_s=0.5, p_500=0.03, p_reset=0.01,
    p_fenced=0.1, p_prose=0.05, p_truncated_json=0.05, p_schema_violation=0.1,
)


def demo_server() -> FakeProviderServer:
    return FakeProviderServer(DEMO_FAULTS)


def prepare_demo(ledger: Ledger, base_url: str, example: str = "summarize") -> tuple[int, Path]:
    """Create a fresh demo job against ``base_url``; return its id and where its output goes."""
    jobs_dir = bundled_dir("jobs")
    spec_name, input_name = EXAMPLES[example]
    spec = load_spec(jobs_dir / spec_name, Overrides(base_url=base_url))
    prepared = prepare_job(ledger, spec, jobs_dir / input_name, new=True)
    out_dir = default_db_path().parent / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Named after the ledger too: job ids of different ledgers do not collide.
    ledger_tag = hashlib.sha256(ledger.url.encode()).hexdigest()[:8]
    return prepared.job_id, out_dir / f"{ledger_tag}-job-{prepared.job_id}-{example}.jsonl"
