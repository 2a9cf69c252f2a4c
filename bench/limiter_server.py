#!/usr/bin/env python3
"""A tiny rate-limited Chat Completions server, independent of ``batchrun.testing``.

Written from scratch for bench T3 so that batchrun's pacing is measured against a
limiter it was not co-written with (bench/RESULTS.md: the project's own server had
scored 98% where an outside one scored 64%). Standard library only; it imports
nothing from batchrun.

    python3 bench/limiter_server.py --shape fixed --limit 50 --period 1 --latency 0.2
    python3 bench/limiter_server.py --shape bucket --rate 50 --burst 1

Shapes:

- ``fixed``: at most ``--limit`` accepted requests per wall-clock window of
  ``--period`` seconds (windows start at multiples of the period since the epoch);
- ``bucket``: a token bucket refilled at ``--rate`` per second holding at most
  ``--burst`` tokens (burst 1: requests must be at least 1/rate apart).

A refused request gets 429 with only an integer ``Retry-After`` (seconds, rounded
up; never ``retry-after-ms``). With ``--headers`` every answer carries
``x-ratelimit-limit-requests`` (the limit per minute), ``-remaining-requests`` and
``-reset-requests`` (e.g. ``"340ms"``). It prints ``listening on http://127.0.0.1:PORT``
and, with ``--log``, one JSON line per request (``received_at``, ``finished_at``,
``status``, ``outcome``, ``key``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import time
from typing import Any


class Fixed:
    def __init__(self, limit: int, period: float) -> None:
        self.limit, self.period = limit, period
        self.window = -1
        self.used = 0

    def _roll(self, now: float) -> None:
        w = int(now // self.period)
        if w != self.window:
            self.window, self.used = w, 0

    def take(self, now: float) -> float:
        """0 if accepted, else seconds until the next window."""
        self._roll(now)
        if self.used < self.limit:
            self.used += 1
            return 0.0
        return (self.window + 1) * self.period - now

    def state(self, now: float) -> tuple[int, int, float]:
        self._roll(now)
        return (round(self.limit * 60 / self.period), self.limit - self.used,
                (self.window + 1) * self.period - now)


class Bucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = time.monotonic()

    def _fill(self) -> None:
        t = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (t - self.at) * self.rate)
        self.at = t

    def take(self, now: float) -> float:
        self._fill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def state(self, now: float) -> tuple[int, int, float]:
        self._fill()
        return round(self.rate * 60), int(self.tokens), (self.burst - self.tokens) / self.rate


def answer(body: dict[str, Any]) -> bytes:
    return json.dumps({
        "id": "chatcmpl-x", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", "m"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }).encode()


REFUSED = json.dumps({"error": {"message": "Rate limit reached for requests", "type": "requests",
                                "code": "rate_limit_exceeded"}}).encode()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["fixed", "bucket"], default="fixed")
    ap.add_argument("--limit", type=int, default=50, help="fixed: requests per window")
    ap.add_argument("--period", type=float, default=1.0, help="fixed: window seconds")
    ap.add_argument("--rate", type=float, default=50.0, help="bucket: tokens per second")
    ap.add_argument("--burst", type=float, default=1.0, help="bucket: capacity")
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--headers", action="store_true", help="send x-ratelimit-* headers")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    limiter: Fixed | Bucket = Fixed(args.limit, args.period) if args.shape == "fixed" else Bucket(args.rate, args.burst)
    log = open(args.log, "a", buffering=1 << 16) if args.log else None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                raw = await reader.readexactly(length) if length else b""
                received = time.time()
                wait = limiter.take(received)
                try:
                    body = json.loads(raw)
                    key = body["messages"][0]["content"]
                except (ValueError, KeyError, IndexError, TypeError):
                    body, key = {}, None
                extra = b""
                if args.headers:
                    limit, remaining, reset = limiter.state(received)
                    extra = b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n" \
                            b"x-ratelimit-reset-requests: %dms\r\n" % (limit, remaining, math.ceil(reset * 1000))
                if wait > 0:
                    status, payload = 429, REFUSED
                    extra += b"retry-after: %d\r\n" % max(1, math.ceil(wait))
                else:
                    status, payload = 200, answer(body)
                    await asyncio.sleep(args.latency)
                writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                             % (status, b"OK" if status == 200 else b"Too Many Requests", len(payload), extra)
                             + payload)
                await writer.drain()
                if log is not None:
                    log.write(json.dumps({"received_at": received, "finished_at": time.time(), "status": status,
                                          "outcome": "ok" if status == 200 else "429", "key": key}) + "\n")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", args.port, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    if log is not None:
        log.close()


if __name__ == "__main__":
    asyncio.run(main())
