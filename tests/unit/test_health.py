"""Health on its own: when failures mean an outage, how the pause grows, when a request counts as hung."""

from __future__ import annotations

import pytest

from batchrun.errors import AuthError, PermanentError, RateLimitedError, RetryableError
from batchrun.health import (
    HANG_MIN_SAMPLES,
    LATENCIES_KEPT,
    OUTAGE_AFTER_FAILURES,
    OUTAGE_MAX_PAUSE_S,
    Health,
    Outage,
    Refusals,
)
from batchrun.spec import RunSpec

DOWN = RetryableError("HTTP 503", status_code=503)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failures_in_a_row_across_items_mean_an_outage_and_a_clean_answer_ends_it() -> None:
    health = Health(RunSpec(outage_seconds=300.0), clock=Clock())
    for _ in range(OUTAGE_AFTER_FAILURES - 1):
        assert health.observe(DOWN) is None
    assert health.observe(RateLimitedError("HTTP 429", status_code=429)) == Outage(0.5)  # a 429 counts too
    assert health.observe(None) is None
    assert health.failures_in_row == 0
    assert health.observe(DOWN) is None  # counting starts again


def test_errors_that_are_not_retryable_neither_count_nor_end_an_outage() -> None:
    health = Health(RunSpec(), clock=Clock())
    for _ in range(OUTAGE_AFTER_FAILURES - 1):
        health.observe(DOWN)
    assert health.observe(PermanentError("HTTP 400", status_code=400)) is None
    assert health.observe(AuthError("HTTP 401", status_code=401)) is None
    assert health.failures_in_row == OUTAGE_AFTER_FAILURES - 1
    assert health.observe(DOWN) is not None
    assert health.observe(PermanentError("HTTP 400", status_code=400)) is not None  # still down


def test_the_shared_pause_doubles_at_most_once_a_second_up_to_its_cap() -> None:
    clock = Clock()
    health = Health(RunSpec(outage_seconds=1e9), clock=clock)
    for _ in range(OUTAGE_AFTER_FAILURES - 1):
        health.observe(DOWN)
    pauses: list[float] = []
    for _ in range(10):
        verdicts = [health.observe(DOWN) for _ in range(5)]  # a burst of failures in one second
        assert all(v is not None for v in verdicts) and len({v.pause_s for v in verdicts if v}) == 1
        pauses.append(verdicts[0].pause_s if verdicts[0] else 0.0)
        clock.now += 1.0
    assert pauses == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, *[OUTAGE_MAX_PAUSE_S] * 4]
    health.observe(None)
    for _ in range(OUTAGE_AFTER_FAILURES - 1):
        health.observe(DOWN)
    assert health.observe(DOWN) == Outage(0.5)  # a clean answer between: the pause starts small again


def test_no_clean_answer_for_outage_seconds_stops_the_run() -> None:
    clock = Clock()
    health = Health(RunSpec(outage_seconds=2.0), clock=clock)
    for _ in range(OUTAGE_AFTER_FAILURES):
        verdict = health.observe(DOWN)
    assert verdict is not None and verdict.stop_message is None
    clock.now += 2.5
    verdict = health.observe(DOWN)
    assert verdict is not None
    assert verdict.stop_message == (
        f"no clean answer for 2 s: every request failed ({OUTAGE_AFTER_FAILURES + 1} in a row: HTTP 503); "
        "the items stay pending"
    )


def test_hung_requests_are_cut_at_a_multiple_of_the_p99_once_enough_answers_are_known() -> None:
    health = Health(RunSpec(timeout=120.0, hang_factor=10.0, hang_min_seconds=0.5))
    for _ in range(HANG_MIN_SAMPLES - 1):
        health.note_latency(0.2)
    assert health.attempt_timeout == 120.0  # too few answers to know what is slow
    health.note_latency(0.2)
    assert health.attempt_timeout == pytest.approx(2.0)
    for _ in range(HANG_MIN_SAMPLES):
        health.note_latency(0.01)
    assert health.attempt_timeout == pytest.approx(2.0)  # the P99 of the 100 latest is still 0.2 s
    for _ in range(LATENCIES_KEPT):
        health.note_latency(0.01)
    assert health.attempt_timeout == 0.5  # never below hang_min_seconds
    assert len(health.latencies) == LATENCIES_KEPT
    for _ in range(LATENCIES_KEPT):
        health.note_latency(100.0)
    assert health.attempt_timeout == 120.0  # never above the spec's timeout


def test_a_hang_factor_of_zero_keeps_the_spec_timeout() -> None:
    health = Health(RunSpec(timeout=30.0, hang_factor=0.0))
    for _ in range(5 * HANG_MIN_SAMPLES):
        health.note_latency(0.01)
    assert health.attempt_timeout == 30.0



def test_the_same_refusal_for_three_items_before_any_answer_is_a_verdict() -> None:
    refusals: Refusals[int] = Refusals(items=3)
    wrong = PermanentError("HTTP 404: The model `x` does not exist", status_code=404)
    for item in (1, 2):
        assert refusals.hold(item, wrong) and refusals.verdict() is None
    assert refusals.hold(3, wrong)
    assert "The model `x` does not exist" in (refusals.verdict() or "")
    assert [item for item, _ in refusals.release()] == [1, 2, 3] and refusals.release() == []


def test_refusals_after_an_answer_of_another_kind_or_all_different_are_the_items_own() -> None:
    refusals: Refusals[int] = Refusals(items=2, hold_max=4)
    assert not refusals.hold(1, PermanentError("HTTP 413: too large", status_code=413))
    assert not refusals.hold(1, PermanentError("HTTP 400: filtered", status_code=400, error_class="content_filter"))
    different = [PermanentError(f"HTTP 400: item {i} is too long", status_code=400) for i in range(4)]
    for i in range(3):
        assert refusals.hold(i, different[i]) and refusals.verdict() is None and not refusals.decided
    assert refusals.hold(3, different[3]) and refusals.decided  # as many as it holds, all different
    assert refusals.verdict() is None
    assert not refusals.hold(4, different[0])


def test_a_run_that_never_connected_is_down_at_once_and_stops_after_connect_grace() -> None:
    clock = Clock()
    health = Health(RunSpec(outage_seconds=300.0, connect_grace=5.0), clock=clock)
    refused = RetryableError("connection refused: port 9", error_class="connection_refused")
    verdict = health.observe(refused)
    assert verdict is not None and verdict.stop_message is None  # down from the first: nothing charged
    clock.now += 6.0
    verdict = health.observe(refused)
    assert verdict is not None
    assert verdict.stop_message == (
        "nothing connected in 5 s ([run] connect_grace): connection refused: port 9; the items stay pending"
    )


def test_after_a_clean_answer_connection_errors_wait_for_the_outage_rules() -> None:
    clock = Clock()
    health = Health(RunSpec(outage_seconds=300.0, connect_grace=5.0), clock=clock)
    health.observe(None)
    refused = RetryableError("connection refused: port 9", error_class="connection_refused")
    assert health.observe(refused) is None  # one failure after answers is not an outage
    clock.now += 60.0
    for _ in range(OUTAGE_AFTER_FAILURES):
        verdict = health.observe(refused)
    assert verdict is not None and verdict.stop_message is None  # connect_grace is for a run never answered


def test_connect_grace_counts_from_the_first_connect_error_and_not_once_the_server_answered() -> None:
    clock = Clock()
    health = Health(RunSpec(outage_seconds=300.0, connect_grace=5.0), clock=clock)
    refused = RetryableError("connection refused: port 9", error_class="connection_refused")
    clock.now += 60.0  # first answers are slow (a reasoning model): no error for a minute
    verdict = health.observe(refused)
    assert verdict is not None and verdict.stop_message is None  # not "nothing connected in 5 s" yet
    clock.now += 6.0
    verdict = health.observe(refused)
    assert verdict is not None and verdict.stop_message is not None  # 6 s of nothing but refusals

    reached = Health(RunSpec(outage_seconds=300.0, connect_grace=5.0), clock=clock)
    reached.observe(RetryableError("HTTP 503: busy", status_code=503))  # the server is there
    clock.now += 60.0
    reached.observe(refused)
    clock.now += 60.0
    verdict = reached.observe(refused)
    assert verdict is None or verdict.stop_message is None  # the outage rules decide, not connect_grace


def test_refusals_that_differ_only_by_a_request_id_read_the_same() -> None:
    refusals: Refusals[int] = Refusals(items=3)
    for i, rid in enumerate(("req_011CUxy7abc", "9f86d081884c7d659a2feaa0c55ad015", "8c2f0d5e-1b2a-4c3d-9e8f-0a1b2c3d4e5f")):
        error = PermanentError(f"HTTP 404: The model `gpt-4o-mnii` does not exist (request id: {rid})", status_code=404)
        assert refusals.hold(i, error)
    assert refusals.verdict() is not None
    sizes: Refusals[int] = Refusals(items=3)
    for i in range(3):  # an item's own numbers are its own
        sizes.hold(i, PermanentError(f"HTTP 400: your messages resulted in {9000 + i} tokens", status_code=400))
    assert sizes.verdict() is None
