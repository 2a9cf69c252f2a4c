"""HTTP/1.1 written directly on ``asyncio`` streams: read a request, write a response head.

Persistent connections, pipelining, Content-Length and chunked request bodies; written by hand
so that connection resets, hangs, truncated bodies and dropped streams are fully under the fake
server's control and the per-request cost stays small.
"""

from __future__ import annotations

import asyncio
import math
import socket
import struct
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import NamedTuple, TypeVar

_R = TypeVar("_R")

MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024

_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}
# Request headers the server reads (lower case), each mapped to itself.
_HEADERS_READ: dict[bytes, bytes] = {h: h for h in (
    b"content-length", b"transfer-encoding", b"connection", b"expect", b"authorization",
    b"x-api-key", b"anthropic-version")}
_REASONS[529] = b"Site Overloaded"
# Routes whose handler reads the body itself, in pieces: the batch APIs' uploads and batch
# creations may be hundreds of MB (more than the in-memory _MAX_BODY_BYTES).
_STREAMED_PREFIXES = (b"/v1/files", b"/v1/batches", b"/v1/messages/batches")
_PIECE_BYTES = 1 << 20


class BadRequest(Exception):
    """Malformed HTTP framing; answered with a 400 and the connection is closed."""


class BodyTooLarge(BadRequest):
    """A body past its route's limit: the online routes answer 400, the batch routes 413, and
    the connection is closed."""


class Headers(NamedTuple):
    """The request headers the APIs look at (raw values, None when absent)."""

    authorization: bytes | None
    x_api_key: bytes | None
    anthropic_version: bytes | None


class StreamedRequest(NamedTuple):
    """A request to a batch route, head read, body not: its handler reads it with
    :func:`body_pieces` (100-continue already answered)."""

    method: str
    target: str  # path and query string
    keep: bool
    length: int
    chunked: bool
    headers: Headers
    head: list[bytes]  # the header lines, for those the hot path does not read (content-type)

    def header(self, name: bytes) -> bytes | None:
        """The value of header ``name`` (lower case), else None."""
        for line in self.head:
            key, sep, value = line.partition(b":")
            if sep and key.strip().lower() == name:
                return value.strip()
        return None


def retry_after_headers(seconds: float, *, integer: bool = False) -> bytes:
    """``Retry-After`` (whole seconds, rounded up) plus ``retry-after-ms`` when fractional
    (never with ``integer``, as servers that send only the standard header)."""
    s = max(0.0, seconds)
    whole = math.ceil(s)
    if whole == s or integer:
        return b"retry-after: %d\r\n" % whole
    return b"retry-after: %d\r\nretry-after-ms: %d\r\n" % (whole, math.ceil(s * 1000.0))


def response_head(status: int, length: int, req_id: bytes, keep: bool, extra: bytes = b"",
                  rid: bytes = b"x-request-id") -> bytes:
    """Status line and headers of a JSON response."""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"%s: req_%s\r\n%sconnection: %s\r\n\r\n"
        % (status, _REASONS.get(status, b"Unknown"), length, rid, req_id, extra,
           b"keep-alive" if keep else b"close")
    )


def sse_head(req_id: bytes, keep: bool, extra: bytes, rid: bytes) -> bytes:
    """Status line and headers of a 200 event stream (chunked)."""
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n"
        b"%s: req_%s\r\n%sconnection: %s\r\n\r\n"
        % (rid, req_id, extra, b"keep-alive" if keep else b"close")
    )


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, routes: dict[str, _R]
) -> tuple[str, str, bytes, bool, Headers, _R | None] | StreamedRequest | None:
    """Read one request: (method, path, body, keep_alive, headers, ``routes[path]`` or None), a
    :class:`StreamedRequest` for a batch route, or None at EOF.

    The route is looked up here, before the body is read: a path that is no route of
    ``routes`` may be a batch route, whose handler reads the body itself; the online routes
    pay nothing for that check."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError as exc:
        raise BadRequest("request head too large") from exc
    if head[0] in b"\r\n":  # tolerate stray CRLFs between pipelined requests
        head = head.lstrip(b"\r\n")
        if not head:
            return await read_request(reader, writer, routes)
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise BadRequest("malformed request line")
    method_b, target, version = parts
    length = 0
    chunked = False
    conn = b""
    expect = False
    authorization: bytes | None = None
    x_api_key: bytes | None = None
    anthropic_version: bytes | None = None
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise BadRequest("malformed header")
        which = _HEADERS_READ.get(name.lower())
        if which is None:  # one lookup for the many headers nobody reads
            continue
        if which == b"content-length":
            try:
                length = int(value)
            except ValueError as exc:
                raise BadRequest("bad content-length") from exc
            if length < 0:
                raise BadRequest("bad content-length")
        elif which == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif which == b"connection":
            conn = value.lower()
        elif which == b"expect":
            expect = b"100-continue" in value.lower()
        elif which == b"authorization":
            authorization = value.strip()
        elif which == b"x-api-key":
            x_api_key = value.strip()
        else:
            anthropic_version = value.strip()
    if version == b"HTTP/1.1":
        keep = b"close" not in conn
    elif version == b"HTTP/1.0":
        keep = b"keep-alive" in conn
    else:
        raise BadRequest("unsupported HTTP version")
    # tuple.__new__: a NamedTuple's own __new__ costs a Python call per request
    headers = tuple.__new__(Headers, (authorization, x_api_key, anthropic_version))
    path = target.split(b"?", 1)[0].decode("latin-1")
    route = routes.get(path)
    if route is None and target.startswith(_STREAMED_PREFIXES):
        if expect and (chunked or length):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return StreamedRequest(method_b.decode("latin-1"), target.decode("latin-1"), keep,
                               length, chunked, headers, lines[1:])
    if length > _MAX_BODY_BYTES:
        raise BodyTooLarge("bad content-length")
    if expect and (chunked or length):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    if chunked:
        body = await _read_chunked(reader)
    elif length:
        body = await reader.readexactly(length)
    else:
        body = b""
    return method_b.decode("latin-1"), path, body, keep, headers, route


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    async for piece in _chunks(reader, _MAX_BODY_BYTES):
        body += piece
    return bytes(body)


async def _chunks(reader: asyncio.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """The pieces of a chunked body (at most ``limit`` bytes in all), trailers skipped."""
    total = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise BadRequest("bad chunk size") from exc
        total += size
        if size < 0:
            raise BadRequest("bad chunk size")
        if total > limit:
            raise BodyTooLarge("body too large")
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # skip trailers
                pass
            return
        async for piece in _pieces(reader, size):
            yield piece
        if await reader.readexactly(2) != b"\r\n":
            raise BadRequest("bad chunk terminator")


async def body_pieces(reader: asyncio.StreamReader, req: StreamedRequest,
                      limit: int) -> AsyncIterator[bytes]:
    """The body of a :class:`StreamedRequest` in pieces of at most 1 MiB; raises
    :class:`BodyTooLarge` once it passes ``limit`` bytes, :class:`BadRequest` on bad framing."""
    if req.chunked:
        async for piece in _chunks(reader, limit):
            yield piece
        return
    if req.length > limit:
        raise BodyTooLarge("body too large")
    async for piece in _pieces(reader, req.length):
        yield piece


async def _pieces(reader: asyncio.StreamReader, size: int) -> AsyncIterator[bytes]:
    """The next ``size`` bytes, in pieces of at most 1 MiB."""
    while size:
        piece = await reader.read(min(size, _PIECE_BYTES))
        if not piece:
            raise asyncio.IncompleteReadError(b"", size)
        size -= len(piece)
        yield piece


def file_head(status: int, length: int, content_type: bytes, req_id: bytes, keep: bool,
              rid: bytes) -> bytes:
    """Status line and headers of a response that is a file (sent after it, in pieces)."""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
        b"%s: req_%s\r\nconnection: %s\r\n\r\n"
        % (status, _REASONS.get(status, b"Unknown"), content_type, length, rid, req_id,
           b"keep-alive" if keep else b"close")
    )


def abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Drop the connection with a TCP RST (SO_LINGER 0, then abort)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()

