"""``batchrun cancel``: a job's unfinished items cancelled, and the runs working it seen to stop.

The items are cancelled in one transaction; a run working the job (on any machine) notices
within its ``cancel_poll_interval`` and sends nothing more, recording the answers already in
flight (they were paid for). ``cancel_job`` waits for those runs to end, so that once it
returns nothing more is sent and its figures are final.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchrun.ledger import Ledger, LedgerQueries
from batchrun.states import ItemState

RUNS_STOP_WAIT_SECONDS = 10.0  # a run's answers in flight are given this long to come in


@dataclass(frozen=True)
class Cancelled:
    """What ``cancel_job`` did: items that stay cancelled, answers in flight that came in meanwhile
    (succeeded: they were paid for), and whether a run of the job was still sending when it stopped waiting."""

    cancelled: int
    answered_in_flight: int
    run_still_working: bool


def cancel_job(ledger: Ledger, job_id: int, *, wait_seconds: float = RUNS_STOP_WAIT_SECONDS,
               poll_seconds: float = 0.05) -> Cancelled:
    """Cancel job ``job_id``'s pending and running items, then wait (up to ``wait_seconds``) for
    the runs sending its requests to stop. JobNotFoundError for an unknown job."""
    from batchrun.report import RUN_SILENT_S, run_state

    queries = LedgerQueries(ledger.engine)
    job = ledger.get_job(job_id)
    succeeded_before = queries.counts(job_id)[ItemState.SUCCEEDED]
    caught = ledger.cancel(job_id)
    deadline = time.monotonic() + wait_seconds
    stale_after = min(job.spec.run.lock_stale_seconds, RUN_SILENT_S)

    def sending() -> bool:  # an ingest's own run row sends nothing: not waited for
        runs, now = queries.job_runs(job_id)
        return any(run.command != "ingest" and run_state(run, now, stale_after) == "live" for run in runs)

    still = sending()
    while still and time.monotonic() < deadline:
        time.sleep(poll_seconds)
        still = sending()
    answered = max(0, queries.counts(job_id)[ItemState.SUCCEEDED] - succeeded_before)
    return Cancelled(cancelled=max(0, caught - answered), answered_in_flight=answered, run_still_working=still)
