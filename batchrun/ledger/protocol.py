"""What a run needs of a ledger: :class:`RunLedger`, the plug point :class:`~batchrun.scheduler.JobRunner`
is typed against.

:class:`~batchrun.ledger.store.Ledger` is the real one (SQLite, PostgreSQL);
:class:`batchrun.testing.ledger.InMemoryLedger` is the stand-in the runner's unit tests
use. tests/integration/test_ledger_contract.py runs the same scenarios on all three, so
the stand-in cannot drift from the real thing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from batchrun.ledger.store import AttemptRecord, CachedAnswer, ClaimedItem, JobRecord, Outcome


class RunLedger(Protocol):
    """The ledger calls a run makes, from its start to its end (see :class:`~batchrun.ledger.store.Ledger`
    for what each promises)."""

    @property
    def reconnects(self) -> bool:
        """Whether a call cut by a lost connection is worth retrying whole (a database server, not a file)."""
        ...

    @property
    def shares_rate_budgets(self) -> bool:
        """Whether the job's ``rpm``/``tpm`` budgets are kept here, one for all its runs (workers on several hosts)."""
        ...

    # -- the job and the run ------------------------------------------------

    def get_job(self, job_id: int) -> JobRecord: ...

    def start_run(
        self, job_id: int, command: str, *, exclusive: bool, stale_after: float = 60.0, run_id: str | None = None
    ) -> str: ...

    def end_run(self, job_id: int, run_id: str, exit_code: int) -> None: ...

    def counts(self, job_id: int) -> dict[str, int]: ...

    def cancelled_since(self, job_id: int, since: float) -> bool: ...

    # -- the spend so far, the pace, the rate budgets -------------------------

    def spent_usd(self, job_id: int) -> float: ...

    def recent_latencies(self, job_id: int, limit: int) -> list[float]: ...

    def set_rate_budget(self, job_id: int, kind: str, per_second: float, capacity: float) -> None: ...

    def take_rate_budget(self, job_id: int, kind: str, amount: float) -> float: ...

    # -- leases ---------------------------------------------------------------

    def requeue_orphans(self, job_id: int, run_id: str) -> int: ...

    def requeue_expired(self, job_id: int) -> int: ...

    def claim(
        self, job_id: int, run_id: str, limit: int, lease_seconds: float, *, exclusive: bool = False, token: int = 0
    ) -> list[ClaimedItem]: ...

    def heartbeat(self, job_id: int, run_id: str, lease_seconds: float, *, exclusive: bool = False) -> dict[int, int]: ...

    def release_held(self, job_id: int, run_id: str) -> int: ...

    # -- outcomes ---------------------------------------------------------------

    def find_cached(self, keys: Collection[str]) -> dict[str, CachedAnswer]: ...

    def record(self, run_id: str, outcomes: Sequence[Outcome], attempts: Sequence[AttemptRecord]) -> None: ...
