"""What a run needs of a ledger: :class:`RunLedger`, the plug point :class:`~batchrun.scheduler.JobRunner`
is typed against; and what ``status`` and ``list`` read of one: :class:`StatusReader`.

:class:`~batchrun.ledger.store.Ledger` is the real one (SQLite, PostgreSQL);
:class:`batchrun.testing.ledger.InMemoryLedger` is the stand-in the runner's unit tests
use. tests/integration/test_ledger_contract.py runs the same scenarios on all three, so
the stand-in cannot drift from the real thing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from batchrun.ledger.records import AttemptTotals, Distribution, ErrorGroup, JobRecord, RunRow, ShardRecord
    from batchrun.ledger.store import AttemptRecord, CachedAnswer, ClaimedItem, Ledger, Outcome


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


class RunsReader(Protocol):
    def job_runs(self, job_id: int) -> tuple[list[RunRow], float]: ...


@runtime_checkable
class StatusReader(RunsReader, Protocol):
    """What ``status`` and ``list`` read of a ledger (:func:`batchrun.report.job_status` builds the answer
    from these, whichever reader gives them).

    :class:`batchrun.ledger.reading.LedgerReader` reads any ledger through SQLAlchemy;
    :class:`batchrun.ledger.quick.QuickReader` reads a SQLite ledger at the schema head with the
    stdlib's ``sqlite3``, read-only, and starts ~0.3 s sooner. tests/acceptance/test_quick_status.py
    checks the two give the same answers.
    """

    url: str

    def get_job(self, job_id: int) -> JobRecord: ...

    def list_jobs(self) -> list[tuple[JobRecord, dict[str, int]]]: ...

    def counts(self, job_id: int) -> dict[str, int]: ...

    def cached_count(self, job_id: int) -> int: ...

    def attempt_totals(self, job_id: int) -> AttemptTotals: ...

    def attempt_distribution(self, job_id: int, measure: str, percentiles: Sequence[int] = (50, 90, 99)) -> Distribution: ...

    def attempt_distributions(
        self, job_id: int, measures: Sequence[str], percentiles: Sequence[int] = (50, 90, 99)
    ) -> dict[str, Distribution]:
        """:meth:`attempt_distribution` of each of ``measures`` (a reader may read them side by side)."""
        ...

    def errors_by_class(self, job_id: int) -> list[ErrorGroup]: ...

    def errors_by_status(self, job_id: int) -> list[ErrorGroup]: ...

    def requests_per_item(self, job_id: int) -> dict[int, int]: ...

    def shards(self, job_id: int) -> list[ShardRecord]: ...

    def turnarounds(self, kind: str, limit: int = 200) -> list[float]: ...

    def answered_by_route(self, job_id: int) -> dict[str, int]: ...


def status_reader(ledger: Ledger | StatusReader) -> StatusReader:
    """What status and list read of ``ledger``: itself if it is a reader, else its SQLAlchemy reader."""
    if isinstance(ledger, StatusReader):
        return ledger
    from batchrun.ledger.reading import LedgerReader

    return LedgerReader(ledger)
