"""A wrong model, path or parameter costs a handful of requests (issue 17, item 2).

The first answers of a run all refused the same way stop it like a 401 does: the
provider's message on screen, the items pending, exit 3; an item-specific 400 fails
only its item.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from batchrun.testing import FakeProviderServer, Refusals

from .conftest import run_cli
from .test_cli import SPEC, write_records, write_spec


def counts(tmp_path: Path, db: Path) -> dict[str, int]:
    data: dict[str, int] = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)["counts"]
    return data


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
