"""The ledger: SQLAlchemy models, engine set-up and the :class:`Ledger` store."""

from __future__ import annotations

from batchrun.ledger.engine import default_db_path, resolve_db_url
from batchrun.ledger.store import RETRY_FILTERS, AttemptRecord, ClaimedItem, ItemRow, JobRecord, Ledger, Outcome

__all__ = [
    "RETRY_FILTERS",
    "AttemptRecord",
    "ClaimedItem",
    "ItemRow",
    "JobRecord",
    "Ledger",
    "Outcome",
    "default_db_path",
    "resolve_db_url",
]
