"""The pieces of ``batchrun worker`` that need no database: the shared bucket's local side, shared concurrency."""

from __future__ import annotations

import asyncio

import pytest

from batchrun.ratelimit import AdaptiveConcurrency, SharedTokenBucket


def test_shared_bucket_reserves_in_chunks_and_waits_what_the_ledger_says() -> None:
    asked: list[float] = []

    async def reserve(amount: float) -> float:
        asked.append(amount)
        return 0.3 if len(asked) > 1 else 0.0  # the second chunk is paid for in 0.3 s (the job's bucket is in debt)

    async def go() -> float:
        bucket = SharedTokenBucket(6000, reserve)  # 98.5/s: chunks of ~19.7
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(30):
            await bucket.take(1)
        assert len(asked) == 2 and asked[0] == pytest.approx(6000 / 60 * 0.985 * 0.2)
        bucket.slow_down()  # after a 429 each request costs this process more of the job's budget
        local = bucket.local
        await bucket.take(1)
        assert bucket.local == pytest.approx(local - 1.25) and len(asked) == 2
        bucket.settle(10, 4)  # the estimate was high: the rest stays here
        return loop.time() - t0

    # Each part of a chunk is spent once paid for: the 30th request waits until 0.3 s minus the
    # 9.4 requests' worth still reserved behind it (at 98.5/s), not for the whole chunk.
    assert 0.3 - 9.4 / 98.5 - 0.01 <= asyncio.run(go()) < 0.3


def test_a_big_take_reserves_what_it_needs() -> None:
    asked: list[float] = []

    async def reserve(amount: float) -> float:
        asked.append(amount)
        return 0.0

    async def go() -> None:
        bucket = SharedTokenBucket(60_000, reserve)  # tokens: chunks of ~197
        await bucket.take(1500)
        assert asked == [1500]
        bucket.settle(1500, 1700)  # it cost more than estimated: owed locally, reserved with the next take
        await bucket.take(10)
        assert asked[1] == pytest.approx(210)

    asyncio.run(go())


def test_concurrency_limit_can_be_shared_out() -> None:
    async def go() -> None:
        c = AdaptiveConcurrency(8, initial=8)
        for _ in range(6):
            assert await c.acquire()
        c.set_limit(4)
        assert c.allowed == 4
        waiter = asyncio.ensure_future(c.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()  # 6 in flight over a limit of 4: wait until 3 are back
        c.release(3)
        assert await waiter

    asyncio.run(go())
