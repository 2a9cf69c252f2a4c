"""The fake server: a listener on 127.0.0.1 in its own thread that routes each request to its API,
draws its fate from the :class:`Faults` and logs what it answered."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import orjson

from batchrun.testing.anthropic import MessagesApi
from batchrun.testing.answers import Answer, default_key_fn, messages_key
from batchrun.testing.api import Api, spoil_frame
from batchrun.testing.faults import BatchFaults, Faults, content_fault, fate
from batchrun.testing.limiters import Limiter, make_limiter
from batchrun.testing.openai import ChatApi, ResponsesApi
from batchrun.testing.refusals import Refusals
from batchrun.testing.request_log import RequestRecord, new_record
if TYPE_CHECKING:
    from batchrun.testing.batch_service import BatchService
from batchrun.testing.wire import (
    MAX_HEADER_BYTES,
    BadRequest,
    StreamedRequest,
    abort_with_rst,
    read_request,
    response_head,
    retry_after_headers,
    sse_head,
)

_HEALTH_BODY = b'{"ok":true}'


_CHAT, _RESPONSES, _MESSAGES = ChatApi(), ResponsesApi(), MessagesApi()
_ROUTES: dict[str, Api] = {
    "/v1/chat/completions": _CHAT, "/chat/completions": _CHAT,
    "/v1/responses": _RESPONSES, "/responses": _RESPONSES,
    "/v1/messages": _MESSAGES, "/messages": _MESSAGES,
}


class FakeProviderServer:
    """Fault-injecting Chat Completions, Responses and Messages server on 127.0.0.1, with their
    batch APIs (OpenAI Files + Batch, Anthropic Message Batches), running in its own thread and
    event loop.

    ``batch_faults`` sets the batch APIs' timing and faults (:class:`BatchFaults`);
    ``batch_state_dir`` keeps their files, batches and progress on disk, so that a server
    started again on the same directory (and port) carries on where the last one stopped.
    """

    def __init__(
        self,
        faults: Faults | None = None,
        *,
        port: int = 0,
        key_fn: Callable[[dict[str, Any]], str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        record_bodies: bool = False,
        api_key: str | None = None,
        batch_faults: BatchFaults | None = None,
        batch_state_dir: str | os.PathLike[str] | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        self.faults: Faults = faults if faults is not None else Faults()
        # the client errors it answers (a model that does not exist, ...); may be replaced while running
        self.refusals: Refusals = refusals if refusals is not None else Refusals()
        # the batch APIs' timing and faults; may be replaced while running
        self.batch_faults: BatchFaults = batch_faults if batch_faults is not None else BatchFaults()
        self.port: int = port
        self.api_key: str | None = api_key  # required credential when set; may change while running
        self._requested_port = port
        # The key function of each API's requests, and of an unknown route's. By default only
        # Responses keys on "input": an embeddings-like body sent to an unknown path is not a
        # Responses request.
        self._keyers: dict[str, Callable[[dict[str, Any]], str | None]] = {
            api.name: key_fn if key_fn is not None else (
                default_key_fn if api is _RESPONSES else messages_key)
            for api in (_CHAT, _RESPONSES, _MESSAGES)}
        self._other_keyer = key_fn if key_fn is not None else messages_key
        # what read_request looks up: each route's API and key function
        self._routes: dict[str, tuple[Api, Callable[[dict[str, Any]], str | None]]] = {
            path: (api, self._keyers[api.name]) for path, api in _ROUTES.items()}
        self._no_route: tuple[None, Callable[[dict[str, Any]], str | None]] = (
            None, self._other_keyer)
        self._log_path = os.fspath(log_path) if log_path is not None else None
        self._lock = threading.Lock()
        self._log: list[RequestRecord] = []
        self._record_bodies = record_bodies
        self._bodies: list[Any] = []
        self._arrivals: collections.Counter[str] = collections.Counter()
        self._seq = 0
        self._rng_seed = self.faults.seed
        self._rng = random.Random(self._rng_seed)
        self._limiters: dict[tuple[str, float], Limiter] = {}
        self._t0 = time.monotonic()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._log_file: IO[bytes] | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._closing = False
        self._batch_state_dir = batch_state_dir
        self._batches: BatchService | None = None  # made when first needed

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """Anthropic base URL (clients append ``/v1/messages``), e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeProviderServer:
        """Start the server thread; returns once listening (port 0 -> ephemeral port)."""
        if self._thread is not None:
            return self
        self._closing = False
        self._startup_error = None
        if self._batch_state_dir is not None:
            self._restore(self._batch_service().open())
        if self._log_path is not None:
            self._log_file = open(self._log_path, "ab")  # noqa: SIM115 - closed in stop()
        ready = threading.Event()
        thread = threading.Thread(target=self._run, args=(ready,), name="FakeProviderServer",
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

    def __enter__(self) -> FakeProviderServer:
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
                limit=MAX_HEADER_BYTES, backlog=1024,
            )
        except OSError as exc:
            self._startup_error = exc
            ready.set()
            return
        self.port = server.sockets[0].getsockname()[1]
        self._t0 = time.monotonic()
        if self._batches is not None:
            self._batches.attach()
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

    def billed_by_key(self) -> collections.Counter[str]:
        """How many answers a provider would charge for, per key: online 200s and batch lines
        answered 200 together (lines answered before a restart on the same state directory
        included)."""
        with self._lock:
            return collections.Counter(
                r.key for r in self._log if r.status == 200 and r.key is not None
            )

    def batch_calls(self) -> collections.Counter[str]:
        """How many HTTP calls each batch route got, keyed ``"METHOD /v1/batches/{id}"``."""
        batches = self._batches
        # dict.copy: one step under the GIL, while the server's loop may be counting
        return collections.Counter(dict.copy(batches.calls) if batches is not None else {})

    def created_batches(self) -> list[dict[str, Any]]:
        """Every provider batch this server made (its state directory's ``created.jsonl``, so across
        restarts on one directory too), oldest first: id, kind, created_at, input_file_id,
        metadata, total, and ``custom_ids`` and ``keys``: each request's custom_id and log key."""
        batches = self._batches
        return batches.created() if batches is not None else []

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

    def _batch_service(self) -> BatchService:
        """The batch APIs, loaded on first use: a server used online only never imports them."""
        if self._batches is None:
            from batchrun.testing.batch_service import BatchService

            # through a proxy: a cycle server <-> batches would keep every stopped server (and
            # its state) alive until a full garbage collection, which then stalls what runs next
            me = weakref.proxy(self)
            self._batches = BatchService(me, self._batch_state_dir, lambda: me.anthropic_base_url)
        return self._batches

    def _restore(self, records: list[RequestRecord]) -> None:
        """Put the batch lines answered before a restart back in the log (not in the log file:
        they are there already, but for any a kill cut off between the journal and the file).

        ``seq`` goes on from the last one the log file holds too: a deleted batch's journal is gone,
        and a seq used again would hide a later line from the next restart's rewrite."""
        logged = _last_batch_seq(self._log_path) if self._log_path is not None else -1
        with self._lock:
            self._seq = max(self._seq, logged + 1, records[-1].seq + 1 if records else 0)
        if not records:
            return
        with self._lock:
            self._log[:0] = records
            self._arrivals.update(r.key for r in records if r.key is not None)
        if self._log_path is not None:
            with open(self._log_path, "ab") as f:
                for rec in records:
                    if rec.seq > logged:
                        f.write(orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE))

    # what the batch worker needs of its host (batch_work.Host)

    def next_seq(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        return seq

    def key_for(self, api: Api | None, body: dict[str, Any]) -> str | None:
        """The log key of a request body sent to ``api``."""
        try:
            return self._keyers.get(api.name if api is not None else "", self._other_keyer)(body)
        except Exception:
            return None

    def record(self, rec: RequestRecord) -> None:
        if rec.key is not None:
            with self._lock:
                self._arrivals[rec.key] += 1
        self._record(rec)

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

    async def _handle_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; returns whether the connection stays open."""
        try:
            req = await read_request(reader, writer, self._routes)
        except BadRequest as exc:
            body = _CHAT.error_body(400, f"Bad request: {exc}.", b"bad_request")
            writer.write(response_head(400, len(body), b"bad_request", False) + body)
            await writer.drain()
            return False
        if req is None or self._closing:
            return False
        if req.__class__ is StreamedRequest:  # a batch route: its handler reads the body
            assert isinstance(req, StreamedRequest)
            return await self._batch_service().serve(req, reader, writer)
        method, path, raw, keep, headers, route = req  # type: ignore[misc]

        if method == "GET" and path == "/health":
            writer.write(response_head(200, len(_HEALTH_BODY), b"health", keep) + _HEALTH_BODY)
            await writer.drain()
            return keep

        received_at = time.time()
        obj: Any = None
        if raw:
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                obj = None
        api, keyer = route if route is not None else self._no_route
        key: str | None = None
        if isinstance(obj, dict):
            try:
                key = keyer(obj)
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
        # One limiter per shape: changing the faults' shape while running starts a fresh one.
        limiter = self._limiters.get((f.rpm_shape, f.rpm_burst))
        if limiter is None:
            limiter = self._limiters[(f.rpm_shape, f.rpm_burst)] = make_limiter(f.rpm_shape, f.rpm_burst)

        shape = api if api is not None else _CHAT  # unknown paths answer in OpenAI's shape
        stream = False
        extra = b""
        prompt_tokens = 0
        err_msg: str | None = None
        outcome: str
        status: int | None
        if method != "POST" or api is None:
            outcome, status = "not_found", 404
            err_msg = f"Invalid URL ({method} {path})"
        elif not isinstance(obj, dict):
            outcome, status = "bad_request", 400
            err_msg = "We could not parse the JSON body of your request."
        else:
            stream = obj.get("stream") is True
            prompt_tokens = api.prompt_tokens(obj)
            api_key = self.api_key
            if api_key is not None and (
                    err_msg := api.auth_error(headers, api_key.encode())) is not None:
                outcome, status = "unauthorized", 401
            elif (err_msg := api.validate(obj, headers)) is not None:
                outcome, status = "bad_request", 400
            elif (refused := self.refusals.refuse(obj)) is not None:
                status, err_msg = refused
                outcome = "not_found" if status == 404 else "bad_request"
            else:
                outcome, status, retry_after = fate(
                    f, u, now_m - self._t0, limiter, now_m, api.overloaded_status, stream)
                if retry_after is not None:
                    extra = retry_after_headers(retry_after, integer=f.retry_after_integer)
        if f.rpm_limit is not None and f.ratelimit_headers:
            reset_s = limiter.reset_s(f.rpm_limit, now_m, f.rpm_window_s)
            extra += shape.ratelimit_headers(
                f.rpm_limit, limiter.remaining(f.rpm_limit, now_m, f.rpm_window_s), time.time() + reset_s,
                reset_s=reset_s if f.rpm_shape != "sliding" else None)

        def record(outcome: str, status: int | None, completion_tokens: int = 0, fault: str | None = None) -> None:
            self._record(new_record(
                seq, received_at, time.time(), method, path, key, outcome, status,
                prompt_tokens, completion_tokens, fault, shape.name, stream,
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
            abort_with_rst(writer)
            return False
        if status == 200:
            assert api is not None
            fault: str | None = None
            # the content fault is a third draw, only for structured answers
            if outcome == "ok" and api.structured(obj) and (
                    f.output_faults_on_reask or not api.is_reask(obj)):
                fault = content_fault(f, rng.random())
            ans = api.answer(obj, key, fault)
            record(outcome, 200, ans.tokens, fault)
            if stream:
                return await self._send_stream(
                    writer, api, obj, seq, prompt_tokens, ans, outcome,
                    sse_head(req_id, keep, extra, api.rid), f.stream_chunk_delay_s,
                ) and keep
            body = api.render(obj, seq, prompt_tokens, ans)
            if outcome == "bad_body":
                body = api.bad_body
            elif outcome in ("truncated", "stream_drop"):
                writer.write(response_head(200, len(body), req_id, False, extra, api.rid)
                             + body[: len(body) // 2])
                await writer.drain()
                return False
        else:
            assert status is not None
            body = shape.error_body(status, err_msg, req_id)
            record(outcome, status)
        assert status is not None
        writer.write(response_head(status, len(body), req_id, keep, extra, shape.rid) + body)
        await writer.drain()
        return keep

    async def _send_stream(
        self, writer: asyncio.StreamWriter, api: Api, body: dict[str, Any], seq: int,
        prompt_tokens: int, ans: Answer, outcome: str, head: bytes, delay: float,
    ) -> bool:
        """Send a 200 event stream as ``outcome`` says; returns whether it ended cleanly.

        One chunk per event. With ``delay``, the head and the events up to the first content
        delta go out at once, then ``delay`` is slept before each further content delta.
        """
        frames = api.frames(body, seq, prompt_tokens, ans)
        half = len(frames) // 2
        complete = True
        if outcome == "bad_body":
            frames[half] = (spoil_frame(frames[half][0]), frames[half][1])
        elif outcome == "stream_error":
            frames = frames[:half] + [(e, False) for e in api.error_frames(body, seq, half)]
        elif outcome in ("stream_drop", "truncated"):
            frames, complete = frames[:half], False
        out = [head]
        seen_delta = False
        for frame, is_delta in frames:
            if is_delta:
                if seen_delta and delay > 0:
                    writer.write(b"".join(out))
                    out.clear()
                    await writer.drain()
                    await asyncio.sleep(delay)
                seen_delta = True
            out.append(b"%x\r\n%s\r\n" % (len(frame), frame))
        if complete:
            out.append(b"0\r\n\r\n")
        writer.write(b"".join(out))
        await writer.drain()
        return complete  # a dropped stream: the caller closes the connection


def _last_batch_seq(path: str) -> int:
    """The seq of the last batch-line record in a log file (-1: none)."""
    last = -1
    try:
        with open(path, "rb") as f:
            for line in f:
                if b'"api":"batch:' in line:
                    try:
                        last = max(last, orjson.loads(line)["seq"])
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        pass  # a torn last line
    except FileNotFoundError:
        pass
    return last
