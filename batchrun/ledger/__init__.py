"""The ledger: SQLAlchemy models, engine set-up, the :class:`Ledger` write side, the :class:`LedgerQueries`
reads, :class:`RunLedger` (what a run needs of a ledger), and :class:`AsyncLedger`, which calls the ledger
from the event loop.

The names load on first use (PEP 562), so what needs only :mod:`batchrun.ledger.basics`
(``--help``, the filters, the default path) does not import SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchrun.ledger.basics import (
    RETRY_FILTERS,
    SHOW_FILTERS,
    database_error_line,
    default_db_path,
    is_database_error,
    resolve_db_url,
)

if TYPE_CHECKING:
    from batchrun.ledger.engine import LEDGER_RETRY_SECONDS
    from batchrun.ledger.facade import AsyncLedger, ride_out
    from batchrun.ledger.protocol import RunLedger
    from batchrun.ledger.protocol import StatusReader
    from batchrun.ledger.queries import AttemptRow, ItemDetail, ItemRow, LedgerQueries, SharedOutputs
    from batchrun.ledger.records import AttemptTotals, Distribution, ErrorGroup, JobRecord, RunRow
    from batchrun.ledger.store import AttemptRecord, CachedAnswer, ClaimedItem, Ledger, Outcome

# name -> the module that defines it
_LAZY = {
    "LEDGER_RETRY_SECONDS": "batchrun.ledger.engine",
    "AsyncLedger": "batchrun.ledger.facade",
    "ride_out": "batchrun.ledger.facade",
    "RunLedger": "batchrun.ledger.protocol",
    "StatusReader": "batchrun.ledger.protocol",
    **dict.fromkeys(("AttemptRow", "ItemDetail", "ItemRow", "LedgerQueries", "SharedOutputs"), "batchrun.ledger.queries"),
    # SQLAlchemy-free: what status and list read, whichever reader reads it
    **dict.fromkeys(("AttemptTotals", "Distribution", "ErrorGroup", "JobRecord", "RunRow"), "batchrun.ledger.records"),
    **dict.fromkeys(("AttemptRecord", "CachedAnswer", "ClaimedItem", "Ledger", "Outcome"), "batchrun.ledger.store"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
    "RunRow",
    "SharedOutputs",
    "StatusReader",
    "database_error_line",
    "default_db_path",
    "is_database_error",
    "resolve_db_url",
    "ride_out",
]
