"""batchrun.testing.limiters: the fake server's limiter shapes, alone and behind the server
(a fixed window's 429 with only an integer Retry-After, its rate-limit headers)."""

from __future__ import annotations

import httpx
import pytest

from batchrun.testing import FakeProviderServer, Faults
from batchrun.testing.limiters import Bucket, FixedWindow, SlidingWindow, make_limiter


def test_a_fixed_window_counts_per_window_and_starts_afresh_at_the_next() -> None:
    w = FixedWindow()
    assert [w.take(300, 10.0 + i * 0.01, 1.0) for i in range(5)] == [0.0] * 5  # 5 per second
    assert w.take(300, 10.5, 1.0) == pytest.approx(0.5)  # full until the window ends at 11.0
    assert w.remaining(300, 10.6, 1.0) == 0 and w.reset_s(300, 10.6, 1.0) == pytest.approx(0.4)
    assert w.take(300, 11.0, 1.0) == 0.0  # a new window: a burst at its start is allowed
    assert w.remaining(300, 11.0, 1.0) == 4
    assert w.take(300, 13.2, 1.0) == 0.0 and w.reset_s(300, 13.2, 1.0) == pytest.approx(0.8)  # windows stay aligned


def test_a_bucket_of_burst_1_refuses_two_requests_closer_than_its_spacing() -> None:
    b = Bucket(1.0)
    assert b.take(3000, 0.0, 1.0) == 0.0
    assert b.take(3000, 0.015, 1.0) == pytest.approx(0.005)  # 50/s: 20 ms apart at the least
    assert b.take(3000, 0.02, 1.0) == 0.0
    assert b.take(3000, 0.06, 1.0) == 0.0 and b.take(3000, 0.061, 1.0) > 0  # idle time holds one token only


def test_a_sliding_window_bounds_any_span() -> None:
    w = SlidingWindow()
    assert [w.take(120, t, 1.0) for t in (0.0, 0.4, 0.9)] == [0.0, 0.0, pytest.approx(0.1)]  # 2 per second
    assert w.take(120, 1.0, 1.0) == 0.0


def test_make_limiter_knows_every_shape() -> None:
    assert isinstance(make_limiter("fixed"), FixedWindow)
    assert isinstance(make_limiter("bucket", 3.0), Bucket) and make_limiter("bucket", 3.0).burst == 3.0  # type: ignore[attr-defined]
    assert isinstance(make_limiter("sliding"), SlidingWindow)


def test_the_server_answers_a_full_fixed_window_with_an_integer_retry_after_only() -> None:
    faults = Faults(rpm_limit=120, rpm_window_s=1.0, rpm_shape="fixed", retry_after_integer=True)
    with FakeProviderServer(faults) as srv, httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        replies = [c.post("/chat/completions", json=body) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 429]
    refused = replies[2]
    assert refused.headers["retry-after"] == "1" and "retry-after-ms" not in refused.headers
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == ["1", "0", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "120" for r in replies)
    assert 0 < int(refused.headers["x-ratelimit-reset-requests"].removesuffix("ms")) <= 1000
