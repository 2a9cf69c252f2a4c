"""A :class:`~batchrun.ledger.protocol.StatusReader` over an open :class:`~batchrun.ledger.store.Ledger`
(SQLAlchemy: SQLite or PostgreSQL), for ``status --watch``, ``report``, ``compare`` and any ledger the
quick reader (quick.py) does not read."""

from __future__ import annotations

from collections.abc import Sequence

from batchrun.ledger.queries import LedgerQueries
from batchrun.ledger.records import AttemptTotals, Distribution, ErrorGroup, JobRecord, RunRow, ShardRecord
from batchrun.ledger.shards import ShardLedger
from batchrun.ledger.store import Ledger


class LedgerReader:
    """The ledger's jobs (:class:`Ledger`), its read-only queries (:class:`LedgerQueries`) and its shards
    (:class:`ShardLedger`) as one :class:`~batchrun.ledger.protocol.StatusReader`."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.url = ledger.url
        self.queries = LedgerQueries(ledger.engine)
        self._shards = ShardLedger(ledger)

    def get_job(self, job_id: int) -> JobRecord:
        return self.ledger.get_job(job_id)

    def list_jobs(self) -> list[tuple[JobRecord, dict[str, int]]]:
        return self.ledger.list_jobs()

    def counts(self, job_id: int) -> dict[str, int]:
        return self.queries.counts(job_id)

    def cached_count(self, job_id: int) -> int:
        return self.queries.cached_count(job_id)

    def attempt_totals(self, job_id: int) -> AttemptTotals:
        return self.queries.attempt_totals(job_id)

    def attempt_distribution(self, job_id: int, measure: str, percentiles: Sequence[int] = (50, 90, 99)) -> Distribution:
        return self.queries.attempt_distribution(job_id, measure, percentiles)

    def attempt_distributions(
        self, job_id: int, measures: Sequence[str], percentiles: Sequence[int] = (50, 90, 99)
    ) -> dict[str, Distribution]:
        return {m: self.queries.attempt_distribution(job_id, m, percentiles) for m in measures}

    def errors_by_class(self, job_id: int) -> list[ErrorGroup]:
        return self.queries.errors_by_class(job_id)

    def errors_by_status(self, job_id: int) -> list[ErrorGroup]:
        return self.queries.errors_by_status(job_id)

    def requests_per_item(self, job_id: int) -> dict[int, int]:
        return self.queries.requests_per_item(job_id)

    def job_runs(self, job_id: int) -> tuple[list[RunRow], float]:
        return self.queries.job_runs(job_id)

    def shards(self, job_id: int) -> list[ShardRecord]:
        return self._shards.shards(job_id)

    def turnarounds(self, kind: str, limit: int = 200) -> list[float]:
        return self._shards.turnarounds(kind, limit)

    def answered_by_route(self, job_id: int) -> dict[str, int]:
        return self._shards.answered_by_route(job_id)
