"""HTTP for the batch routes: a request whose body is read on demand (in pieces: to memory, to a
spool file, or through the multipart reader), a reply (JSON, or a file sent from disk in pieces),
and the error a route raises to answer in its API's error shape."""

from __future__ import annotations

import asyncio
import email.utils
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import orjson

from batchrun.testing.batch_store import BatchStore
from batchrun.testing.multipart import Form, FormError, boundary_of, read_form
from batchrun.testing.wire import StreamedRequest, body_pieces, file_head, response_head

_JSON_LIMIT = 1 << 20  # a JSON body of a batch route that is not a batch (create, cancel)
_PIECE_BYTES = 1 << 20


class ApiError(Exception):
    """Answer the call with ``status`` and ``message`` in its API's error shape."""

    def __init__(self, status: int, message: str | None) -> None:
        super().__init__(message or f"HTTP {status}")
        self.status = status
        self.message = message


@dataclass
class Reply:
    """What a batch route answers: a JSON body, or a file on disk."""

    status: int = 200
    body: bytes = b""
    file: Path | None = None
    content_type: bytes = b"application/json"


def json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(obj))


class Call:
    """One request to a batch route: method, path parts, query, and its body on demand."""

    def __init__(self, req: StreamedRequest, reader: asyncio.StreamReader, store: BatchStore) -> None:
        self.req = req
        self.method = req.method
        path, _, query = req.target.partition("?")
        self.parts = [p for p in path.split("/") if p]
        self.query = {k: v[-1] for k, v in parse_qs(query).items()}
        self._reader = reader
        self._store = store
        self.body_read = False

    def _pieces(self, limit: int) -> AsyncIterator[bytes]:
        self.body_read = True
        return body_pieces(self._reader, self.req, limit)

    async def json(self) -> Any:
        """The body parsed as JSON (None when empty); a 400 when it is not JSON."""
        raw = b"".join([p async for p in self._pieces(_JSON_LIMIT)])
        if not raw.strip():
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, "We could not parse the JSON body of your request.") from exc

    async def spool(self, limit: int) -> Path:
        """The body written to a spool file (its caller moves or deletes it)."""
        path, f = self._store.spool()
        try:
            with f:
                async for piece in self._pieces(limit):
                    f.write(piece)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path

    async def form(self, limit: int) -> tuple[Form, Path]:
        """The multipart form of the body; its file part written to a spool file."""
        boundary = boundary_of(self.req.header(b"content-type"))
        if boundary is None:
            raise ApiError(400, "The request must be multipart/form-data with a boundary.")
        path, f = self._store.spool()
        try:
            with f:
                form = await read_form(self._pieces(limit), boundary, f)
        except FormError as exc:
            path.unlink(missing_ok=True)
            raise ApiError(400, f"Malformed multipart form: {exc}.") from exc
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return form, path

    async def drain(self) -> None:
        """Read what is left of the body, so the connection can carry the next request."""
        if not self.body_read:
            async for _ in self._pieces(1 << 62):
                pass

    def int_param(self, name: str, default: int, low: int, high: int) -> int:
        raw = self.query.get(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise ApiError(400, f"{name}: must be an integer from {low} to {high}, got {raw!r}.")
        return value


def _date() -> bytes:
    """The ``Date`` header every real API answer carries (clients read the server's clock from it)."""
    return b"date: %s\r\n" % email.utils.formatdate(usegmt=True).encode()


async def send(writer: asyncio.StreamWriter, reply: Reply, req_id: bytes, keep: bool,
               rid: bytes, extra: bytes = b"") -> None:
    """Write ``reply``; a file goes out in pieces, read from disk as it is sent."""
    if reply.file is None:
        writer.write(response_head(reply.status, len(reply.body), req_id, keep, extra + _date(), rid)
                     + reply.body)
        await writer.drain()
        return
    with open(reply.file, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        writer.write(file_head(reply.status, size, reply.content_type, req_id, keep, rid))
        while piece := f.read(_PIECE_BYTES):
            writer.write(piece)
            await writer.drain()
    await writer.drain()
