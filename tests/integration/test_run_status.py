"""What ``status`` says of a job's runs: an ingest's batches keep its run at work, and a run not
heard of for three heartbeats is dead whatever the job's lease (a long lease decides lock
takeovers, not what status shows)."""

from __future__ import annotations

import time

from sqlalchemy import update

from batchrun.ledger import Ledger, LedgerQueries
from batchrun.ledger.models import runs
from batchrun.report import RUN_SILENT_S, run_status
from batchrun.spec import Overrides, spec_for_batch_input


def _job(ledger: Ledger, lease: float) -> int:
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m", lease_seconds=lease))
    return ledger.create_job(spec, input_path="in.jsonl", input_hash=f"h{time.time_ns()}")


def _silent_for(ledger: Ledger, run_id: str, seconds: float) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run_id).values(heartbeat_at=time.time() - seconds,
                                                                    host="another-host"))


def _state(ledger: Ledger, job_id: int) -> str:
    status = run_status(LedgerQueries(ledger.engine), ledger.get_job(job_id))
    assert status is not None
    return str(status["last"]["state"])


def test_an_ingest_batch_is_its_runs_heartbeat(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with Ledger.open(tmp_path / "l.db") as ledger:
        job_id = _job(ledger, lease=4.0)  # lock staleness 2 s
        run_id = ledger.start_run(job_id, "submit", exclusive=True, stale_after=2.0)
        _silent_for(ledger, run_id, 10.0)
        assert _state(ledger, job_id) == "dead"
        row = {"line": 1, "custom_id": "a", "url": None, "body": "{}", "state": "pending"}
        ledger.insert_items(job_id, [row], run_id=run_id)  # reading the input, for minutes maybe
        assert _state(ledger, job_id) == "live"


def test_a_long_lease_does_not_keep_a_silent_run_alive(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with Ledger.open(tmp_path / "l.db") as ledger:
        job_id = _job(ledger, lease=3600.0)  # lock staleness 30 min
        run_id = ledger.start_run(job_id, "submit", exclusive=True, stale_after=1800.0)
        _silent_for(ledger, run_id, RUN_SILENT_S / 3)
        assert _state(ledger, job_id) == "live"
        _silent_for(ledger, run_id, RUN_SILENT_S + 5)
        assert _state(ledger, job_id) == "dead"


def test_a_live_worker_is_not_a_reader_of_the_input(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The submit storing the input died; a worker (which never reads the input) works the job's
    stored items: status must not say the input is still being read."""
    from batchrun.report import job_status, status_lines

    with Ledger.open(tmp_path / "l.db") as ledger:
        job_id = _job(ledger, lease=60.0)
        reader = ledger.start_run(job_id, "submit", exclusive=True, stale_after=30.0)
        row = {"line": 1, "custom_id": "a", "url": None, "body": "{}", "state": "pending"}
        ledger.insert_items(job_id, [row], run_id=reader)
        ledger.start_run(job_id, "worker", exclusive=False)
        data = job_status(ledger, job_id)
        assert data["run"]["live"] and data["run"]["reading"] and data["state"] == "ingesting"
        assert "(ingesting: the input is still being read, the total grows)" in status_lines(data)[2]
        _silent_for(ledger, reader, RUN_SILENT_S + 5)
        data = job_status(ledger, job_id)
        assert data["run"]["live"] and not data["run"]["reading"]  # the worker beats on
        assert "(input read in part: the run reading it is gone; resume reads the rest)" in status_lines(data)[2]
