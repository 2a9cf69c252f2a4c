"""``--max-runtime`` belongs to the invocation it is given to (issue 17, item 8)."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli
from .test_cli import SPEC, write_records, write_spec


@pytest.mark.slow
def test_a_submit_deadline_does_not_become_the_jobs(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.2)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 40), tmp_path / "l.db"
    first = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--max-runtime", "1s",
                    "--concurrency", "2")
    assert first.returncode == 75, first.stderr
    assert "--max-runtime of 1 s reached" in first.stderr
    started = time.monotonic()
    done = run_cli(tmp_path, "resume", "1", "--db", str(db), "--concurrency", "2")
    assert done.returncode == 0, done.stderr  # no stop after 1 s: the limit was the submit's
    assert time.monotonic() - started > 1.5  # long enough that an inherited 1 s limit would have stopped it
    assert set(server.requests_by_key().values()) == {1}


@pytest.mark.slow
def test_max_runtime_zero_means_no_limit(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.2)
    spec = write_spec(tmp_path, server, SPEC.replace("[run]", "[run]\nmax_runtime = 1"))
    records, db = write_records(tmp_path, 30), tmp_path / "l.db"
    for flag in ("0", "0s"):
        proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--max-runtime", flag,
                       "--concurrency", "2", "--new", "--no-cache")
        assert proc.returncode == 0, proc.stderr  # the spec's 1 s limit is lifted for this run
    # Without the flag the spec's own limit holds.
    limited = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--concurrency", "2",
                      "--new", "--no-cache")
    assert limited.returncode == 75 and "--max-runtime of 1 s reached" in limited.stderr
    bad = run_cli(tmp_path, "resume", "3", "--db", str(db), "--max-runtime", "-1")
    assert bad.returncode == 2 and "is not a duration" in bad.stderr
    counts = orjson.loads(run_cli(tmp_path, "status", "3", "--json", "--db", str(db)).stdout)["counts"]
    assert counts["pending"] > 0
