"""Cancel keeps what was paid for (issue 17, item 7)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli, wait_for_requests
from .test_cli import write_records, write_spec


@pytest.mark.slow
def test_cancel_during_a_run_stops_sending_and_keeps_the_answers_in_flight(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    server.faults = Faults(latency_s=0.5)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 200), tmp_path / "l.db"
    run = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--quiet")
    wait_for_requests(server, 8)
    cancelled = run_cli(tmp_path, "cancel", "1", "--db", str(db))
    assert cancelled.returncode == 0, cancelled.stderr
    at_cancel = sum(server.requests_by_key().values())
    # cancel returned once the run had ended: it was the run's last word (it had stopped at once)
    assert run.poll() is not None
    _, err = run.communicate(timeout=60)
    assert run.returncode == 1, err  # finished: every item succeeded or cancelled
    assert "was cancelled (batchrun cancel) while this run worked it" in err
    assert f"batchrun retry 1 --state cancelled --db {db}" in err
    assert sum(server.requests_by_key().values()) == at_cancel  # nothing sent after cancel returned
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    answered = sum(server.ok_by_key().values())
    assert status["counts"]["succeeded"] == answered  # every answer the server sent was recorded
    assert status["counts"]["succeeded"] + status["counts"]["cancelled"] == 200
    text = run_cli(tmp_path, "status", "1", "--db", str(db)).stdout
    assert status["state"] == "cancelled" and "finished (cancelled)" in text and "(done)" not in text, text
    said = cancelled.stdout.strip()
    assert said.startswith(f"{status['counts']['cancelled']} items of job 1 cancelled"), said  # the final figure

    retried = run_cli(tmp_path, "retry", "1", "--state", "cancelled", "--db", str(db))
    assert retried.returncode == 0 and f"{status['counts']['cancelled']} items of job 1 back to pending" in retried.stdout
    server.faults = Faults()
    done = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert set(server.ok_by_key().values()) == {1}  # no answer paid for twice


def test_cancel_help_says_what_it_does(tmp_path: Path) -> None:
    shown = " ".join(run_cli(tmp_path, "cancel", "--help").stdout.split())
    assert "stops sending" in shown and "answers" in shown and "retry JOB --state cancelled" in shown
