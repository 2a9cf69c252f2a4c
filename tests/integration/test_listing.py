"""list_jobs: a ledger's jobs, oldest first, each with its counts and its ``list --json`` row."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger
from batchrun.listing import list_jobs
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ItemState, no_counts


def test_every_job_with_its_counts(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    assert list_jobs(ledger) == []
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1"))
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    first = prepare_job(ledger, spec, write_jsonl([line, "{broken"], "one.jsonl")).job_id
    second = prepare_job(ledger, spec, write_jsonl([line], "two.jsonl")).job_id
    listed = list_jobs(ledger)
    assert [job.job_id for job in listed] == [first, second] and listed[0].input_path.endswith("one.jsonl")
    created = listed[0].to_json().pop("created_at")
    assert abs(created - time.time()) < 600
    assert listed[0].to_json() == {
        "job_id": first, "name": None, "created_at": created, "model": None, "input": listed[0].input_path,
        "state": "work left", "total": 2, "counts": {**no_counts(), ItemState.PENDING: 1, ItemState.REJECTED: 1},
    }
    assert listed[1].input_path.endswith("two.jsonl") and listed[1].total == 1
