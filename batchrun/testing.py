"""Fault-injecting OpenAI-compatible HTTP server for tests, benchmarks and ``batchrun demo``.

The server speaks a minimal HTTP/1.1 (persistent connections, pipelining, Content-Length and
chunked request bodies) written directly on ``asyncio`` streams, so that connection resets,
hangs and truncated bodies are fully under our control and the per-request cost stays small.

Run it in its own process with::

    python -m batchrun.testing serve --port 8000 --latency 0.2 --rpm 3000 --log requests.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import IO, Any

import orjson

__all__ = ["FakeOpenAIServer", "Faults", "RequestRecord", "default_key_fn", "main"]

_CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024
_BAD_BODY = b'{"id": "chatcmpl-broken", "choices": ['
_HEALTH_BODY = b'{"ok":true}'
_RPM_WINDOW_S = 60.0

# status -> (message, type, code) for OpenAI-shaped error bodies.
_ERRORS: dict[int, tuple[str, str, str | None]] = {
    400: ("Invalid request.", "invalid_request_error", "invalid_request"),
    401: ("Incorrect API key provided.", "invalid_request_error", "invalid_api_key"),
    403: ("You are not allowed to access this resource.", "invalid_request_error",
          "permission_denied"),
    404: ("Not found.", "invalid_request_error", "not_found"),
    408: ("Request timed out.", "invalid_request_error", "timeout"),
    409: ("Conflict.", "invalid_request_error", "conflict"),
    413: ("Request too large.", "invalid_request_error", "request_too_large"),
    422: ("Unprocessable entity.", "invalid_request_error", "unprocessable_entity"),
    429: ("Rate limit reached for requests.", "requests", "rate_limit_exceeded"),
    500: ("The server had an error while processing your request.", "server_error",
          "server_error"),
    502: ("Bad gateway.", "server_error", "bad_gateway"),
    503: ("The engine is currently overloaded, please try again later.", "overloaded",
          "overloaded"),
    504: ("Gateway timeout.", "server_error", "timeout"),
}

_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}


@dataclass
class Faults:
    """What the server does wrong; probabilities are per request, drawn in this order.

    The random faults share one uniform draw ``u`` per request and occupy consecutive
    intervals (``u < p_429`` -> 429, ``u < p_429 + p_500`` -> 500, ...), so each ``p_*`` is
    the marginal probability of that fault; their sum should not exceed 1. Deterministic
    faults are applied first: ``status_override``, then the 429 burst window, then
    ``rpm_limit``. Retry-After is whole seconds rounded up, plus ``retry-after-ms`` when
    the wait is fractional; burst 429s advertise the rest of the burst and rpm 429s the
    time until a slot frees.
    """

    latency_s: float = 0.0  # added before answering (asyncio.sleep)
    latency_jitter_s: float = 0.0  # uniform extra 0..jitter
    p_429: float = 0.0  # 429 with an OpenAI error body
    retry_after_s: float | None = 1.0  # Retry-After on random 429s; None -> no header
    p_500: float = 0.0
    p_503: float = 0.0
    p_reset: float = 0.0  # read the request, then drop the connection with a TCP RST
    p_hang: float = 0.0  # read the request, never answer
    p_bad_body: float = 0.0  # 200 whose (correctly framed) body is not valid JSON
    p_truncated: float = 0.0  # 200 whose body stops halfway, then the connection closes
    # Faults in the *content* of a 200 answer to a request with a json_schema
    # response_format (drawn from a third number, in this order):
    p_fenced: float = 0.0  # valid JSON inside a ```json code fence
    p_prose: float = 0.0  # valid JSON wrapped in a sentence before and after
    p_truncated_json: float = 0.0  # JSON cut in half, finish_reason "length"
    p_schema_violation: float = 0.0  # JSON that breaks the schema (a required key missing)
    p_not_json: float = 0.0  # plain prose, no JSON at all
    p_refusal: float = 0.0  # content null, message.refusal set
    output_faults_on_reask: bool = True  # False: a re-ask (a request with an assistant turn) is always answered well
    status_override: int | None = None  # answer every chat request with this status
    burst_429_period_s: float = 0.0  # > 0: each period (from server start) begins with...
    burst_429_duration_s: float = 0.0  # ...this many seconds of 429s for every request
    rpm_limit: int | None = None  # accepted requests per sliding 60 s window
    # Enforce rpm_limit over a shorter sliding window, scaled (1.0: at most rpm_limit/60 per second),
    # as providers may do.
    rpm_window_s: float = 60.0
    seed: int | None = None  # random.Random(seed); changing it while running reseeds


@dataclass(frozen=True)
class RequestRecord:
    """One request as seen by the server (appended when its handling finished)."""

    seq: int
    received_at: float
    finished_at: float
    method: str
    path: str
    key: str | None
    outcome: str
    status: int | None
    prompt_tokens: int
    completion_tokens: int
    output_fault: str | None = None  # which content fault a structured answer carried


def default_key_fn(body: dict[str, Any]) -> str | None:
    """Content of the first message with role "user" (a string), else None.

    The first, so a re-ask (which appends an assistant turn and a follow-up)
    counts against the same record.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for msg in messages:
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            return content if isinstance(content, str) else None
    return None


def _content_text(content: object) -> str:
    """Text of a message content: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _error_body(status: int, message: str | None = None) -> bytes:
    """OpenAI-shaped error body for ``status``."""
    default_msg, etype, code = _ERRORS.get(
        status,
        (f"Error {status}.", "server_error" if status >= 500 else "invalid_request_error", None),
    )
    return orjson.dumps(
        {"error": {"message": message or default_msg, "type": etype, "param": None, "code": code}}
    )


def _retry_after_headers(seconds: float) -> bytes:
    """``Retry-After`` (whole seconds, rounded up) plus ``retry-after-ms`` when fractional."""
    s = max(0.0, seconds)
    whole = math.ceil(s)
    if whole == s:
        return b"retry-after: %d\r\n" % whole
    return b"retry-after: %d\r\nretry-after-ms: %d\r\n" % (whole, math.ceil(s * 1000.0))


def _head(status: int, length: int, req_id: bytes, keep: bool, extra: bytes = b"") -> bytes:
    """Status line and headers of a response."""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"x-request-id: req_%s\r\n%sconnection: %s\r\n\r\n"
        % (status, _REASONS.get(status, b"Unknown"), length, req_id, extra,
           b"keep-alive" if keep else b"close")
    )


class _BadRequest(Exception):
    """Malformed HTTP framing; answered with a 400 and the connection is closed."""


class FakeOpenAIServer:
    """Fault-injecting OpenAI Chat Completions server on 127.0.0.1, running in its own thread
    and event loop."""

    def __init__(
        self,
        faults: Faults | None = None,
        *,
        port: int = 0,
        key_fn: Callable[[dict[str, Any]], str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        record_bodies: bool = False,
    ) -> None:
        self.faults: Faults = faults if faults is not None else Faults()
        self.port: int = port
        self._requested_port = port
        self._key_fn = key_fn if key_fn is not None else default_key_fn
        self._log_path = os.fspath(log_path) if log_path is not None else None
        self._lock = threading.Lock()
        self._log: list[RequestRecord] = []
        self._record_bodies = record_bodies
        self._bodies: list[Any] = []
        self._arrivals: collections.Counter[str] = collections.Counter()
        self._seq = 0
        self._rng_seed = self.faults.seed
        self._rng = random.Random(self._rng_seed)
        self._rpm_window: collections.deque[float] = collections.deque()
        self._t0 = time.monotonic()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._log_file: IO[bytes] | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> FakeOpenAIServer:
        """Start the server thread; returns once listening (port 0 -> ephemeral port)."""
        if self._thread is not None:
            return self
        self._closing = False
        self._startup_error = None
        if self._log_path is not None:
            self._log_file = open(self._log_path, "ab")  # noqa: SIM115 - closed in stop()
        ready = threading.Event()
        thread = threading.Thread(target=self._run, args=(ready,), name="FakeOpenAIServer",
                                  daemon=True)
        thread.start()
        ready.wait()
        if self._startup_error is not None:
            thread.join()
            self._close_log_file()
            err, self._startup_error = self._startup_error, None
            raise err
        self._thread = thread
        return self

    def stop(self) -> None:
        """Close the listener and every connection (hanging ones too), join the thread."""
        thread = self._thread
        if thread is None:
            return
        self._closing = True
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # loop already closed
                pass
        thread.join()
        self._thread = None
        self._loop = None
        self._stop_event = None
        self._close_log_file()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close_log_file(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(ready))
        except BaseException as exc:  # pragma: no cover - defensive
            if not ready.is_set():
                self._startup_error = exc
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                ready.set()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = stop_event = asyncio.Event()
        try:
            server = await asyncio.start_server(
                self._handle, "127.0.0.1", self._requested_port,
                limit=_MAX_HEADER_BYTES, backlog=1024,
            )
        except OSError as exc:
            self._startup_error = exc
            ready.set()
            return
        self.port = server.sockets[0].getsockname()[1]
        self._t0 = time.monotonic()
        ready.set()
        await stop_event.wait()

        self._closing = True
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        current = asyncio.current_task()
        while True:
            tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            if not tasks:
                break
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
        for _ in range(3):  # let transports run their connection_lost callbacks
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ log access

    @property
    def log(self) -> list[RequestRecord]:
        """Snapshot of the finished requests, in completion order."""
        with self._lock:
            return list(self._log)

    def requests_by_key(self) -> collections.Counter[str]:
        """How many requests arrived per key, all outcomes (in-flight ones included)."""
        with self._lock:
            return collections.Counter(self._arrivals)

    def ok_by_key(self) -> collections.Counter[str]:
        """How many 'ok' answers were sent per key."""
        with self._lock:
            return collections.Counter(
                r.key for r in self._log if r.outcome == "ok" and r.key is not None
            )

    def reset_log(self) -> None:
        """Forget the log and the per-key counters (``seq`` keeps counting)."""
        with self._lock:
            self._log.clear()
            self._bodies.clear()
            self._arrivals.clear()

    @property
    def bodies(self) -> list[Any]:
        """The parsed request bodies, in log order (only with ``record_bodies=True``)."""
        with self._lock:
            return list(self._bodies)

    def _record(self, rec: RequestRecord, body: Any = None) -> None:
        with self._lock:
            self._log.append(rec)
            if self._record_bodies:
                self._bodies.append(body)
        f = self._log_file
        if f is not None:
            f.write(orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE))
            f.flush()

    # ------------------------------------------------------------------ HTTP

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.transport.abort()
            return
        self._writers.add(writer)
        try:
            while not self._closing and await self._handle_one(reader, writer):
                pass
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            # Only stop() cancels these tasks. Finish normally: on Python 3.11 the stream
            # machinery logs a spurious error for cancelled client_connected_cb tasks.
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[str, str, bytes, bool] | None:
        """Read one request: (method, path, body, keep_alive), or None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError as exc:
            raise _BadRequest("request head too large") from exc
        if head[0] in b"\r\n":  # tolerate stray CRLFs between pipelined requests
            head = head.lstrip(b"\r\n")
            if not head:
                return await self._read_request(reader, writer)
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            raise _BadRequest("malformed request line")
        method_b, target, version = parts
        length = 0
        chunked = False
        conn = b""
        expect = False
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise _BadRequest("malformed header")
            name = name.lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError as exc:
                    raise _BadRequest("bad content-length") from exc
                if length < 0 or length > _MAX_BODY_BYTES:
                    raise _BadRequest("bad content-length")
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                conn = value.lower()
            elif name == b"expect":
                expect = b"100-continue" in value.lower()
        if version == b"HTTP/1.1":
            keep = b"close" not in conn
        elif version == b"HTTP/1.0":
            keep = b"keep-alive" in conn
        else:
            raise _BadRequest("unsupported HTTP version")
        if expect and (chunked or length):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if chunked:
            body = await self._read_chunked(reader)
        elif length:
            body = await reader.readexactly(length)
        else:
            body = b""
        path = target.split(b"?", 1)[0].decode("latin-1")
        return method_b.decode("latin-1"), path, body, keep

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        body = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError as exc:
                raise _BadRequest("bad chunk size") from exc
            if size < 0 or len(body) + size > _MAX_BODY_BYTES:
                raise _BadRequest("bad chunk size")
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # skip trailers
                    pass
                return bytes(body)
            body += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise _BadRequest("bad chunk terminator")

    async def _handle_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; returns whether the connection stays open."""
        try:
            req = await self._read_request(reader, writer)
        except _BadRequest as exc:
            body = _error_body(400, f"Bad request: {exc}.")
            writer.write(_head(400, len(body), b"bad_request", False) + body)
            await writer.drain()
            return False
        if req is None or self._closing:
            return False
        method, path, raw, keep = req

        if method == "GET" and path == "/health":
            writer.write(_head(200, len(_HEALTH_BODY), b"health", keep) + _HEALTH_BODY)
            await writer.drain()
            return keep

        received_at = time.time()
        obj: Any = None
        if raw:
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                obj = None
        key: str | None = None
        if isinstance(obj, dict):
            try:
                key = self._key_fn(obj)
            except Exception:
                key = None
        seq = self._seq
        self._seq = seq + 1
        if key is not None:
            with self._lock:
                self._arrivals[key] += 1
        f = self.faults
        rng = self._rng
        if f.seed != self._rng_seed:
            self._rng_seed = f.seed
            self._rng = rng = random.Random(f.seed)
        # Always two draws per logged request: the fate of request #seq depends only on
        # (seed, seq, faults), whatever the other requests did.
        jitter_u = rng.random()
        u = rng.random()
        delay = f.latency_s + jitter_u * f.latency_jitter_s
        now_m = time.monotonic()
        req_id = b"%d" % seq

        extra = b""
        prompt_tokens = 0
        err_msg: str | None = None
        outcome: str
        status: int | None
        if method != "POST" or path not in _CHAT_PATHS:
            outcome, status = "not_found", 404
            err_msg = f"Invalid URL ({method} {path})"
        elif not isinstance(obj, dict):
            outcome, status = "bad_request", 400
            err_msg = "We could not parse the JSON body of your request."
        else:
            prompt_tokens = self._prompt_tokens(obj)
            burst_left = 0.0
            if f.burst_429_period_s > 0 and f.burst_429_duration_s > 0:
                phase = (now_m - self._t0) % f.burst_429_period_s
                if phase < f.burst_429_duration_s:
                    burst_left = f.burst_429_duration_s - phase
            if f.status_override is not None:
                status = f.status_override
                outcome = f"status_{status}"
                if status == 429 and f.retry_after_s is not None:
                    extra = _retry_after_headers(f.retry_after_s)
            elif burst_left > 0:
                outcome, status = "429", 429
                extra = _retry_after_headers(burst_left)
            else:
                wait = self._rpm_take(f.rpm_limit, now_m, f.rpm_window_s) if f.rpm_limit is not None else 0.0
                if wait > 0:
                    outcome, status = "429", 429
                    extra = _retry_after_headers(wait)
                elif u < (acc := f.p_429):
                    outcome, status = "429", 429
                    if f.retry_after_s is not None:
                        extra = _retry_after_headers(f.retry_after_s)
                elif u < (acc := acc + f.p_500):
                    outcome, status = "500", 500
                elif u < (acc := acc + f.p_503):
                    outcome, status = "503", 503
                elif u < (acc := acc + f.p_reset):
                    outcome, status = "reset", None
                elif u < (acc := acc + f.p_hang):
                    outcome, status = "hang", None
                elif u < (acc := acc + f.p_bad_body):
                    outcome, status = "bad_body", 200
                elif u < acc + f.p_truncated:
                    outcome, status = "truncated", 200
                else:
                    outcome, status = "ok", 200
        if f.rpm_limit is not None:
            extra += b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n" % (
                f.rpm_limit, self._rpm_remaining(f.rpm_limit, now_m, f.rpm_window_s))

        def record(outcome: str, status: int | None, completion_tokens: int = 0, fault: str | None = None) -> None:
            self._record(RequestRecord(
                seq, received_at, time.time(), method, path, key, outcome, status,
                prompt_tokens, completion_tokens, fault,
            ), obj)

        # Records are appended just *before* the bytes go out, so a client that has seen
        # the response always finds its record in the log.
        if outcome == "hang":
            try:
                while await reader.read(65536):
                    pass
            finally:
                record("hang", None)
            return False
        if delay > 0:
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:  # stop() while waiting: the client sees a drop
                record("reset", None)
                raise
        if outcome == "reset":
            record("reset", None)
            self._abort_with_rst(writer)
            return False
        if status == 200:
            fault = self._output_fault(obj, f, rng) if outcome == "ok" else None
            body, completion_tokens = self._completion(obj, seq, prompt_tokens, key, fault)
            record(outcome, 200, completion_tokens, fault)
            if outcome == "bad_body":
                body = _BAD_BODY
            elif outcome == "truncated":
                writer.write(_head(200, len(body), req_id, False, extra) + body[: len(body) // 2])
                await writer.drain()
                return False
        else:
            assert status is not None
            body = _error_body(status, err_msg)
            record(outcome, status)
        assert status is not None
        writer.write(_head(status, len(body), req_id, keep, extra) + body)
        await writer.drain()
        return keep

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0, then abort)."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        writer.transport.abort()

    def _rpm_take(self, limit: int, now: float, window_s: float = _RPM_WINDOW_S) -> float:
        """Take a slot in the sliding window; returns 0.0 or the seconds until one frees."""
        window = self._rpm_window
        allowed = _window_allowance(limit, window_s)
        cutoff = now - window_s
        while window and window[0] <= cutoff:
            window.popleft()
        if allowed <= 0:
            return window_s
        if len(window) < allowed:
            window.append(now)
            return 0.0
        # the slot frees when the entry `allowed` places from the end leaves the window
        return max(window[-allowed] + window_s - now, 0.001)

    def _rpm_remaining(self, limit: int, now: float, window_s: float = _RPM_WINDOW_S) -> int:
        window = self._rpm_window
        cutoff = now - window_s
        while window and window[0] <= cutoff:
            window.popleft()
        return max(_window_allowance(limit, window_s) - len(window), 0)

    @staticmethod
    def _prompt_tokens(body: dict[str, Any]) -> int:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(
            len(_content_text(m.get("content"))) // 4 + 1 for m in messages if isinstance(m, dict)
        )

    @staticmethod
    def _output_fault(body: dict[str, Any], f: Faults, rng: random.Random) -> str | None:
        """The content fault of a structured answer, if any (a third draw, only for these)."""
        if _json_schema(body) is None:
            return None
        is_reask = any(isinstance(m, dict) and m.get("role") == "assistant" for m in body.get("messages") or [])
        if is_reask and not f.output_faults_on_reask:
            return None
        v = rng.random()
        acc = 0.0
        for name, p in (
            ("fenced", f.p_fenced), ("prose", f.p_prose), ("truncated_json", f.p_truncated_json),
            ("schema_violation", f.p_schema_violation), ("not_json", f.p_not_json), ("refusal", f.p_refusal),
        ):
            acc += p
            if v < acc:
                return name
        return None

    @staticmethod
    def _completion(
        body: dict[str, Any], seq: int, prompt_tokens: int, key: str | None = None, fault: str | None = None
    ) -> tuple[bytes, int]:
        """Deterministic completion body and its completion token count.

        Plain requests get ``"echo: " + last user message``; requests with a
        json_schema response_format get an instance of the schema derived from
        the key, spoiled as ``fault`` says.
        """
        schema = _json_schema(body)
        finish = "stop"
        refusal: str | None = None
        content: str | None
        if schema is not None:
            instance = _instance(schema, key or "")
            if fault == "schema_violation":
                instance = _violate(schema, instance)
            text = orjson.dumps(instance).decode()
            if fault == "fenced":
                text = f"```json\n{text}\n```"
            elif fault == "prose":
                text = f"Sure, here is the result:\n{text}\nLet me know if you need anything else."
            elif fault == "truncated_json":
                text, finish = text[: max(1, len(text) // 2)], "length"
            elif fault == "not_json":
                text = "I am not able to answer in JSON, but the ticket looks urgent."
            content = text
            if fault == "refusal":
                content, refusal = None, "I can't help with that request."
        else:
            messages = body.get("messages")
            text = ""
            if isinstance(messages, list):
                for msg in reversed(messages):
                    if isinstance(msg, dict) and msg.get("role") == "user":
                        text = _content_text(msg.get("content"))
                        break
            content = "echo: " + text
        completion_tokens = len(content or refusal or "") // 4 + 1
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if (content is not None and isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
                and max_tokens < completion_tokens):
            max_tokens = max(max_tokens, 0)
            content = content[: max_tokens * 4]
            completion_tokens = max_tokens
            finish = "length"
        model = body.get("model")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if refusal is not None:
            message["refusal"] = refusal
        payload = {
            "id": f"chatcmpl-{seq}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model if isinstance(model, str) else "fake-model",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        return orjson.dumps(payload), completion_tokens


def _window_allowance(rpm: int, window_s: float) -> int:
    """Requests allowed per sliding window of ``window_s`` for a per-minute limit."""
    return int(rpm * window_s / _RPM_WINDOW_S)


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if isinstance(schema, dict):
            return schema
    return None


def _instance(schema: Any, key: str, depth: int = 0) -> Any:
    """A value that matches ``schema``, chosen deterministically from ``key``."""
    if not isinstance(schema, dict) or depth > 20:
        return None
    pick = zlib.crc32(key.encode()) + depth
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][pick % len(schema["enum"])]
    for combo in ("anyOf", "oneOf"):
        if combo in schema and schema[combo]:
            return _instance(schema[combo][0], key, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {name: _instance(sub, key, depth + 1) for name, sub in props.items()}
    if kind == "array":
        count = max(1, int(schema.get("minItems", 1)))
        return [_instance(schema.get("items", {}), key, depth + 1) for _ in range(count)]
    if kind == "string":
        text = f"echo: {key}"
        if "maxLength" in schema:
            text = text[: int(schema["maxLength"])]
        return text.ljust(int(schema.get("minLength", 0)), "x")
    if kind in ("integer", "number"):
        low, high = schema.get("minimum", 0), schema.get("maximum", 1_000_000)
        return int(low + pick % (int(high - low) + 1))
    if kind == "boolean":
        return pick % 2 == 0
    return None


def _violate(schema: Any, instance: Any) -> Any:
    """``instance`` broken: a required key dropped, else a value of the wrong type."""
    if isinstance(instance, dict) and isinstance(schema, dict) and schema.get("required"):
        broken = dict(instance)
        broken.pop(schema["required"][0], None)
        return broken
    return {"unexpected": True} if not isinstance(instance, dict) else 12345


# ---------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m batchrun.testing serve ...``: run the fake server until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m batchrun.testing",
                                     description="Fault-injecting fake OpenAI server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve on 127.0.0.1 until SIGINT/SIGTERM")
    serve.add_argument("--port", type=int, default=8000, help="0 -> ephemeral")
    serve.add_argument("--latency", type=float, default=0.0, help="seconds added per request")
    serve.add_argument("--jitter", type=float, default=0.0, help="uniform extra 0..JITTER s")
    serve.add_argument("--rpm", type=int, default=None, help="sliding 60 s request limit")
    serve.add_argument("--rpm-window", type=float, default=60.0,
                       help="enforce --rpm over this sliding window in seconds, scaled (1: per second)")
    serve.add_argument("--retry-after", type=float, default=1.0,
                       help="Retry-After seconds on random 429s (negative -> no header)")
    for name in ("429", "500", "503", "reset", "hang", "bad-body", "truncated"):
        serve.add_argument(f"--p-{name}", type=float, default=0.0,
                           help=f"probability of a {name} fault")
    serve.add_argument("--status", type=int, default=None, help="answer everything with STATUS")
    serve.add_argument("--burst-period", type=float, default=0.0, help="429 burst period, s")
    serve.add_argument("--burst-duration", type=float, default=0.0, help="429 burst length, s")
    serve.add_argument("--seed", type=int, default=None)
    serve.add_argument("--log", default=None, help="append one JSON line per request here")
    args = parser.parse_args(argv)

    faults = Faults(
        latency_s=args.latency, latency_jitter_s=args.jitter,
        p_429=args.p_429, retry_after_s=args.retry_after if args.retry_after >= 0 else None,
        p_500=args.p_500, p_503=args.p_503, p_reset=args.p_reset, p_hang=args.p_hang,
        p_bad_body=args.p_bad_body, p_truncated=args.p_truncated,
        status_override=args.status, burst_429_period_s=args.burst_period,
        burst_429_duration_s=args.burst_duration, rpm_limit=args.rpm, rpm_window_s=args.rpm_window,
        seed=args.seed,
    )
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    with FakeOpenAIServer(faults, port=args.port, log_path=args.log) as server:
        print(f"listening on {server.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
        served = len(server.log)
    print(f"stopped after {served} requests", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
