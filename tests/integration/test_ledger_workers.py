"""Ledger pieces behind ``batchrun worker`` (issue 6), on SQLite and on real PostgreSQL."""

from __future__ import annotations

import threading
import time

import pytest

from batchrun.ledger import Ledger, LedgerQueries
from batchrun.states import ItemState

from .test_ledger import SPEC, make_job


def item_rows(lines: range, key: str = "c") -> list[dict[str, object]]:
    return [{"line": i, "custom_id": f"{key}{i}", "url": None, "body": "{}", "state": ItemState.PENDING} for i in lines]


def test_taken_custom_ids_are_rejected_within_and_across_batches(ledger: Ledger) -> None:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash="dupes")
    assert ledger.insert_items(job_id, item_rows(range(1, 101))) == []
    again = item_rows(range(101, 104))
    again[1]["custom_id"] = "c7"  # taken by line 7 of the first batch
    again[2]["custom_id"] = "c101"  # taken by the first line of this batch
    dupes = ledger.insert_items(job_id, again)
    assert [(row["line"], first) for row, first in dupes] == [(102, 7), (103, 101)]
    # Stored in the same transaction as rejected lines: no line of a batch is ever left out.
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id))
    assert [r.line for r in rows] == [*range(1, 104)]
    assert [(r.custom_id, r.state, r.error_class) for r in rows[-2:]] == [
        ("c7", ItemState.REJECTED, "duplicate_custom_id"), ("c101", ItemState.REJECTED, "duplicate_custom_id"),
    ]
    # A line already stored is left as it is, whatever the batch says of it (each line is stored once).
    assert ledger.insert_items(job_id, item_rows(range(102, 103), key="other")) == []
    assert [r.custom_id for r in LedgerQueries(ledger.engine).iter_items(job_id) if r.line == 102] == ["c7"]
    # A rejected line may repeat a custom_id; the batch still goes in whole.
    rejected = {"line": 104, "custom_id": "c1", "url": None, "body": None, "state": ItemState.REJECTED,
                "error_class": "duplicate", "error_message": "dup"}
    assert ledger.insert_items(job_id, [rejected, *item_rows(range(105, 107))]) == []
    assert ledger.finish_ingest(job_id) == 106


def test_nul_in_a_batch_is_stored(ledger: Ledger) -> None:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash="nul2")
    rows = item_rows(range(1, 4))
    rows[1]["custom_id"] = "x\x00y"
    assert ledger.insert_items(job_id, rows) == []
    assert [r.custom_id for r in LedgerQueries(ledger.engine).iter_items(job_id)][1] in ("x\x00y", "x\ufffdy")


def test_an_exclusive_run_leaves_live_workers_items_alone(ledger: Ledger) -> None:
    job_id = make_job(ledger, 6)
    worker = ledger.start_run(job_id, "worker", exclusive=False)
    gone = ledger.start_run(job_id, "worker", exclusive=False)
    ledger.claim(job_id, worker, 2, 60)
    ledger.claim(job_id, gone, 2, 60)
    ledger.end_run(job_id, gone, 75)  # a worker that ended without giving its items back
    resume = ledger.start_run(job_id, "resume", exclusive=True)
    assert ledger.requeue_orphans(job_id, resume) == 2
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.RUNNING] == 2


def test_open_jobs_and_the_expired_lease_sweep(ledger: Ledger) -> None:
    done, waiting, fresh = make_job(ledger, 2), make_job(ledger, 2), make_job(ledger, 2)
    run = ledger.start_run(done, "worker", exclusive=False)
    ledger.cancel(done)
    held = ledger.start_run(waiting, "worker", exclusive=False)
    ledger.claim(waiting, held, 2, -1)  # leases already expired: its worker is dead
    assert ledger.open_jobs() == [(waiting, False), (fresh, True)]
    assert ledger.open_jobs([done, waiting]) == [(waiting, False)]
    assert ledger.requeue_expired_jobs([fresh]) == 0
    assert ledger.requeue_expired_jobs() == 2
    assert ledger.open_jobs() == [(waiting, True), (fresh, True)]
    assert run


@pytest.mark.slow
def test_rate_budget_is_one_bucket_for_every_taker(db_url: str) -> None:
    """Four takers on their own connections draw 60 requests from a 40/s bucket of 4: ~1.4 s."""
    ledgers = [Ledger.open(db_url) for _ in range(4)]
    try:
        job_id = make_job(ledgers[0], 1)
        ledgers[0].set_rate_budget(job_id, "requests", per_second=40.0, capacity=4.0)
        spent: list[float] = []

        def take(ledger: Ledger) -> None:
            for _ in range(15):
                wait = ledger.take_rate_budget(job_id, "requests", 1.0)
                time.sleep(wait)
                spent.append(time.monotonic())

        t0 = time.monotonic()
        threads = [threading.Thread(target=take, args=(led,)) for led in ledgers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = max(spent) - t0
        assert len(spent) == 60
        assert elapsed >= (60 - 4) / 40.0 * 0.97, "never faster than the rate, whoever takes"
        assert elapsed < 4 * (60 - 4) / 40.0, "no taker waits for another's share"
        # A later run's limit replaces the rate; the bucket stays one.
        ledgers[1].set_rate_budget(job_id, "requests", per_second=1000.0, capacity=10.0)
        time.sleep(0.05)
        assert ledgers[2].take_rate_budget(job_id, "requests", 1.0) == 0.0
        assert ledgers[3].take_rate_budget(job_id, "tokens", 1.0) == 0.0  # no such bucket: no limit
    finally:
        for led in ledgers:
            led.close()
