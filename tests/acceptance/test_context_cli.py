"""The context guard (issue 17, item 6): a prompt that cannot fit in its model's window is a
``rejected`` item at ingest, never a paid request; one only the provider can tell is too long
is a ``failed`` item of class ``context_length`` that fails that item alone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Refusals

from .conftest import run_cli

SPEC = """
name = "context"
[provider]
kind = "{kind}"
base_url = "{base_url}"
model = "{model}"
[request]
template = "Summarise: {{text}}"
max_tokens = 1024
{extra}
"""
LONG = {3, 7}  # these records are ~190,000 tokens by bytes/4: over gpt-4o's 128,000


def write_job(
    tmp_path: Path, server: FakeProviderServer, model: str = "gpt-4o", extra: str = "", kind: str = "openai"
) -> tuple[Path, Path]:
    spec, records = tmp_path / "job.toml", tmp_path / "records.jsonl"
    spec.write_text(SPEC.format(base_url=server.base_url, model=model, extra=extra, kind=kind))
    records.write_bytes(b"".join(
        orjson.dumps({"id": f"r{i}", "text": ("long " * 150_000 if i in LONG else "") + f"hello {i}"}) + b"\n"
        for i in range(20)
    ))
    return spec, records


@pytest.mark.slow
def test_prompts_over_the_window_are_rejected_never_sent_and_listed_everywhere(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    spec, records = write_job(tmp_path, server)
    db = tmp_path / "l.db"

    dry = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "20 lines, 18 items to send, 2 rejected" in dry.stdout
    for line in (4, 8):
        # ~187,500 by bytes/4; ~150,000 counted, when tiktoken has its table: over 128,000 either way
        assert re.search(rf"{re.escape(str(records))}:{line}: prompt ~?1[58]\d,\d{{3}} tokens( \(tiktoken\))? \+ "
                         r"max_tokens 1,024 exceeds the context window of gpt-4o \(128,000 tokens;", dry.stdout), dry.stdout
    assert server.log == []

    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert proc.returncode == 1, proc.stderr  # rejected lines: exit 1, as for any bad line
    assert len(server.log) == 18
    assert max(r.prompt_tokens for r in server.log) < 100  # none of the long prompts reached the server
    assert not any("long long" in (r.key or "") for r in server.log)

    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    assert status["counts"]["rejected"] == 2 and status["counts"]["succeeded"] == 18
    assert status["errors"] == {"context_length": 2}
    assert "exceeds the context window of gpt-4o" in status["errors_by_class"]["context_length"]["example"]
    text = run_cli(tmp_path, "status", "1", "--db", str(db)).stdout
    assert "context_length" in text, text
    report = run_cli(tmp_path, "report", "1", "--db", str(db))
    assert "context_length" in report.stdout and "set [request]" in report.stdout, report.stdout  # not eaten as markup
    errors = tmp_path / "errors.jsonl"
    run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(tmp_path / "out.jsonl"), "--errors", str(errors))
    rejected = [orjson.loads(line) for line in errors.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rejected) == ["r3", "r7"]
    assert all("exceeds the context window of gpt-4o" in orjson.dumps(r).decode() for r in rejected)


@pytest.mark.slow
def test_max_input_tokens_sets_the_window_of_a_model_the_table_does_not_know(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    unknown, records = write_job(tmp_path, server, model="my-local-model")
    dry = orjson.loads(run_cli(tmp_path, "submit", str(unknown), "--input", str(records), "--dry-run", "--json").stdout)
    assert dry["rejected"] == 0  # an unknown model: no guard
    guarded, _ = write_job(tmp_path, server, model="my-local-model", extra="max_input_tokens = 4096")
    db = tmp_path / "l.db"
    proc = run_cli(tmp_path, "submit", str(guarded), "--input", str(records), "--db", str(db))
    assert proc.returncode == 1, proc.stderr
    assert len(server.log) == 18
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    assert status["counts"]["rejected"] == 2


@pytest.mark.slow
def test_a_providers_context_length_400_fails_only_its_items_and_never_stops_the_job(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    """The model is unknown, so only the provider can tell: the first answers are its refusals of
    the long prompts (each a context_length failure after one request), the rest succeed."""
    server.refusals = Refusals(over_context="long long")
    spec, _ = write_job(tmp_path, server, model="m")
    db = tmp_path / "l.db"
    proc = submit_long_first(tmp_path, spec, db, 5)
    assert proc.returncode == 1, proc.stderr  # failed items, not a job-wide refusal (exit 3)
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    assert status["counts"]["failed"] == 5 and status["counts"]["succeeded"] == 25
    assert set(server.requests_by_key().values()) == {1}  # not retried: one request each
    assert status["errors"] == {"context_length": 5}  # not client_error
    assert "maximum context length" in status["errors_by_class"]["context_length"]["example"]
    assert "context_length" in run_cli(tmp_path, "report", "1", "--db", str(db)).stdout


def submit_long_first(tmp_path: Path, spec: Path, db: Path, long: int) -> subprocess.CompletedProcess[str]:
    """``submit`` of 30 records whose first ``long`` are the long prompts the server refuses."""
    records = tmp_path / "first.jsonl"
    records.write_bytes(b"".join(
        orjson.dumps({"id": f"r{i}", "text": ("long " * 50 if i < long else "") + f"hello {i}"}) + b"\n"
        for i in range(30)
    ))
    return run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_context_length_400s_that_read_alike_are_still_the_items_own(
    tmp_path: Path, server: FakeProviderServer, kind: str
) -> None:
    """The first answers are all the same "too long" 400: not a job-wide refusal (exit 3, items
    left pending) but failures of those items alone, and the rest of the job goes on."""
    server.refusals = Refusals(over_context="long long", over_context_count=250_000)
    spec, _ = write_job(tmp_path, server, model="m", kind=kind)
    db = tmp_path / "l.db"
    proc = submit_long_first(tmp_path, spec, db, 8)
    assert proc.returncode == 1, proc.stderr
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    assert status["counts"]["failed"] == 8 and status["counts"]["succeeded"] == 22
    assert status["errors"] == {"context_length": 8}
