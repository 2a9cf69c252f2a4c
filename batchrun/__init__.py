"""batchrun: resumable batch jobs over LLM APIs, with a ledger that never pays twice.

The library behind the ``batchrun`` command (README: "Python API")::

    import batchrun

    with batchrun.Ledger.open("ledger.db") as ledger:
        result = batchrun.submit(ledger, batchrun.load_spec("job.toml"), records, schema=Model)
        for row in batchrun.results(ledger, result.job_id):
            print(row.custom_id, row.status, row.output)

The exceptions, states, stop reasons and exit codes are loaded with the package;
everything else when it is first used, so ``import batchrun`` (and the
command's start-up) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchrun.errors import (
    AuthError,
    BatchrunError,
    BudgetExceededError,
    ExportError,
    ExportWriteError,
    InputError,
    JobLockedError,
    JobNotFoundError,
    LedgerBusyError,
    LedgerError,
    LedgerWriteError,
    LockLostError,
    OutputInvalidError,
    PermanentError,
    ProviderError,
    RateLimitedError,
    RetryableError,
    SpecError,
    StoppedError,
    UsageError,
)
from batchrun.states import ExitCode, ItemState, StopReason

if TYPE_CHECKING:
    from batchrun.collect import Result, as_finished, as_finished_async, results, results_async
    from batchrun.export import ExportResult, export_job
    from batchrun.jobs import DryRun, PreparedJob, dry_run
    from batchrun.ledger import Ledger
    from batchrun.listing import JobListing, list_jobs
    from batchrun.report import job_status
    from batchrun.scheduler import RunOptions
    from batchrun.spec import JobSpec, Overrides, load_spec
    from batchrun.submission import SubmitResult, resume, resume_async, submit, submit_async

# Loaded on first use (PEP 562): name -> the module that defines it.
_LAZY = {
    "DryRun": "batchrun.jobs",
    "ExportResult": "batchrun.export",
    "JobListing": "batchrun.listing",
    "JobSpec": "batchrun.spec",
    "Ledger": "batchrun.ledger",
    "Overrides": "batchrun.spec",
    "PreparedJob": "batchrun.jobs",
    "Result": "batchrun.collect",
    "RunOptions": "batchrun.scheduler",
    "SubmitResult": "batchrun.submission",
    "as_finished": "batchrun.collect",
    "as_finished_async": "batchrun.collect",
    "dry_run": "batchrun.jobs",
    "export_job": "batchrun.export",
    "job_status": "batchrun.report",
    "list_jobs": "batchrun.listing",
    "load_spec": "batchrun.spec",
    "results": "batchrun.collect",
    "results_async": "batchrun.collect",
    "resume": "batchrun.submission",
    "resume_async": "batchrun.submission",
    "submit": "batchrun.submission",
    "submit_async": "batchrun.submission",
}

__all__ = [
    "AuthError",
    "BatchrunError",
    "BudgetExceededError",
    "DryRun",
    "ExitCode",
    "ExportError",
    "ExportResult",
    "ExportWriteError",
    "InputError",
    "ItemState",
    "JobListing",
    "JobLockedError",
    "JobNotFoundError",
    "JobSpec",
    "Ledger",
    "LedgerBusyError",
    "LedgerError",
    "LedgerWriteError",
    "LockLostError",
    "OutputInvalidError",
    "Overrides",
    "PermanentError",
    "PreparedJob",
    "ProviderError",
    "RateLimitedError",
    "Result",
    "RetryableError",
    "RunOptions",
    "SpecError",
    "StopReason",
    "StoppedError",
    "SubmitResult",
    "UsageError",
    "as_finished",
    "as_finished_async",
    "dry_run",
    "export_job",
    "job_status",
    "list_jobs",
    "load_spec",
    "results",
    "results_async",
    "resume",
    "resume_async",
    "submit",
    "submit_async",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found at once from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
