"""Issue 17, item 10: progress that reads right — the job's totals on resume, timestamped plain lines,
and a terminal bar that keeps done/total, rate and a labelled ETA at 80 columns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli
from .test_cli import write_records, write_spec


@pytest.mark.slow
def test_resume_shows_the_jobs_totals_and_plain_lines_carry_a_timestamp(tmp_path: Path) -> None:
    with FakeProviderServer(Faults(seed=2, latency_s=0.2)) as server:
        spec, records = write_spec(tmp_path, server), write_records(tmp_path, 200)
        db = str(tmp_path / "l.db")
        first = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", db, "--concurrency", "4",
                        "--max-runtime", "2s")
        assert first.returncode == 75, first.stderr
        resumed = run_cli(tmp_path, "resume", "1", "--db", db, "--progress-interval", "0.5")
    assert resumed.returncode == 0, resumed.stderr
    lines = [line for line in resumed.stderr.splitlines() if "job 1: done" in line]
    assert lines and lines[-1].split(" done ")[1].startswith("200/200 ok=200 failed=0 "), resumed.stderr  # all the job's
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d batchrun: ", line) for line in lines), lines
