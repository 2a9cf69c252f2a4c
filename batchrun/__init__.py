"""batchrun: resumable batch jobs over LLM APIs, with a ledger that never pays twice."""

from __future__ import annotations

from batchrun.errors import (
    AuthError,
    BatchrunError,
    BudgetExceededError,
    ExportError,
    InputError,
    JobLockedError,
    JobNotFoundError,
    LedgerError,
    OutputInvalidError,
    PermanentError,
    ProviderError,
    RateLimitedError,
    RetryableError,
    SpecError,
    UsageError,
)

__all__ = [
    "AuthError",
    "BatchrunError",
    "BudgetExceededError",
    "ExportError",
    "InputError",
    "JobLockedError",
    "JobNotFoundError",
    "LedgerError",
    "OutputInvalidError",
    "PermanentError",
    "ProviderError",
    "RateLimitedError",
    "RetryableError",
    "SpecError",
    "UsageError",
]
