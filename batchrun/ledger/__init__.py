"""The ledger: SQLAlchemy models, engine set-up, the :class:`Ledger` write side, the :class:`LedgerQueries`
reads, :class:`RunLedger` (what a run needs of a ledger), and :class:`AsyncLedger`, which calls the ledger
from the event loop."""

from __future__ import annotations

from batchrun.ledger.engine import database_error_line, default_db_path, is_database_error, resolve_db_url
from batchrun.ledger.engine import LEDGER_RETRY_SECONDS
from batchrun.ledger.facade import AsyncLedger, ride_out
from batchrun.ledger.protocol import RunLedger
from batchrun.ledger.queries import (
    SHOW_FILTERS,
    AttemptRow,
    AttemptTotals,
    Distribution,
    ErrorGroup,
    ItemDetail,
    ItemRow,
    LedgerQueries,
    SharedOutputs,
)
from batchrun.ledger.store import RETRY_FILTERS, AttemptRecord, CachedAnswer, ClaimedItem, JobRecord, Ledger, Outcome

__all__ = [
    "LEDGER_RETRY_SECONDS",
    "RETRY_FILTERS",
    "SHOW_FILTERS",
    "AsyncLedger",
    "AttemptRecord",
    "AttemptRow",
    "AttemptTotals",
    "CachedAnswer",
    "ClaimedItem",
    "Distribution",
    "ErrorGroup",
    "ItemDetail",
    "ItemRow",
    "JobRecord",
    "Ledger",
    "LedgerQueries",
    "Outcome",
    "RunLedger",
    "SharedOutputs",
    "database_error_line",
    "default_db_path",
    "is_database_error",
    "resolve_db_url",
    "ride_out",
]
