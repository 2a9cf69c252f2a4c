"""Export's batch formats: each provider's jobs export in its entry's batch line shape, and only those."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from batchrun.errors import ExportError
from batchrun.export import export_job
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger
from batchrun.provider_registry import BATCH_FORMATS, ENTRIES, KINDS, ProviderEntry, kinds_of_format
from batchrun.spec import Overrides, spec_for_batch_input

LINES = {
    "openai-batch": {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}},
    "anthropic-batch": {"custom_id": "a", "params": {"model": "m", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "hi"}]}},
}


@pytest.mark.parametrize("entry", ENTRIES, ids=KINDS)
def test_a_job_exports_in_its_own_batch_format_and_refuses_the_others(
    entry: ProviderEntry, ledger: Ledger, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", provider_kind=entry.kind))
    line = dict(LINES[entry.batch_format])
    if entry.kind == "openai-responses":
        line = {**line, "url": "/v1/responses", "body": {"model": "m", "input": "hi"}}
    job = prepare_job(ledger, spec, write_jsonl([line])).job_id
    own = export_job(ledger, job, tmp_path / "own.jsonl", fmt=entry.batch_format)
    assert own.lines == 1 and orjson.loads(own.path.read_bytes())["custom_id"] == "a"
    for other in BATCH_FORMATS:
        if other == entry.batch_format:
            continue
        with pytest.raises(ExportError) as info:
            export_job(ledger, job, tmp_path / "other.jsonl", fmt=other)
        assert info.value.message == (
            f"--format {other} holds {' or '.join(kinds_of_format(other))} answers, but job {job} is a "
            f"{entry.kind} job; use --format results or {entry.batch_format}"
        )
