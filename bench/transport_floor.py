"""The HTTP stack's own CPU per request, with nothing of batchrun around it.

Sends N small chat requests at concurrency 100 to the fake server, once through a bare
``aiohttp.ClientSession`` and once through httpx-aiohttp's ``AiohttpTransport`` the way
batchrun does (``handle_async_request``, ``aread``, ``aclose``), on uvloop, and prints
CPU-s per 1,000 requests of each (after 200 warm-up requests)::

    .venv/bin/python -m batchrun.testing serve --port 8765 --latency 0 &
    .venv/bin/python bench/transport_floor.py http://127.0.0.1:8765/v1/chat/completions --n 10000

This is the floor under T1's CPU figure: what the client stack costs before batchrun
claims, sends, parses or records anything. With the server at ``--latency 0.2`` and
``--concurrency 200`` it is T2's ceiling on the machine: the rate a client that does nothing
else reaches against the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
import orjson
import uvloop
from httpx_aiohttp import AiohttpTransport

CONCURRENCY = 100  # --concurrency
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 32})
HEADERS = {"content-type": "application/json", "accept": "application/json", "authorization": "Bearer x"}


async def measure(name: str, one: Callable[[], Awaitable[None]], n: int) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def gated() -> None:
        async with gate:
            await one()

    await asyncio.gather(*(gated() for _ in range(200)))
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*(gated() for _ in range(n)))
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(f"{name:10} {n / wall:7.0f} requests/s  {cpu / n * 1000:.3f} CPU-s per 1,000 requests", flush=True)


async def main(url: str, n: int) -> None:
    limit = CONCURRENCY + 8
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit)) as session:

        async def bare() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                orjson.loads(await response.read())

        await measure("aiohttp", bare, n)

    transport = AiohttpTransport(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                                 trust_env=False)
    parsed, timeouts = httpx.URL(url), httpx.Timeout(60.0).as_dict()

    async def through_httpx() -> None:
        request = httpx.Request("POST", parsed, headers=HEADERS, content=BODY, extensions={"timeout": timeouts})
        response = await transport.handle_async_request(request)
        try:
            orjson.loads(await response.aread())
        finally:
            await response.aclose()

    try:
        await measure("transport", through_httpx, n)
    finally:
        await transport.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the fake server's chat completions URL")
    parser.add_argument("--n", type=int, default=10_000, help="requests per client stack (default 10,000)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="requests in flight (default 100)")
    args = parser.parse_args()
    CONCURRENCY = args.concurrency
    uvloop.run(main(args.url, args.n))
