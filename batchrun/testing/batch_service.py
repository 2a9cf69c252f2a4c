"""The batch APIs of the fake server: its state (in a state directory, else a temporary one),
the task that works the batches, and the door every batch route comes in by (auth, the
faults of the HTTP calls, the API's error shape)."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.testing.anthropic import MessagesApi
from batchrun.testing.api import Api
from batchrun.testing.batch_anthropic import AnthropicBatches
from batchrun.testing.batch_http import ApiError, Call, Reply, send
from batchrun.testing.batch_openai import OpenAIBatches
from batchrun.testing.batch_store import BatchStore, read_created
from batchrun.testing.batch_work import BatchWorker, Host
from batchrun.testing.openai import ChatApi
from batchrun.testing.request_log import RequestRecord
from batchrun.testing.wire import BodyTooLarge, StreamedRequest, retry_after_headers

_OPENAI_SHAPE, _ANTHROPIC_SHAPE = ChatApi(), MessagesApi()


class BatchService:
    """Files and batches of both APIs: opened when the server starts with a state directory,
    else at the first call to a batch route (a server used online only pays nothing)."""

    def __init__(self, host: Host, state_dir: str | os.PathLike[str] | None,
                 base_url: Callable[[], str]) -> None:
        self._host = host
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._base_url = base_url
        self._worker: BatchWorker | None = None
        self._openai: OpenAIBatches | None = None
        self._anthropic: AnthropicBatches | None = None
        self._rng_seed = host.batch_faults.seed
        self._rng = random.Random(self._rng_seed)
        self._task: asyncio.Task[None] | None = None
        self._calls = 0
        self.calls: collections.Counter[str] = collections.Counter()  # "METHOD /route" -> count

    def open(self) -> list[RequestRecord]:
        """Open a state directory (once); returns the records of the lines answered before."""
        if self._worker is not None or self._state_dir is None:
            return []
        return self._open()

    def _open(self) -> list[RequestRecord]:
        root = self._state_dir
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="fakeprovider-batches-"))
            weakref.finalize(self, shutil.rmtree, root, True)
        store = BatchStore(root)
        worker = BatchWorker(self._host, store, {})
        self._openai = OpenAIBatches(worker, self._draw)
        self._anthropic = AnthropicBatches(worker, self._draw, self._base_url)
        worker.kinds.update(openai=self._openai, anthropic=self._anthropic)
        self._openai.load()
        self._worker = worker
        return worker.load()

    def created(self) -> list[dict[str, Any]]:
        """The batches made so far (:func:`~batchrun.testing.batch_store.read_created`)."""
        return read_created(self._worker.store.root) if self._worker is not None else []

    def attach(self) -> None:
        """At each start of the server's event loop: work the open batches (the server's stop
        cancels the task with every other)."""
        self._task = None
        if self._worker is not None:
            self._task = asyncio.create_task(self._worker.run())

    def _draw(self) -> float:
        seed = self._host.batch_faults.seed
        if seed != self._rng_seed:
            self._rng_seed = seed
            self._rng = random.Random(seed)
        return self._rng.random()

    async def serve(self, req: StreamedRequest, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> bool:
        """Answer one request to a batch route; returns whether the connection stays open."""
        if self._worker is None:
            self._open()
        if self._task is None:
            self.attach()
        assert self._worker is not None and self._openai is not None and self._anthropic is not None
        call = Call(req, reader, self._worker.store)
        self._calls += 1
        req_id = b"batch%d" % self._calls
        anthropic = call.parts[:3] == ["v1", "messages", "batches"]
        shape: Api = _ANTHROPIC_SHAPE if anthropic else _OPENAI_SHAPE
        self.calls[_route(call)] += 1
        keep = req.keep
        extra = b""
        try:
            self._check(call, shape, anthropic)
            if call.method == "GET" and (fault := self._poll_fault()) is not None:
                if fault == 429 and self._host.faults.retry_after_s is not None:
                    extra = retry_after_headers(self._host.faults.retry_after_s)
                raise ApiError(fault, None if fault == 429 else
                               "The server had an error while processing your request.")
            reply = await (self._anthropic if anthropic else self._openai).handle(call)
        except ApiError as exc:
            reply = Reply(exc.status, shape.error_body(exc.status, exc.message, req_id))
        except BodyTooLarge:
            reply = Reply(413, shape.error_body(413, None, req_id))
            keep = False  # the rest of the body is not read
        if keep:
            await call.drain()
        await send(writer, reply, req_id, keep, shape.rid, extra)
        return keep

    def _check(self, call: Call, shape: Api, anthropic: bool) -> None:
        api_key = self._host.api_key
        if api_key is not None and (
                err := shape.auth_error(call.req.headers, api_key.encode())) is not None:
            raise ApiError(401, err)
        if anthropic and call.req.headers.anthropic_version is None:
            raise ApiError(400, "anthropic-version: header is required")

    def _poll_fault(self) -> int | None:
        bf = self._host.batch_faults
        if not (bf.p_poll_429 or bf.p_poll_500):
            return None
        u = self._draw()
        if u < bf.p_poll_429:
            return 429
        if u < bf.p_poll_429 + bf.p_poll_500:
            return 500
        return None


def _route(call: Call) -> str:
    """``METHOD /path`` with ids as ``{id}``: what the call counter is keyed by."""
    parts = ["{id}" if i >= 2 and p not in ("batches", "content", "cancel", "results") else p
             for i, p in enumerate(call.parts)]
    return f"{call.method} /{'/'.join(parts)}"
