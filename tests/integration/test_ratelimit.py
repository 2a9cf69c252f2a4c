"""Runs against the fake server's limiter shapes: a per-second fixed window, a token bucket of
burst 1, integer-only Retry-After, and a limit the run is not told (learnt from headers and 429s).

The server runs in the test's process (it shares the GIL), so the bounds here are loose on
purpose; bench/run.py T3 measures the same shapes with the server in its own process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchrun.ledger import Ledger
from batchrun.states import ExitCode
from batchrun.testing import FakeProviderServer, Faults
from tests.integration.test_scheduler import batch_lines, run, submit

PER_SECOND = 20  # the server's limit: 1,200 a minute, enforced per one-second window


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=1)) as srv:
        yield srv


def most_in_a_second(times: list[float]) -> int:
    """The most of ``times`` (sorted) that fall within any one second."""
    most, first = 0, 0
    for last, t in enumerate(times):
        while t - times[first] >= 1.0:
            first += 1
        most = max(most, last - first + 1)
    return most


def paced_run(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], n: int, **over: object
) -> tuple[float, int]:
    """Run ``n`` items; (accepted per second from the first request to the last ok answer, 429s)."""
    job_id = submit(ledger, server, write_jsonl(batch_lines(n)), concurrency=32, **over)
    assert run(ledger, job_id).exit_code == ExitCode.OK
    log = server.log
    oks = [r for r in log if r.status == 200]
    assert len({r.key for r in oks}) == n == len(oks)  # every item answered once
    span = max(r.finished_at for r in oks) - min(r.received_at for r in log)
    return len(oks) / span, sum(r.status == 429 for r in log)


@pytest.mark.slow
def test_a_per_second_fixed_window_with_integer_retry_after_is_held_with_few_429s(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(latency_s=0.05, rpm_limit=PER_SECOND * 60, rpm_window_s=1.0, rpm_shape="fixed",
                           retry_after_integer=True)
    rate, refused = paced_run(ledger, server, write_jsonl, 150, rpm=PER_SECOND * 60)
    assert refused <= 3
    # What the client sent (accepted or not) never passes the window's share in any second.
    sent = sorted(r.received_at for r in server.log)
    assert most_in_a_second(sent) <= PER_SECOND + 1
    assert 0.75 * PER_SECOND < rate <= PER_SECOND


@pytest.mark.slow
def test_a_limit_the_run_is_not_told_is_learnt_and_held(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    # No rpm: the server's x-ratelimit-* headers and its 429s (integer Retry-After only) are all there is.
    server.faults = Faults(latency_s=0.05, rpm_limit=PER_SECOND * 60, rpm_window_s=1.0, rpm_shape="fixed",
                           retry_after_integer=True)
    rate, refused = paced_run(ledger, server, write_jsonl, 200)
    assert refused <= 0.05 * (200 + refused)
    assert 0.7 * PER_SECOND < rate <= PER_SECOND


@pytest.mark.slow
def test_a_token_bucket_of_burst_1_is_paced_without_being_told(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    # The headers say 1,200 a minute; the bucket refuses any two requests closer than 50 ms.
    server.faults = Faults(latency_s=0.05, rpm_limit=PER_SECOND * 60, rpm_shape="bucket", rpm_burst=1.0,
                           retry_after_integer=True)
    rate, refused = paced_run(ledger, server, write_jsonl, 200)
    assert refused <= 0.1 * (200 + refused)
    assert 0.5 * PER_SECOND < rate <= PER_SECOND


@pytest.mark.slow
def test_a_token_bucket_of_burst_1_that_sends_no_headers_is_found_by_its_429s(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    # No rpm and no x-ratelimit-* headers: the 429s (integer Retry-After) are all the run learns from.
    # The first limit they give is read off answers that lag the growing pace (about half the real one);
    # probed up at 1 %/s after 10 s of quiet it stayed there for the whole of this run (~10/s).
    server.faults = Faults(latency_s=0.05, rpm_limit=PER_SECOND * 60, rpm_shape="bucket", rpm_burst=1.0,
                           retry_after_integer=True, ratelimit_headers=False)
    rate, refused = paced_run(ledger, server, write_jsonl, 500)
    assert refused <= 0.1 * (500 + refused)
    assert 0.65 * PER_SECOND < rate <= PER_SECOND
