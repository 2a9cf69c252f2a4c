"""``batchrun list``: the jobs of a ledger with their counts (no run machinery, no rich)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.ledger import Ledger


@dataclass(frozen=True)
class JobListing:
    """One job of the ledger: its id, name, input file and counts by item state."""

    job_id: int
    name: str | None
    input_path: str
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, Any]:
        """One element of the ``list --json`` array: ``job_id``, ``name``, ``input``, ``total``, ``counts``."""
        return {"job_id": self.job_id, "name": self.name, "input": self.input_path, "total": self.total,
                "counts": self.counts}


def list_jobs(ledger: Ledger) -> list[JobListing]:
    """Every job of the ledger, oldest first."""
    return [JobListing(job.id, job.name, job.input_path, counts) for job, counts in ledger.list_jobs()]
