"""``batchrun list``: the jobs of a ledger with their counts (no run machinery, no rich)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchrun.ledger.protocol import StatusReader, status_reader
from batchrun.states import OPEN_STATES, job_state

if TYPE_CHECKING:
    from batchrun.ledger import Ledger


@dataclass(frozen=True)
class JobListing:
    """One job of the ledger: its id, name, input file and counts by item state."""

    job_id: int
    name: str | None
    input_path: str
    counts: dict[str, int]
    created_at: float = 0.0
    model: str | None = None
    ingest_done: bool = True

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def state(self) -> str:
        """The job as a whole (:func:`job_state`)."""
        return job_state(self.counts, self.ingest_done)

    def to_json(self) -> dict[str, Any]:
        """One element of the ``list --json`` array: ``job_id``, ``name``, ``created_at``, ``model``,
        ``input``, ``state``, ``total``, ``counts``."""
        return {"job_id": self.job_id, "name": self.name, "created_at": self.created_at, "model": self.model,
                "input": self.input_path, "state": self.state, "total": self.total, "counts": self.counts}


def list_jobs(ledger: Ledger | StatusReader) -> list[JobListing]:
    """Every job of the ledger (or of a reader of one: ``batchrun list``'s quick reader), oldest first."""
    return [JobListing(job.id, job.name, job.input_path, counts, job.created_at, job.spec.provider.model,
                       job.ingest_done) for job, counts in status_reader(ledger).list_jobs()]


_ROW = "{:>5}  {:<16}  {:<21}  {:<11}  {:>8}  {:>9}  {:>7}  {:>7}  {:>8}  {}"
LIST_HEADER = _ROW.format("ID", "CREATED", "MODEL", "STATE", "ITEMS", "SUCCEEDED", "PENDING", "FAILED", "REJECTED",
                          "NAME/INPUT")


def list_line(job: JobListing) -> str:
    """One row of ``batchrun list`` under :data:`LIST_HEADER`."""
    c = job.counts
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(job.created_at)) if job.created_at else "-"
    return _ROW.format(job.job_id, created, (job.model or "-")[:21], job.state, job.total, c["succeeded"],
                       sum(c[s] for s in OPEN_STATES), c["failed"] + c["invalid_output"], c["rejected"],
                       job.name or job.input_path)
