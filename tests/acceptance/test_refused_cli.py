"""A wrong model, path or parameter costs a handful of requests (issue 17, item 2).

The first answers of a run all refused the same way stop it like a 401 does: the
provider's message on screen, the items pending, exit 3; an item-specific 400 fails
only its item.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Refusals

from .conftest import run_cli
from .test_cli import SPEC, write_records, write_spec


def counts(tmp_path: Path, db: Path) -> dict[str, int]:
    data: dict[str, int] = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)["counts"]
    return data


@pytest.mark.slow
def test_a_wrong_model_stops_the_run_with_the_providers_message(tmp_path: Path, server: FakeProviderServer) -> None:
    server.refusals = Refusals(models=frozenset({"m"}))
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 500), tmp_path / "l.db"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--model", "gpt-4o-mnii")
    assert proc.returncode == 3, proc.stderr
    assert "The model `gpt-4o-mnii` does not exist" in proc.stderr
    assert f"carry on with: batchrun resume 1 --db {db}" in proc.stderr
    assert len(server.log) <= 8  # a handful, not 500
    assert counts(tmp_path, db)["pending"] == 500
    fixed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--model", "m")
    assert fixed.returncode == 0, fixed.stderr


@pytest.mark.slow
def test_a_wrong_path_and_an_unknown_parameter_stop_too(tmp_path: Path, server: FakeProviderServer) -> None:
    records = write_records(tmp_path, 300)
    wrong_path = run_cli(tmp_path, "submit", str(write_spec(tmp_path, server)), "--input", str(records),
                         "--db", str(tmp_path / "a.db"), "--base-url", server.base_url + "/v2")
    assert wrong_path.returncode == 3, wrong_path.stderr
    assert "Invalid URL" in wrong_path.stderr
    sent = len(server.log)
    assert sent <= 8
    server.refusals = Refusals(unknown_param="bogus")
    spec = write_spec(tmp_path, server, SPEC.replace("max_tokens = 50", "max_tokens = 50\nextra = {{bogus = 1}}"))
    param = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "b.db"))
    assert param.returncode == 3, param.stderr
    assert "Unrecognized request argument supplied: bogus" in param.stderr
    assert len(server.log) - sent <= 8


def test_an_item_specific_400_fails_only_its_item(tmp_path: Path, server: FakeProviderServer) -> None:
    server.refusals = Refusals(over_context="hello 0")  # the first record is too long for the model
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 50), tmp_path / "l.db"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert proc.returncode == 1, proc.stderr
    c = counts(tmp_path, db)
    assert c["failed"] == 1 and c["succeeded"] == 49
    assert set(server.requests_by_key().values()) == {1}  # the refused item too: one request


@pytest.mark.slow
def test_a_job_with_answers_is_never_stopped_by_a_few_items_refused_alike(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    """Three lines carry a parameter the provider refuses, all with one message. Once the job has
    answers they are those items' own failures: after `retry`, a resume that sends them first fails
    them again (exit 1) instead of stopping the job as a wrong model on every resume (exit 3)."""
    server.refusals = Refusals(unknown_param="bogus")
    src, db = tmp_path / "batch.jsonl", tmp_path / "l.db"
    lines = []
    for i in range(40):
        body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]}
        if i in (20, 21, 22):
            body["bogus"] = 1
        lines.append(orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": body}).decode())
    src.write_text("\n".join(lines) + "\n")
    first = run_cli(tmp_path, "submit", "--input", str(src), "--base-url", server.base_url, "--db", str(db),
                    "--concurrency", "1")
    assert first.returncode == 1, first.stderr
    assert counts(tmp_path, db)["failed"] == 3
    assert run_cli(tmp_path, "retry", "1", "--db", str(db)).returncode == 0
    again = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert again.returncode == 1, again.stderr
    c = counts(tmp_path, db)
    assert c["failed"] == 3 and c["succeeded"] == 37 and c["pending"] == 0
