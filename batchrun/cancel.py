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
    """What ``cancel_job`` did: items that stay cancelled, answers in flight that were recorded
    (succeeded, or failed), and whether a run of the job was still working when it stopped waiting."""

    cancelled: int
    answered_in_flight: int
    run_still_working: bool


def cancel_job(ledger: Ledger, job_id: int, *, wait_seconds: float = RUNS_STOP_WAIT_SECONDS,
               poll_seconds: float = 0.05) -> Cancelled:
    """Cancel job ``job_id``'s pending and running items, then wait (up to ``wait_seconds``) for
    the runs working it to stop. JobNotFoundError for an unknown job."""
    from batchrun.report import run_status

    queries = LedgerQueries(ledger.engine)
    job = ledger.get_job(job_id)
    before = queries.counts(job_id)[ItemState.CANCELLED]
    caught = ledger.cancel(job_id)
    deadline = time.monotonic() + wait_seconds

    def working() -> bool:
        status = run_status(queries, job)
        return status is not None and bool(status["live"])

    still = working()
    while still and time.monotonic() < deadline:
        time.sleep(poll_seconds)
        still = working()
    stays = max(0, queries.counts(job_id)[ItemState.CANCELLED] - before)
    return Cancelled(cancelled=stays, answered_in_flight=max(0, caught - stays), run_still_working=still)
