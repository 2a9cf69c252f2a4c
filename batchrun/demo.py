"""``batchrun demo``: the bundled example job against a local fake endpoint."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from batchrun.bundled import bundled_dir
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger, default_db_path
from batchrun.spec import Overrides, load_spec
from batchrun.testing import BatchFaults, FakeProviderServer, Faults

EXAMPLES = {"summarize": ("summarize.toml", "summarize.jsonl"), "triage": ("triage.toml", "triage.jsonl")}
# Enough trouble to show retries, the shared 429 pause and re-asks; little enough to finish in seconds.
DEMO_FAULTS = Faults(
    latency_s=0.05, latency_jitter_s=0.15, p_429=0.01, retry_after_s=0.5, p_500=0.03, p_reset=0.01,
    p_fenced=0.1, p_prose=0.05, p_truncated_json=0.05, p_schema_violation=0.1,
)


# The batch APIs scaled from hours to seconds, with a few of their troubles: a 5xx on create
# after creating (reconciled, not resubmitted), busy polls, lines that fail inside a batch.
DEMO_BATCH_FAULTS = BatchFaults(turnaround_s=2.0, p_create_500=0.5, p_poll_429=0.1, p_line_500=0.02)


def demo_server() -> FakeProviderServer:
    return FakeProviderServer(DEMO_FAULTS, batch_faults=DEMO_BATCH_FAULTS)


def prepare_demo(ledger: Ledger, base_url: str, example: str = "summarize", mode: str = "online") -> tuple[int, Path]:
    """Create a fresh demo job against ``base_url``; return its id and where its output goes.

    ``mode = "batch"`` sends it through the fake server's batch API, polled every half second.
    """
    jobs_dir = bundled_dir("jobs")
    spec_name, input_name = EXAMPLES[example]
    spec = load_spec(jobs_dir / spec_name, Overrides(base_url=base_url, mode=mode))
    if mode == "batch":
        spec = dataclasses.replace(spec, batch=dataclasses.replace(spec.batch, poll_interval=0.5, poll_max=1.0))
    prepared = prepare_job(ledger, spec, jobs_dir / input_name, new=True)
    out_dir = default_db_path().parent / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    # Named after the ledger too: job ids of different ledgers do not collide.
    ledger_tag = hashlib.sha256(ledger.url.encode()).hexdigest()[:8]
    return prepared.job_id, out_dir / f"{ledger_tag}-job-{prepared.job_id}-{example}{'-batch' if mode == 'batch' else ''}.jsonl"
