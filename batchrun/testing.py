"""Fault-injecting local LLM API server for tests, benchmarks and ``batchrun demo``.

It speaks three APIs, each plain (one JSON body) and streamed (``"stream": true``: server-sent
events), with their real shapes, error bodies and headers:

=========================  =====================================  ============================
API                        routes (POST)                          request id / rate headers
=========================  =====================================  ============================
OpenAI Chat Completions    ``/v1/chat/completions``, ``/chat/…``  ``x-request-id``,
                                                                  ``x-ratelimit-*-requests``
OpenAI Responses           ``/v1/responses``, ``/responses``      same as Chat
Anthropic Messages         ``/v1/messages``, ``/messages``        ``request-id``,
                                                                  ``anthropic-ratelimit-requests-*``
=========================  =====================================  ============================

Answers are deterministic: ``"echo: " + the last user message``, or, for a structured request
(Chat ``response_format`` json_schema, Responses ``text.format`` json_schema, Messages
``tool_choice`` forcing a tool — answered with a ``tool_use`` block — or
``output_config.format`` json_schema), an instance of the schema derived from the request's key.
Token counts are ``len(text) // 4 + 1`` per message (system / instructions included) and per
answer, cut to the request's max tokens (``finish_reason: "length"``, ``status: "incomplete"``,
``stop_reason: "max_tokens"``).

Streams are ``content-type: text/event-stream; charset=utf-8`` with ``transfer-encoding:
chunked``, one chunk per event; the answer is sent in 16-character deltas. Framing:

- Chat: ``data: {chat.completion.chunk}\\n\\n`` — role chunk, content chunks, a chunk with
  ``finish_reason``, a usage chunk with ``"choices": []`` only when
  ``stream_options.include_usage`` is true (then every other chunk has ``"usage": null``), then
  ``data: [DONE]\\n\\n``.
- Responses: ``event: NAME\\ndata: {"type": NAME, "sequence_number": N, ...}\\n\\n`` —
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``… (or
  ``response.refusal.delta``…), ``response.output_text.done`` (``response.refusal.done``),
  ``response.content_part.done``, ``response.output_item.done``, then ``response.completed``
  (or ``response.incomplete``) carrying the whole response with its usage.
- Messages: ``event: NAME\\ndata: {"type": NAME, ...}\\n\\n`` — ``message_start``,
  ``content_block_start``, ``ping``, ``content_block_delta`` (``text_delta`` or
  ``input_json_delta``)…, ``content_block_stop``, ``message_delta`` (stop reason, cumulative
  ``output_tokens``), ``message_stop``.

Faults (:class:`Faults`) are drawn per request from a seeded generator and each API answers them
in its own shape. The log (:class:`RequestRecord`) holds the usage each answer reported, so a
client's totals can be compared with the server's exactly.

The HTTP/1.1 (persistent connections, pipelining, Content-Length and chunked request bodies) is
written directly on ``asyncio`` streams, so that connection resets, hangs, truncated bodies and
dropped streams are fully under our control and the per-request cost stays small.

Run it in its own process with::

    python -m batchrun.testing serve --port 8000 --latency 0.2 --rpm 3000 --log requests.jsonl

OpenAI clients use ``http://127.0.0.1:8000/v1`` as base URL, Anthropic clients
``http://127.0.0.1:8000``; ``--api-key KEY`` makes the server check ``Authorization: Bearer KEY``
(OpenAI routes) or ``x-api-key: KEY`` (Messages, which also takes the bearer form).
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
from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import IO, Any, NamedTuple

import orjson

__all__ = ["FakeLLMServer", "FakeOpenAIServer", "Faults", "RequestRecord", "default_key_fn", "main"]

_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024
_HEALTH_BODY = b'{"ok":true}'
_RPM_WINDOW_S = 60.0
_PIECE_CHARS = 16  # characters per streamed content delta (about 4 tokens)
_REFUSAL = "I can't help with that request."
_NOT_JSON = "I am not able to answer in JSON, but the ticket looks urgent."
_STREAM_ERROR = "The server had an error while processing your request."

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

# status -> (error type, message) for Anthropic-shaped error bodies (the API's errors page);
# other 4xx are invalid_request_error, other 5xx api_error.
_ANTHROPIC_ERRORS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "Invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    402: ("billing_error", "Your credit balance is too low to access the Anthropic API."),
    403: ("permission_error", "Your API key does not have permission to use the specified resource."),
    404: ("not_found_error", "Not found."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "Number of requests has exceeded your rate limit."),
    500: ("api_error", "Internal server error"),
    504: ("timeout_error", "Request timed out."),
    529: ("overloaded_error", "Overloaded"),
}

_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}
# Request headers the server reads (lower case), each mapped to itself.
_HEADERS_READ: dict[bytes, bytes] = {h: h for h in (
    b"content-length", b"transfer-encoding", b"connection", b"expect", b"authorization",
    b"x-api-key", b"anthropic-version")}
_REASONS[529] = b"Site Overloaded"


@dataclass
class Faults:
    """What the server does wrong; probabilities are per request, drawn in this order.

    The random faults share one uniform draw ``u`` per request and occupy consecutive
    intervals (``u < p_429`` -> 429, ``u < p_429 + p_500`` -> 500, ...), so each ``p_*`` is
    the marginal probability of that fault; their sum should not exceed 1. The chain is
    p_429, p_500, p_503, p_reset, p_hang, p_bad_body, p_truncated, p_overloaded, p_stream_drop,
    p_stream_error: new faults join at the end, so a seed keeps its fates. Deterministic
    faults are applied first: ``status_override``, then the 429 burst window, then
    ``rpm_limit``. Retry-After is whole seconds rounded up, plus ``retry-after-ms`` when
    the wait is fractional; burst 429s advertise the rest of the burst and rpm 429s the
    time until a slot frees. Every fault is answered in the shape of the API asked.
    """

    latency_s: float = 0.0  # added before answering (asyncio.sleep); a stream's first event too
    latency_jitter_s: float = 0.0  # uniform extra 0..jitter
    p_429: float = 0.0  # 429 with the API's rate-limit error body
    retry_after_s: float | None = 1.0  # Retry-After on random 429s; None -> no header
    p_500: float = 0.0
    p_503: float = 0.0
    p_reset: float = 0.0  # read the request, then drop the connection with a TCP RST
    p_hang: float = 0.0  # read the request, never answer
    p_bad_body: float = 0.0  # 200 whose (correctly framed) body is not valid JSON; streamed: one event's JSON cut
    p_truncated: float = 0.0  # 200 whose body stops halfway, then the connection closes
    # Faults in the *content* of a 200 answer to a structured request (Chat/Responses
    # json_schema, Messages forced tool or json_schema output), drawn from a third number:
    p_fenced: float = 0.0  # valid JSON inside a ```json code fence (Messages tool: a text block)
    p_prose: float = 0.0  # valid JSON wrapped in a sentence before and after (Messages tool: a text block)
    p_truncated_json: float = 0.0  # JSON cut in half, finish_reason "length" / incomplete / max_tokens
    p_schema_violation: float = 0.0  # JSON that breaks the schema (a required key missing)
    p_not_json: float = 0.0  # plain prose, no JSON at all (Messages tool: a text block, no tool call)
    p_refusal: float = 0.0  # Chat: message.refusal; Responses: a refusal part; Messages: stop_reason "refusal"
    output_faults_on_reask: bool = True  # False: a re-ask (a request with an assistant turn) is always answered well
    status_override: int | None = None  # answer every request with this status
    burst_429_period_s: float = 0.0  # > 0: each period (from server start) begins with...
    burst_429_duration_s: float = 0.0  # ...this many seconds of 429s for every request
    rpm_limit: int | None = None  # accepted requests per sliding 60 s window
    # Enforce rpm_limit over a shorter sliding window, scaled (1.0: at most rpm_limit/60 per second),
    # as providers may do.
    rpm_window_s: float = 60.0
    seed: int | None = None  # random.Random(seed); changing it while running reseeds
    p_overloaded: float = 0.0  # Messages: 529 overloaded_error; OpenAI routes: 503
    # Streamed: headers and about half the events, then the connection closes with no terminal
    # event and no end of the chunked body. Not streamed: like p_truncated.
    p_stream_drop: float = 0.0
    # Streamed: about half the events, then an in-band error event (Messages ``error``
    # overloaded_error, Responses ``error`` + ``response.failed``, Chat ``data: {"error": ...}``),
    # and the stream ends cleanly. Not streamed: a 500.
    p_stream_error: float = 0.0
    stream_chunk_delay_s: float = 0.0  # slept between a stream's content deltas


@dataclass(frozen=True)
class RequestRecord:
    """One request as seen by the server, appended just before its answer goes out (a hang:
    when the client leaves).

    ``prompt_tokens`` / ``completion_tokens`` are the usage the answer reported (for a stream,
    what its usage event reports, even when a fault cut the stream before it).
    """

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
    api: str = "chat"  # "chat" | "responses" | "messages": whose shape answered
    stream: bool = False  # the request asked for a stream


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))


def _new_record(*values: Any) -> RequestRecord:
    """``RequestRecord(*values)`` (every field given), built without the frozen dataclass's
    per-field ``object.__setattr__``: that was a tenth of the plain path's CPU per request."""
    rec: RequestRecord = object.__new__(RequestRecord)
    rec.__dict__.update(zip(_RECORD_FIELDS, values))
    return rec


def default_key_fn(body: dict[str, Any]) -> str | None:
    """Text of the first user message, else None.

    Chat and Messages: the first ``messages`` entry with role "user" (a string, or its text
    blocks joined); Responses: ``input`` when a string, else the first user message of the
    ``input`` list. The first, so a re-ask (which appends an assistant turn and a follow-up)
    counts against the same record.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        return _first_user_text(messages)
    inp = body.get("input")
    if isinstance(inp, str):
        return inp
    if isinstance(inp, list):
        return _first_user_text(inp)
    return None


def _messages_key(body: dict[str, Any]) -> str | None:
    """:func:`default_key_fn` for Chat and Messages: the first user message's text."""
    messages = body.get("messages")
    return _first_user_text(messages) if isinstance(messages, list) else None


def _first_user_text(messages: list[Any]) -> str | None:
    for msg in messages:
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = [
                    p["text"] for p in content
                    if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                    and isinstance(p.get("text"), str)
                ]
                return "".join(texts) if texts else None
            return None
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


def _last_user_text(messages: object) -> str:
    if isinstance(messages, list):
        for msg in reversed(messages):
            if isinstance(msg, dict) and msg.get("role") == "user":
                return _content_text(msg.get("content"))
    return ""


def _has_assistant_turn(messages: object) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages
    )


def _messages_tokens(messages: object) -> int:
    if not isinstance(messages, list):
        return 0
    return sum(
        len(_content_text(m.get("content"))) // 4 + 1 for m in messages if isinstance(m, dict)
    )


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    return model if isinstance(model, str) else "fake-model"


def _error_body(status: int, message: str | None = None) -> bytes:
    """OpenAI-shaped error body for ``status``."""
    default_msg, etype, code = _ERRORS.get(
        status,
        (f"Error {status}.", "server_error" if status >= 500 else "invalid_request_error", None),
    )
    return orjson.dumps(
        {"error": {"message": message or default_msg, "type": etype, "param": None, "code": code}}
    )


def _anthropic_error(status: int, message: str | None = None) -> dict[str, str]:
    """The ``error`` object of an Anthropic-shaped error for ``status``."""
    etype, default_msg = _ANTHROPIC_ERRORS.get(
        status,
        ("api_error" if status >= 500 else "invalid_request_error", f"Error {status}."),
    )
    return {"type": etype, "message": message or default_msg}


def _retry_after_headers(seconds: float) -> bytes:
    """``Retry-After`` (whole seconds, rounded up) plus ``retry-after-ms`` when fractional."""
    s = max(0.0, seconds)
    whole = math.ceil(s)
    if whole == s:
        return b"retry-after: %d\r\n" % whole
    return b"retry-after: %d\r\nretry-after-ms: %d\r\n" % (whole, math.ceil(s * 1000.0))


def _head(status: int, length: int, req_id: bytes, keep: bool, extra: bytes = b"",
          rid: bytes = b"x-request-id") -> bytes:
    """Status line and headers of a JSON response."""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"%s: req_%s\r\n%sconnection: %s\r\n\r\n"
        % (status, _REASONS.get(status, b"Unknown"), length, rid, req_id, extra,
           b"keep-alive" if keep else b"close")
    )


def _sse_head(req_id: bytes, keep: bool, extra: bytes, rid: bytes) -> bytes:
    """Status line and headers of a 200 event stream (chunked)."""
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n"
        b"%s: req_%s\r\n%sconnection: %s\r\n\r\n"
        % (rid, req_id, extra, b"keep-alive" if keep else b"close")
    )


def _sse(event: str | None, data: Any) -> bytes:
    """One server-sent event: ``event: NAME`` (when named) and one ``data:`` line."""
    if event is None:
        return b"data: " + orjson.dumps(data) + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _pieces(text: str) -> list[str]:
    """``text`` split into the deltas a stream sends."""
    return [text[i:i + _PIECE_CHARS] for i in range(0, len(text), _PIECE_CHARS)]


def _spoil_frame(frame: bytes) -> bytes:
    """An SSE event whose JSON stops halfway (cut on a UTF-8 character boundary)."""
    cut = len(frame) // 2
    while cut > 0 and 0x80 <= frame[cut] < 0xC0:
        cut -= 1
    return frame[:cut].rstrip(b"\n") + b"\n\n"


class _Headers(NamedTuple):
    """The request headers the APIs look at (raw values, None when absent)."""

    authorization: bytes | None
    x_api_key: bytes | None
    anthropic_version: bytes | None


@dataclass(slots=True)
class _Answer:
    """What the fake model says, before an API gives it its shape."""

    text: str  # the answer text; for a tool call, the JSON text of its input; "" for a refusal
    tokens: int  # completion tokens reported
    truncated: bool  # stopped by the max tokens limit (or a truncated_json fault)
    refusal: str | None = None  # the model refused: this explanation instead of an answer
    tool: str | None = None  # Messages: the tool called with ``text`` as its input
    stop_sequence: str | None = None  # Messages: the stop sequence that ended ``text``


def _cut(text: str, max_tokens: object, truncated: bool = False) -> _Answer:
    """``text`` as an answer, cut to ``max_tokens`` (4 characters a token) when it is over."""
    tokens = len(text) // 4 + 1
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens < tokens:
        limit = max(max_tokens, 0)
        return _Answer(text[: limit * 4], limit, True)
    return _Answer(text, tokens, truncated)


def _structured_answer(
    schema: dict[str, Any], key: str | None, fault: str | None, max_tokens: object
) -> _Answer:
    """An instance of ``schema`` derived from ``key`` as JSON text, spoiled as ``fault`` says."""
    if fault == "refusal":
        return _Answer("", len(_REFUSAL) // 4 + 1, False, refusal=_REFUSAL)
    instance = _instance(schema, key or "")
    if fault == "schema_violation":
        instance = _violate(schema, instance)
    text = orjson.dumps(instance).decode()
    truncated = False
    if fault == "fenced":
        text = f"```json\n{text}\n```"
    elif fault == "prose":
        text = f"Sure, here is the result:\n{text}\nLet me know if you need anything else."
    elif fault == "truncated_json":
        text, truncated = text[: max(1, len(text) // 2)], True
    elif fault == "not_json":
        text = _NOT_JSON
    return _cut(text, max_tokens, truncated)


_Frames = list[tuple[bytes, bool]]  # SSE events, and whether each one is a content delta


class _Api:
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

    def validate(self, body: dict[str, Any], headers: _Headers) -> str | None:
        """Why the request is invalid (answered 400), or None."""
        return None

    def auth_error(self, headers: _Headers, api_key: bytes) -> str | None:
        """Why the credentials are refused (answered 401), or None."""
        raise NotImplementedError

    def error_body(self, status: int, message: str | None, req_id: bytes) -> bytes:
        raise NotImplementedError

    def ratelimit_headers(self, limit: int, remaining: int, reset_at: float) -> bytes:
        raise NotImplementedError

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> _Answer:
        raise NotImplementedError

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> bytes:
        """The JSON body of a 200."""
        raise NotImplementedError

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> _Frames:
        """The events of a 200 stream, terminal event included."""
        raise NotImplementedError

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        """The in-band error that ends a stream after ``sent`` events (p_stream_error)."""
        raise NotImplementedError


def _json_schema_format(fmt: Any) -> dict[str, Any] | None:
    """The schema of a ``{"type": "json_schema", "schema": {...}}`` output format (Responses, Messages)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if isinstance(schema, dict):
            return schema
    return None


class _OpenAIApi(_Api):
    """What the two OpenAI APIs share: Bearer auth, error bodies, rate-limit headers."""

    def auth_error(self, headers: _Headers, api_key: bytes) -> str | None:
        auth = headers.authorization
        if auth is None or not auth.startswith(b"Bearer "):
            return ("You didn't provide an API key. You need to provide your API key in an "
                    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        if auth[7:].strip() != api_key:
            return "Incorrect API key provided."  # never echo the key, not even masked
        return None

    def error_body(self, status: int, message: str | None, req_id: bytes) -> bytes:
        return _error_body(status, message)

    def ratelimit_headers(self, limit: int, remaining: int, reset_at: float) -> bytes:
        return b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n" % (
            limit, remaining)


class _ChatApi(_OpenAIApi):
    """OpenAI Chat Completions."""

    name = "chat"
    bad_body = b'{"id": "chatcmpl-broken", "choices": ['

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        return _messages_tokens(body.get("messages"))

    def structured(self, body: dict[str, Any]) -> bool:
        return _json_schema(body) is not None

    def is_reask(self, body: dict[str, Any]) -> bool:
        return _has_assistant_turn(body.get("messages"))

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> _Answer:
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        schema = _json_schema(body)
        if schema is None:
            return _cut("echo: " + _last_user_text(body.get("messages")), max_tokens)
        return _structured_answer(schema, key, fault, max_tokens)

    @staticmethod
    def _usage(prompt_tokens: int, ans: _Answer) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": ans.tokens,
            "total_tokens": prompt_tokens + ans.tokens,
        }

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> bytes:
        message: dict[str, Any]
        if ans.refusal is not None:
            message = {"role": "assistant", "content": None, "refusal": ans.refusal}
        else:
            message = {"role": "assistant", "content": ans.text}
        return orjson.dumps({
            "id": f"chatcmpl-{seq}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": _model(body),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "length" if ans.truncated else "stop"}],
            "usage": self._usage(prompt_tokens, ans),
        })

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> _Frames:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        head = {"id": f"chatcmpl-{seq}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": _model(body)}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data: dict[str, Any] = {
                **head,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if include_usage:  # "all other chunks will also include a usage field, but null"
                data["usage"] = None
            return _sse(None, data)

        if ans.refusal is not None:
            out = [(chunk({"role": "assistant", "content": None, "refusal": ""}), False)]
            out += [(chunk({"refusal": p}), True) for p in _pieces(ans.refusal)]
        else:
            out = [(chunk({"role": "assistant", "content": ""}), False)]
            out += [(chunk({"content": p}), True) for p in _pieces(ans.text)]
        out.append((chunk({}, "length" if ans.truncated else "stop"), False))
        if include_usage:
            out.append((_sse(None, {**head, "choices": [],
                                    "usage": self._usage(prompt_tokens, ans)}), False))
        out.append((b"data: [DONE]\n\n", False))
        return out

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        return [b"data: " + _error_body(500, _STREAM_ERROR) + b"\n\n"]


class _ResponsesApi(_OpenAIApi):
    """OpenAI Responses."""

    name = "responses"
    bad_body = b'{"id": "resp_broken", "object": "response", "output": ['

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        tokens = 0
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            tokens += len(instructions) // 4 + 1
        inp = body.get("input")
        if isinstance(inp, str):
            tokens += len(inp) // 4 + 1
        else:
            tokens += _messages_tokens(inp)
        return tokens

    @staticmethod
    def _schema(body: dict[str, Any]) -> dict[str, Any] | None:
        text = body.get("text")
        return _json_schema_format(text.get("format") if isinstance(text, dict) else None)

    def structured(self, body: dict[str, Any]) -> bool:
        return self._schema(body) is not None

    def is_reask(self, body: dict[str, Any]) -> bool:
        return _has_assistant_turn(body.get("input"))

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> _Answer:
        max_tokens = body.get("max_output_tokens")
        schema = self._schema(body)
        if schema is not None:
            return _structured_answer(schema, key, fault, max_tokens)
        inp = body.get("input")
        return _cut("echo: " + (inp if isinstance(inp, str) else _last_user_text(inp)), max_tokens)

    @staticmethod
    def _part(ans: _Answer) -> dict[str, Any]:
        if ans.refusal is not None:
            return {"type": "refusal", "refusal": ans.refusal}
        return {"type": "output_text", "annotations": [], "text": ans.text}

    def _item(self, seq: int, ans: _Answer) -> dict[str, Any]:
        return {"id": f"msg_{seq}", "type": "message",
                "status": "incomplete" if ans.truncated else "completed",
                "content": [self._part(ans)], "role": "assistant"}

    @staticmethod
    def _response(
        body: dict[str, Any], seq: int, created: int, status: str, output: list[Any],
        usage: dict[str, Any] | None, incomplete: dict[str, str] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        store = body.get("store")
        return {
            "id": f"resp_{seq}",
            "object": "response",
            "created_at": created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": _model(body),
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": store if isinstance(store, bool) else True,
            "temperature": 1.0,
            "text": {"format": fmt if isinstance(fmt, dict) else {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": {},
        }

    @staticmethod
    def _usage(prompt_tokens: int, ans: _Answer) -> dict[str, Any]:
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": ans.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + ans.tokens,
        }

    def _final(self, body: dict[str, Any], seq: int, created: int, prompt_tokens: int,
               ans: _Answer) -> dict[str, Any]:
        if ans.truncated:
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            status, incomplete = "completed", None
        return self._response(body, seq, created, status, [self._item(seq, ans)],
                              self._usage(prompt_tokens, ans), incomplete)

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> bytes:
        return orjson.dumps(self._final(body, seq, int(time.time()), prompt_tokens, ans))

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> _Frames:
        created = int(time.time())
        started = self._response(body, seq, created, "in_progress", [], None)
        where = {"item_id": f"msg_{seq}", "output_index": 0, "content_index": 0}
        events: list[tuple[str, dict[str, Any], bool]] = [
            ("response.created", {"response": started}, False),
            ("response.in_progress", {"response": started}, False),
            ("response.output_item.added", {"output_index": 0, "item": {
                "id": f"msg_{seq}", "type": "message", "status": "in_progress", "content": [],
                "role": "assistant"}}, False),
        ]
        if ans.refusal is not None:
            events.append(("response.content_part.added",
                           {**where, "part": {"type": "refusal", "refusal": ""}}, False))
            events += [("response.refusal.delta", {**where, "delta": p}, True)
                       for p in _pieces(ans.refusal)]
            events.append(("response.refusal.done", {**where, "refusal": ans.refusal}, False))
        else:
            events.append(("response.content_part.added", {**where, "part": {
                "type": "output_text", "annotations": [], "text": ""}}, False))
            events += [("response.output_text.delta", {**where, "delta": p, "logprobs": []}, True)
                       for p in _pieces(ans.text)]
            events.append(("response.output_text.done",
                           {**where, "text": ans.text, "logprobs": []}, False))
        events.append(("response.content_part.done", {**where, "part": self._part(ans)}, False))
        events.append(("response.output_item.done",
                       {"output_index": 0, "item": self._item(seq, ans)}, False))
        final = self._final(body, seq, created, prompt_tokens, ans)
        events.append(("response.incomplete" if ans.truncated else "response.completed",
                       {"response": final}, False))
        return [(_sse(name, {"type": name, "sequence_number": n, **data}), delta)
                for n, (name, data, delta) in enumerate(events)]

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        # The reference documents code/message/param at the top level of the error event; the
        # live API nests them under "error" (what the official SDKs raise on). Send both.
        error = {"type": "server_error", "code": "server_error", "message": _STREAM_ERROR,
                 "param": None}
        failed = self._response(body, seq, int(time.time()), "failed", [], None,
                                error={"code": "server_error", "message": _STREAM_ERROR})
        return [
            _sse("error", {"type": "error", "sequence_number": sent, "code": "server_error",
                           "message": _STREAM_ERROR, "param": None, "error": error}),
            _sse("response.failed", {"type": "response.failed", "sequence_number": sent + 1,
                                     "response": failed}),
        ]


class _MessagesApi(_Api):
    """Anthropic Messages."""

    name = "messages"
    rid = b"request-id"
    overloaded_status = 529
    bad_body = b'{"id": "msg_broken", "type": "message", "content": ['

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        tokens = _messages_tokens(body.get("messages"))
        system = body.get("system")
        if system is not None:
            tokens += len(_content_text(system)) // 4 + 1
        return tokens

    @staticmethod
    def _tool(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """(name, input_schema) of the tool ``tool_choice`` forces, if any."""
        choice = body.get("tool_choice")
        tools = body.get("tools")
        if not isinstance(choice, dict) or not isinstance(tools, list):
            return None
        named = [t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)]
        if choice.get("type") == "tool":
            named = [t for t in named if t["name"] == choice.get("name")]
        elif choice.get("type") != "any" or len(named) != 1:
            return None
        if not named or not isinstance(named[0].get("input_schema"), dict):
            return None
        return named[0]["name"], named[0]["input_schema"]

    @staticmethod
    def _output_schema(body: dict[str, Any]) -> dict[str, Any] | None:
        """Schema of JSON outputs: ``output_config.format`` (or the older ``output_format``)."""
        config = body.get("output_config")
        return _json_schema_format(config.get("format") if isinstance(config, dict) else body.get("output_format"))

    def structured(self, body: dict[str, Any]) -> bool:
        return self._tool(body) is not None or self._output_schema(body) is not None

    def is_reask(self, body: dict[str, Any]) -> bool:
        return _has_assistant_turn(body.get("messages"))

    def validate(self, body: dict[str, Any], headers: _Headers) -> str | None:
        if headers.anthropic_version is None:
            return "anthropic-version: header is required"
        if "max_tokens" not in body:
            return "max_tokens: Field required"
        max_tokens = body["max_tokens"]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            return "max_tokens: Input should be a valid integer"
        if not isinstance(body.get("messages"), list):
            return "messages: Field required"
        return None

    def auth_error(self, headers: _Headers, api_key: bytes) -> str | None:
        # The key goes in x-api-key, or as a bearer token (what recent SDKs send).
        if headers.x_api_key is not None:
            return None if headers.x_api_key == api_key else "invalid x-api-key"
        auth = headers.authorization
        if auth is not None and auth.startswith(b"Bearer "):
            return None if auth[7:].strip() == api_key else "Invalid bearer token"
        return "x-api-key header is required"  # never echo the key

    def error_body(self, status: int, message: str | None, req_id: bytes) -> bytes:
        return orjson.dumps({"type": "error", "error": _anthropic_error(status, message),
                             "request_id": "req_" + req_id.decode()})

    def ratelimit_headers(self, limit: int, remaining: int, reset_at: float) -> bytes:
        reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(reset_at)))
        return (b"anthropic-ratelimit-requests-limit: %d\r\n"
                b"anthropic-ratelimit-requests-remaining: %d\r\n"
                b"anthropic-ratelimit-requests-reset: %s\r\n" % (limit, remaining, reset.encode()))

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> _Answer:
        max_tokens = body.get("max_tokens")
        tool = self._tool(body)
        schema = tool[1] if tool is not None else self._output_schema(body)
        if schema is not None:
            ans = _structured_answer(schema, key, fault, max_tokens)
            # a forced tool is called, unless the fault is an answer in words instead
            if tool is not None and ans.refusal is None and fault not in ("fenced", "prose", "not_json"):
                ans.tool = tool[0]
            return ans
        text = "echo: " + _last_user_text(body.get("messages"))
        stop_sequence: str | None = None
        stops = body.get("stop_sequences")
        if isinstance(stops, list):
            at = len(text)
            for stop in stops:
                if isinstance(stop, str) and stop and 0 <= (i := text.find(stop)) < at:
                    at, stop_sequence = i, stop
            text = text[:at]
        ans = _cut(text, max_tokens)
        if not ans.truncated:
            ans.stop_sequence = stop_sequence
        return ans

    @staticmethod
    def _stop_reason(ans: _Answer) -> str:
        if ans.refusal is not None:
            return "refusal"
        if ans.truncated:
            return "max_tokens"
        if ans.tool is not None:
            return "tool_use"
        return "stop_sequence" if ans.stop_sequence is not None else "end_turn"

    @staticmethod
    def _stop_details(ans: _Answer) -> dict[str, Any]:
        return {"type": "refusal", "category": None, "explanation": ans.refusal}

    def _message(self, body: dict[str, Any], seq: int, content: list[Any], stop_reason: str | None,
                 stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {
            "id": f"msg_{seq}",
            "type": "message",
            "role": "assistant",
            "model": _model(body),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": input_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": output_tokens,
            },
        }

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> bytes:
        content: list[Any]
        if ans.refusal is not None:
            content = []
        elif ans.tool is not None:
            # a tool call cut by max_tokens has no complete input to parse
            tool_input = {} if ans.truncated else orjson.loads(ans.text)
            content = [{"type": "tool_use", "id": f"toolu_{seq}", "name": ans.tool,
                        "input": tool_input}]
        else:
            content = [{"type": "text", "text": ans.text}]
        message = self._message(body, seq, content, self._stop_reason(ans), ans.stop_sequence,
                                prompt_tokens, ans.tokens)
        if ans.refusal is not None:
            message["stop_details"] = self._stop_details(ans)
        return orjson.dumps(message)

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: _Answer) -> _Frames:
        start = self._message(body, seq, [], None, None, prompt_tokens, 1)
        out: _Frames = [(_sse("message_start", {"type": "message_start", "message": start}), False)]
        if ans.refusal is None:
            if ans.tool is not None:
                block: dict[str, Any] = {"type": "tool_use", "id": f"toolu_{seq}", "name": ans.tool,
                                         "input": {}}
                kind, field = "input_json_delta", "partial_json"
            else:
                block = {"type": "text", "text": ""}
                kind, field = "text_delta", "text"
            out.append((_sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                     "content_block": block}), False))
            out.append((_sse("ping", {"type": "ping"}), False))
            out += [(_sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": kind, field: p}}), True)
                    for p in _pieces(ans.text)]
            out.append((_sse("content_block_stop", {"type": "content_block_stop", "index": 0}), False))
        else:
            out.append((_sse("ping", {"type": "ping"}), False))
        delta: dict[str, Any] = {"stop_reason": self._stop_reason(ans),
                                 "stop_sequence": ans.stop_sequence}
        if ans.refusal is not None:
            delta["stop_details"] = self._stop_details(ans)
        out.append((_sse("message_delta", {"type": "message_delta", "delta": delta,
                                           "usage": {"output_tokens": ans.tokens}}), False))
        out.append((_sse("message_stop", {"type": "message_stop"}), False))
        return out

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        return [_sse("error", {"type": "error", "error": _anthropic_error(529)})]


_CHAT, _RESPONSES, _MESSAGES = _ChatApi(), _ResponsesApi(), _MessagesApi()
_ROUTES: dict[str, _Api] = {
    "/v1/chat/completions": _CHAT, "/chat/completions": _CHAT,
    "/v1/responses": _RESPONSES, "/responses": _RESPONSES,
    "/v1/messages": _MESSAGES, "/messages": _MESSAGES,
}


class _BadRequest(Exception):
    """Malformed HTTP framing; answered with a 400 and the connection is closed."""


class FakeOpenAIServer:
    """Fault-injecting Chat Completions, Responses and Messages server on 127.0.0.1, running in
    its own thread and event loop."""

    def __init__(
        self,
        faults: Faults | None = None,
        *,
        port: int = 0,
        key_fn: Callable[[dict[str, Any]], str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        record_bodies: bool = False,
        api_key: str | None = None,
    ) -> None:
        self.faults: Faults = faults if faults is not None else Faults()
        self.port: int = port
        self.api_key: str | None = api_key  # required credential when set; may change while running
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

    @property
    def anthropic_base_url(self) -> str:
        """Anthropic base URL (clients append ``/v1/messages``), e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

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
    ) -> tuple[str, str, bytes, bool, _Headers] | None:
        """Read one request: (method, path, body, keep_alive, headers), or None at EOF."""
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
        authorization: bytes | None = None
        x_api_key: bytes | None = None
        anthropic_version: bytes | None = None
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise _BadRequest("malformed header")
            which = _HEADERS_READ.get(name.lower())
            if which is None:  # one lookup for the many headers nobody reads
                continue
            if which == b"content-length":
                try:
                    length = int(value)
                except ValueError as exc:
                    raise _BadRequest("bad content-length") from exc
                if length < 0 or length > _MAX_BODY_BYTES:
                    raise _BadRequest("bad content-length")
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
        # tuple.__new__: a NamedTuple's own __new__ costs a Python call per request
        headers = tuple.__new__(_Headers, (authorization, x_api_key, anthropic_version))
        return method_b.decode("latin-1"), path, body, keep, headers

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
        method, path, raw, keep, headers = req

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
        api = _ROUTES.get(path)
        key: str | None = None
        if isinstance(obj, dict):
            try:
                if self._key_fn is default_key_fn:
                    # Only the Responses route keys on "input": an embeddings-like body sent to
                    # an unknown path is not a Responses request.
                    key = default_key_fn(obj) if api is _RESPONSES else _messages_key(obj)
                else:
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
            else:
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
                    elif u < (acc := acc + f.p_truncated):
                        outcome, status = "truncated", 200
                    elif u < (acc := acc + f.p_overloaded):
                        outcome, status = "overloaded", api.overloaded_status
                    elif u < (acc := acc + f.p_stream_drop):
                        outcome, status = "stream_drop", 200
                    elif u < acc + f.p_stream_error:
                        outcome, status = "stream_error", 200 if stream else 500
                    else:
                        outcome, status = "ok", 200
        if f.rpm_limit is not None:
            extra += shape.ratelimit_headers(
                f.rpm_limit, self._rpm_remaining(f.rpm_limit, now_m, f.rpm_window_s),
                self._rpm_reset_at(now_m, f.rpm_window_s))

        def record(outcome: str, status: int | None, completion_tokens: int = 0, fault: str | None = None) -> None:
            self._record(_new_record(
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
            self._abort_with_rst(writer)
            return False
        if status == 200:
            assert api is not None
            fault = self._output_fault(api, obj, f, rng) if outcome == "ok" else None
            ans = api.answer(obj, key, fault)
            record(outcome, 200, ans.tokens, fault)
            if stream:
                return await self._send_stream(
                    writer, api, obj, seq, prompt_tokens, ans, outcome,
                    _sse_head(req_id, keep, extra, api.rid), f.stream_chunk_delay_s,
                ) and keep
            body = api.render(obj, seq, prompt_tokens, ans)
            if outcome == "bad_body":
                body = api.bad_body
            elif outcome in ("truncated", "stream_drop"):
                writer.write(_head(200, len(body), req_id, False, extra, api.rid)
                             + body[: len(body) // 2])
                await writer.drain()
                return False
        else:
            assert status is not None
            body = shape.error_body(status, err_msg, req_id)
            record(outcome, status)
        assert status is not None
        writer.write(_head(status, len(body), req_id, keep, extra, shape.rid) + body)
        await writer.drain()
        return keep

    async def _send_stream(
        self, writer: asyncio.StreamWriter, api: _Api, body: dict[str, Any], seq: int,
        prompt_tokens: int, ans: _Answer, outcome: str, head: bytes, delay: float,
    ) -> bool:
        """Send a 200 event stream as ``outcome`` says; returns whether it ended cleanly.

        One chunk per event. With ``delay``, the head and the events up to the first content
        delta go out at once, then ``delay`` is slept before each further content delta.
        """
        frames = api.frames(body, seq, prompt_tokens, ans)
        half = len(frames) // 2
        complete = True
        if outcome == "bad_body":
            frames[half] = (_spoil_frame(frames[half][0]), frames[half][1])
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

    def _rpm_reset_at(self, now: float, window_s: float) -> float:
        """Wall-clock time at which the window is empty again (every slot free)."""
        window = self._rpm_window
        return time.time() + (max(window[-1] + window_s - now, 0.0) if window else 0.0)

    @staticmethod
    def _output_fault(api: _Api, body: dict[str, Any], f: Faults, rng: random.Random) -> str | None:
        """The content fault of a structured answer, if any (a third draw, only for these)."""
        if not api.structured(body):
            return None
        if not f.output_faults_on_reask and api.is_reask(body):
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


FakeLLMServer = FakeOpenAIServer  # the server speaks more than OpenAI


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
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.testing",
        description="Fault-injecting fake LLM server: OpenAI Chat Completions and Responses, "
                    "Anthropic Messages; plain and streamed.")
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
    for name in ("429", "500", "503", "reset", "hang", "bad-body", "truncated", "overloaded",
                 "stream-drop", "stream-error"):
        serve.add_argument(f"--p-{name}", type=float, default=0.0,
                           help=f"probability of a {name} fault")
    serve.add_argument("--status", type=int, default=None, help="answer everything with STATUS")
    serve.add_argument("--burst-period", type=float, default=0.0, help="429 burst period, s")
    serve.add_argument("--burst-duration", type=float, default=0.0, help="429 burst length, s")
    serve.add_argument("--stream-chunk-delay", type=float, default=0.0,
                       help="seconds slept between a stream's content deltas")
    serve.add_argument("--api-key", default=None,
                       help="require this key (Authorization: Bearer / x-api-key), else 401")
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
        seed=args.seed, p_overloaded=args.p_overloaded, p_stream_drop=args.p_stream_drop,
        p_stream_error=args.p_stream_error, stream_chunk_delay_s=args.stream_chunk_delay,
    )
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    with FakeOpenAIServer(faults, port=args.port, log_path=args.log, api_key=args.api_key) as server:
        print(f"listening on {server.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
        served = len(server.log)
    print(f"stopped after {served} requests", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
