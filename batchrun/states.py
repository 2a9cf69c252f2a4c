"""Item states, why a run stopped, and the exit code it ends with: DESIGN.md's two tables in one place.

Nothing here imports the rest of batchrun; the ledger, the errors and the commands import this.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum, StrEnum


class ItemState(StrEnum):
    """The states of an item (DESIGN.md, "Item states"); stored in the ledger as these strings."""

    PENDING = "pending"  # waiting for a run to claim it
    RUNNING = "running"  # leased to a run (owner, expiry)
    SUBMITTED = "submitted"  # in a live provider batch (a shard, batch mode): the provider has it
    SUCCEEDED = "succeeded"  # answered (and valid, for a job with a schema)
    FAILED = "failed"  # a permanent error, or its attempts used up
    INVALID_OUTPUT = "invalid_output"  # the answer failed validation on every re-ask
    REJECTED = "rejected"  # a bad input line: never sent
    CANCELLED = "cancelled"  # by `batchrun cancel`


ALL_STATES: tuple[ItemState, ...] = tuple(ItemState)
# Work left: what a run claims, or holds, or a provider batch holds.
OPEN_STATES: tuple[ItemState, ...] = (ItemState.PENDING, ItemState.RUNNING, ItemState.SUBMITTED)
# No run works these any more.
FINISHED_STATES: tuple[ItemState, ...] = (
    ItemState.SUCCEEDED, ItemState.FAILED, ItemState.INVALID_OUTPUT, ItemState.REJECTED, ItemState.CANCELLED,
)
# What a run settles an item it worked into (reported as its progress).
WORKED_STATES: tuple[ItemState, ...] = (ItemState.SUCCEEDED, ItemState.FAILED, ItemState.INVALID_OUTPUT)
# Sent again only when the user asks (`batchrun retry`): re-running them costs money. Not to be
# confused with a retryable error (errors.RetryableError), which the run retries by itself.
USER_RETRYABLE_STATES: tuple[ItemState, ...] = (ItemState.FAILED, ItemState.INVALID_OUTPUT, ItemState.CANCELLED)
# The items of an errors file.
ERROR_STATES: tuple[ItemState, ...] = (ItemState.FAILED, ItemState.INVALID_OUTPUT, ItemState.REJECTED)


def no_counts() -> dict[str, int]:
    """A count per state, all 0, keyed by the plain strings (JSON writers take no enum keys)."""
    return {state.value: 0 for state in ItemState}


class ShardState(StrEnum):
    """The states of a shard: one provider batch of a batch-mode job (DESIGN.md, "Batch mode").

    ::

        preparing --create sent--> creating --id recorded--> live --provider ended--> ended --results in--> collected
            ^                         |                                                  (failed: the provider
            +---- not at the provider (reconciled) ----+                                  refused it; items back)

    Its items are ``submitted`` from ``preparing`` until ``collected`` or ``failed``.
    """

    PREPARING = "preparing"  # the row and its items are committed; no create call was sent yet
    CREATING = "creating"  # a create call was sent: whether the provider has the batch is unknown until reconciled
    LIVE = "live"  # the provider's batch id is recorded; it is working on it
    ENDED = "ended"  # the provider ended it (completed, expired, cancelled): its results are to be collected
    COLLECTED = "collected"  # its results are in the ledger and its items settled
    FAILED = "failed"  # the provider refused it (validation, token limit): its items went back


# Shards whose items are still submitted.
OPEN_SHARD_STATES: tuple[ShardState, ...] = (
    ShardState.PREPARING, ShardState.CREATING, ShardState.LIVE, ShardState.ENDED,
)


class StopReason(StrEnum):
    """Why a run (or a worker) stopped before it ran out of work."""

    SIGNAL = "signal"  # SIGINT/SIGTERM
    DEADLINE = "deadline"  # --max-runtime
    AUTH = "auth"  # the provider refused the key
    REFUSED = "refused"  # the first requests were all refused the same way (a wrong model, path or parameter)
    CANCELLED = "cancelled"  # `batchrun cancel` cancelled the job's items while the run worked them
    BUDGET = "budget"  # the next request's worst case did not fit in the job's budget
    OUTAGE = "outage"  # every request failed for outage_seconds
    LOCK_LOST = "lock_lost"  # it stalled past its lock's staleness and another run took the job over
    LEDGER = "ledger"  # the ledger stayed unreachable (a worker)
    ERROR = "error"  # a bug or a broken environment
    INPUT = "input"  # the ingest beside the run could not read the rest of the input (a corrupt file)
    IDLE = "idle"  # a worker with --exit-when-idle found nothing left to do
    STOP = "stop"  # told to stop without a reason of its own (a worker's runner, a library caller)
    AT_PROVIDER = "at_provider"  # batch mode without --wait: items left in provider batches for a later run


class ExitCode(IntEnum):
    """The exit codes of DESIGN.md, "Cron and exit codes"."""

    OK = 0  # every item succeeded
    SOME_FAILED = 1  # finished; some items failed, invalid, rejected or cancelled
    USAGE = 2  # usage, spec or input error; nothing was sent
    AUTH = 3  # stopped: authentication refused, or every request refused the same way (model, path, parameter)
    BUDGET = 4  # stopped: budget reached
    TEMPFAIL = 75  # stopped early with work left (signal, --max-runtime, job locked): resume later


def job_state(counts: Mapping[str, int], ingest_done: bool = True) -> str:
    """A job as a whole, from its counts: ``ingesting``, ``work left``, ``cancelled``, ``some failed`` or ``done``."""
    if not ingest_done:
        return "ingesting"
    if sum(counts.get(state, 0) for state in OPEN_STATES):
        return "work left"
    if counts.get("cancelled", 0):
        return "cancelled"
    if counts.get("failed", 0) + counts.get("invalid_output", 0) + counts.get("rejected", 0):
        return "some failed"
    return "done"


def exit_code_for(counts: Mapping[str, int], stop_reason: str | None, *, ingest_done: bool = True) -> ExitCode:
    """A run's exit code from its job's item counts and why it stopped."""
    if stop_reason in (StopReason.AUTH, StopReason.REFUSED):
        return ExitCode.AUTH
    if stop_reason == StopReason.BUDGET:
        return ExitCode.BUDGET
    if stop_reason == StopReason.INPUT:
        return ExitCode.USAGE  # resuming reads the same bad bytes again: the input needs fixing
    if stop_reason == StopReason.LOCK_LOST:
        return ExitCode.TEMPFAIL  # another run has the job now: this one stopped early, whatever the counts say
    if any(counts.get(state, 0) for state in OPEN_STATES) or not ingest_done:
        return ExitCode.TEMPFAIL
    if counts.get(ItemState.SUCCEEDED, 0) == sum(counts.values()):
        return ExitCode.OK
    return ExitCode.SOME_FAILED
