"""What every API the fake server speaks provides, and the server-sent events they share."""

from __future__ import annotations

from typing import Any

import orjson

from batchrun.testing.answers import Answer
from batchrun.testing.wire import Headers

_PIECE_CHARS = 16  # characters per streamed content delta (about 4 tokens)

Frames = list[tuple[bytes, bool]]  # SSE events, and whether each one is a content delta


class Api:
    """What one API owns: its request fields, answer and error shapes, headers and events."""

    name = ""
    rid = b"x-request-id"  # header carrying the request id
    overloaded_status = 503  # what p_overloaded answers
    bad_body = b""  # a body that is not valid JSON (p_bad_body)

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        raise NotImplementedError

    def structured(self, body: dict[str, Any]) -> bool:
        """Whether the request asks for schema-shaped output (output faults apply)."""
        raise NotImplementedError

    def is_reask(self, body: dict[str, Any]) -> bool:
        raise NotImplementedError

    def validate(self, body: dict[str, Any], headers: Headers) -> str | None:
        """Why the request is invalid (answered 400), or None."""
        return None

    def auth_error(self, headers: Headers, api_key: bytes) -> str | None:
        """Why the credentials are refused (answered 401), or None."""
        raise NotImplementedError

    def error_body(self, status: int, message: str | None, req_id: bytes) -> bytes:
        raise NotImplementedError

    def ratelimit_headers(self, limit: int, remaining: int, reset_at: float, *, reset_s: float | None = None) -> bytes:
        """The rate-limit headers: ``limit`` per minute, ``remaining``, reset at ``reset_at`` (wall clock);
        ``reset_s`` (seconds from now) when the limiter's reset is worth advertising in seconds."""
        raise NotImplementedError

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> Answer:
        raise NotImplementedError

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> bytes:
        """The JSON body of a 200."""
        raise NotImplementedError

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> Frames:
        """The events of a 200 stream, terminal event included."""
        raise NotImplementedError

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        """The in-band error that ends a stream after ``sent`` events (p_stream_error)."""
        raise NotImplementedError


def sse(event: str | None, data: Any) -> bytes:
    """One server-sent event: ``event: NAME`` (when named) and one ``data:`` line."""
    if event is None:
        return b"data: " + orjson.dumps(data) + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def pieces(text: str) -> list[str]:
    """``text`` split into the deltas a stream sends."""
    return [text[i:i + _PIECE_CHARS] for i in range(0, len(text), _PIECE_CHARS)]


def spoil_frame(frame: bytes) -> bytes:
    """An SSE event whose JSON stops halfway (cut on a UTF-8 character boundary)."""
    cut = len(frame) // 2
    while cut > 0 and 0x80 <= frame[cut] < 0xC0:
        cut -= 1
    return frame[:cut].rstrip(b"\n") + b"\n\n"

