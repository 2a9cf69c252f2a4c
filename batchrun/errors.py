"""The batchrun exception tree.

::

    BatchrunError
    ├── UsageError            exit 2: bad flags, spec or input; nothing was sent
    │   ├── SpecError
    │   ├── InputError
    │   └── ExportError
    │       └── ExportWriteError  exit 75: the file could not be written; the results are safe
    ├── JobNotFoundError      exit 2
    ├── StoppedError          exit 75: a signal stopped the command at a clean point
    ├── JobLockedError        exit 75: another run holds the job
    │   └── LockLostError     exit 75: this run stalled and another took the job over
    ├── LedgerBusyError       exit 75: the SQLite file stayed locked by a stalled writer
    ├── BudgetExceededError   exit 4: the next request's worst case does not fit in the job's budget
    ├── LedgerError           the ledger cannot be opened or upgraded
    │   └── LedgerWriteError  exit 75: it failed during a run; resume later
    ├── ProviderError         one attempt went wrong
    │   ├── RetryableError        timeouts, connection errors, 408/409/425/429/5xx/529, bad body
    │   │   └── RateLimitedError  429 (and friends), may carry a retry-after delay
    │   ├── PermanentError        other 4xx: retrying cannot help
    │   └── AuthError             401/403: every request would fail, stop the run
    └── OutputInvalidError    the answer is not valid structured output (truncated, refusal,
                              not_json, schema_invalid): re-asked, then invalid_output

Each class docstring is its default message; ``error_class`` is the short name
stored in the ledger and shown in reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from batchrun.states import ExitCode, StopReason


class BatchrunError(Exception):
    """Something went wrong in batchrun."""

    exit_code: ClassVar[int] = ExitCode.SOME_FAILED

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


class UsageError(BatchrunError):
    """Invalid usage."""

    exit_code = ExitCode.USAGE


class SpecError(UsageError):
    """The job spec is invalid."""


class InputError(UsageError):
    """The input file is invalid."""


class ExportError(UsageError):
    """The export cannot be written."""


class ExportWriteError(ExportError):
    """The output could not be written (full disk, permission, read-only folder).

    Exit 75, not 2: the job's results are whole and safe in the ledger and
    nothing more will be sent; only the file is missing, and writing it again
    (the same command, or ``batchrun export``) sends nothing.
    """

    exit_code = ExitCode.TEMPFAIL


class JobNotFoundError(BatchrunError):
    """No such job in this ledger."""

    exit_code = ExitCode.USAGE


class StoppedError(BatchrunError):
    """Stopped while reading the input; run the same command again to carry on."""

    exit_code = ExitCode.TEMPFAIL


class JobLockedError(BatchrunError):
    """Another run is working on this job."""

    exit_code = ExitCode.TEMPFAIL


class LockLostError(JobLockedError):
    """This run stalled past its lock's staleness and another run took the job over: stop sending."""

    stop_reason: ClassVar[StopReason] = StopReason.LOCK_LOST


class LedgerBusyError(BatchrunError):
    """The SQLite ledger stayed locked by another process (one stalled mid-write, e.g. under SIGSTOP)."""

    exit_code = ExitCode.TEMPFAIL


class BudgetExceededError(BatchrunError):
    """The job's budget is reached: the next request might cost more than is left of it."""

    exit_code = ExitCode.BUDGET
    stop_reason: ClassVar[StopReason] = StopReason.BUDGET  # mapped to exit 4 by the run's end


class LedgerError(BatchrunError):
    """The ledger cannot be used."""

    exit_code = ExitCode.USAGE


class LedgerWriteError(LedgerError):
    """The ledger failed during a run; what was committed is safe. Resume later."""

    exit_code = ExitCode.TEMPFAIL


class ProviderError(BatchrunError):
    """The request failed."""

    error_class: ClassVar[str] = "error"

    def __init__(
        self,
        message: str | None = None,
        *,
        status_code: int | None = None,
        error_class: str | None = None,
        body: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.headers: Mapping[str, str] | None = None  # the answer's headers, when there was one
        if error_class is not None:
            self.error_class = error_class  # type: ignore[misc]


class RetryableError(ProviderError):
    """The request failed in a way that may succeed when retried."""

    error_class = "retryable"

    def __init__(self, message: str | None = None, *, retry_after: float | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after = retry_after  # seconds the provider asked us to wait, if it said


class RateLimitedError(RetryableError):
    """The provider asked us to slow down."""

    error_class = "rate_limited"


class PermanentError(ProviderError):
    """The provider refused the request; retrying cannot help."""

    error_class = "client_error"


class AuthError(ProviderError):
    """The provider refused our credentials; every request would fail."""

    error_class = "auth"


# Why nothing connects, by error class (RetryableError.error_class), with the words its message
# starts with: named in the progress line, the final message, status and the report. A run that
# never had a clean answer gives up on these after [run] connect_grace.
CONNECT_ERRORS = {
    "connection_refused": "connection refused",
    "dns": "host not found (DNS)",
    "tls": "TLS handshake failed",
}


class OutputInvalidError(BatchrunError):
    """The answer is not valid structured output."""

    def __init__(
        self,
        message: str | None = None,
        *,
        error_class: str = "schema_invalid",
        raw: str | None = None,
        errors: list[dict[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.raw = raw
        self.errors = errors or []
