"""batchrun.states: DESIGN.md's item states and exit codes, in one place."""

from __future__ import annotations

import pytest

from batchrun.states import (
    ALL_STATES,
    FINISHED_STATES,
    OPEN_STATES,
    USER_RETRYABLE_STATES,
    ExitCode,
    ItemState,
    StopReason,
    exit_code_for,
)


def counts(**n: int) -> dict[str, int]:
    return {**dict.fromkeys(ALL_STATES, 0), **n}


def test_states_are_the_strings_the_ledger_stores() -> None:
    assert [str(s) for s in ALL_STATES] == [
        "pending", "running", "submitted", "succeeded", "failed", "invalid_output", "rejected", "cancelled",
    ]
    assert set(OPEN_STATES) | set(FINISHED_STATES) == set(ALL_STATES)
    assert not set(OPEN_STATES) & set(FINISHED_STATES)
    assert set(USER_RETRYABLE_STATES) <= set(FINISHED_STATES)
    assert {ItemState.SUCCEEDED: 1}["succeeded"] == 1  # a count keyed by the string finds the state


@pytest.mark.parametrize(
    ("item_counts", "reason", "ingest_done", "code"),
    [
        (counts(succeeded=3), None, True, ExitCode.OK),
        (counts(succeeded=2, rejected=1), None, True, ExitCode.SOME_FAILED),
        (counts(succeeded=2, cancelled=1), None, True, ExitCode.SOME_FAILED),
        (counts(succeeded=2, pending=1), StopReason.SIGNAL, True, ExitCode.TEMPFAIL),
        (counts(succeeded=2, running=1), StopReason.DEADLINE, True, ExitCode.TEMPFAIL),
        (counts(succeeded=3), None, False, ExitCode.TEMPFAIL),  # the input is not all in yet
        (counts(pending=3), StopReason.AUTH, True, ExitCode.AUTH),
        (counts(pending=3), StopReason.BUDGET, True, ExitCode.BUDGET),
        (counts(succeeded=3), StopReason.LOCK_LOST, True, ExitCode.TEMPFAIL),  # another run finished it
        (counts(succeeded=2, submitted=1), StopReason.AT_PROVIDER, True, ExitCode.TEMPFAIL),  # a later run collects it
    ],
)
def test_exit_codes(item_counts: dict[str, int], reason: StopReason | None, ingest_done: bool, code: ExitCode) -> None:
    assert exit_code_for(item_counts, reason, ingest_done=ingest_done) == code
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 75]


def test_counts_are_keyed_by_plain_strings_for_json() -> None:
    import orjson

    from batchrun.states import no_counts

    counts = no_counts()
    counts[ItemState.PENDING] += 2  # an enum member finds the plain key
    assert orjson.loads(orjson.dumps(counts))["pending"] == 2
