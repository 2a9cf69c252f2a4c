"""The ledger: SQLAlchemy models, engine set-up, the :class:`Ledger` write side and the :class:`LedgerQueries` reads."""

from __future__ import annotations

from batchrun.ledger.engine import default_db_path, resolve_db_url
from batchrun.ledger.queries import AttemptTotals, Distribution, ErrorGroup, ItemRow, LedgerQueries, SharedOutputs
from batchrun.ledger.store import RETRY_FILTERS, AttemptRecord, ClaimedItem, JobRecord, Ledger, Outcome

__all__ = [
    "RETRY_FILTERS",
    "AttemptRecord",
    "AttemptTotals",
    "ClaimedItem",
    "Distribution",
    "ErrorGroup",
    "ItemRow",
    "JobRecord",
    "Ledger",
    "LedgerQueries",
    "Outcome",
    "SharedOutputs",
    "default_db_path",
    "resolve_db_url",
]
