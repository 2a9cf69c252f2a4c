"""OpenAI Chat Completions and Responses, as the fake server speaks them.

Streams (one chunk per event, the answer in 16-character deltas):

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
"""

from __future__ import annotations

import math

import time
from typing import Any

import orjson

from batchrun.testing.answers import (
    Answer,
    cut,
    has_assistant_turn,
    json_schema_format,
    last_user_text,
    messages_tokens,
    model_name,
    structured_answer,
)
from batchrun.testing.api import Api, Frames, pieces, sse
from batchrun.testing.wire import Headers

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


def _error_body(status: int, message: str | None = None) -> bytes:
    """OpenAI-shaped error body for ``status``."""
    default_msg, etype, code = _ERRORS.get(
        status,
        (f"Error {status}.", "server_error" if status >= 500 else "invalid_request_error", None),
    )
    return orjson.dumps(
        {"error": {"message": message or default_msg, "type": etype, "param": None, "code": code}}
    )


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of a Chat ``response_format`` of type json_schema, else None."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if isinstance(schema, dict):
            return schema
    return None


class OpenAIApi(Api):
    """What the two OpenAI APIs share: Bearer auth, error bodies, rate-limit headers."""

    def auth_error(self, headers: Headers, api_key: bytes) -> str | None:
        auth = headers.authorization
        if auth is None or not auth.startswith(b"Bearer "):
            return ("You didn't provide an API key. You need to provide your API key in an "
                    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        if auth[7:].strip() != api_key:
            return "Incorrect API key provided."  # never echo the key, not even masked
        return None

    def error_body(self, status: int, message: str | None, req_id: bytes) -> bytes:
        return _error_body(status, message)

    def ratelimit_headers(self, limit: int, remaining: int, reset_at: float, *, reset_s: float | None = None) -> bytes:
        head = b"x-ratelimit-limit-requests: %d\r\nx-ratelimit-remaining-requests: %d\r\n" % (limit, remaining)
        if reset_s is not None:
            head += b"x-ratelimit-reset-requests: %dms\r\n" % math.ceil(reset_s * 1000.0)
        return head


class ChatApi(OpenAIApi):
    """OpenAI Chat Completions."""

    name = "chat"
    bad_body = b'{"id": "chatcmpl-broken", "choices": ['

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        return messages_tokens(body.get("messages"))

    def structured(self, body: dict[str, Any]) -> bool:
        return _json_schema(body) is not None

    def is_reask(self, body: dict[str, Any]) -> bool:
        return has_assistant_turn(body.get("messages"))

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> Answer:
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        schema = _json_schema(body)
        if schema is None:
            return cut("echo: " + last_user_text(body.get("messages")), max_tokens)
        return structured_answer(schema, key, fault, max_tokens)

    @staticmethod
    def _usage(prompt_tokens: int, ans: Answer) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": ans.tokens,
            "total_tokens": prompt_tokens + ans.tokens,
        }

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> bytes:
        message: dict[str, Any]
        if ans.refusal is not None:
            message = {"role": "assistant", "content": None, "refusal": ans.refusal}
        else:
            message = {"role": "assistant", "content": ans.text}
        return orjson.dumps({
            "id": f"chatcmpl-{seq}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name(body),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "length" if ans.truncated else "stop"}],
            "usage": self._usage(prompt_tokens, ans),
        })

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> Frames:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        head = {"id": f"chatcmpl-{seq}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model_name(body)}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data: dict[str, Any] = {
                **head,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if include_usage:  # "all other chunks will also include a usage field, but null"
                data["usage"] = None
            return sse(None, data)

        if ans.refusal is not None:
            out = [(chunk({"role": "assistant", "content": None, "refusal": ""}), False)]
            out += [(chunk({"refusal": p}), True) for p in pieces(ans.refusal)]
        else:
            out = [(chunk({"role": "assistant", "content": ""}), False)]
            out += [(chunk({"content": p}), True) for p in pieces(ans.text)]
        out.append((chunk({}, "length" if ans.truncated else "stop"), False))
        if include_usage:
            out.append((sse(None, {**head, "choices": [],
                                    "usage": self._usage(prompt_tokens, ans)}), False))
        out.append((b"data: [DONE]\n\n", False))
        return out

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        return [b"data: " + _error_body(500, _STREAM_ERROR) + b"\n\n"]


class ResponsesApi(OpenAIApi):
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
            tokens += messages_tokens(inp)
        return tokens

    @staticmethod
    def _schema(body: dict[str, Any]) -> dict[str, Any] | None:
        text = body.get("text")
        return json_schema_format(text.get("format") if isinstance(text, dict) else None)

    def structured(self, body: dict[str, Any]) -> bool:
        return self._schema(body) is not None

    def is_reask(self, body: dict[str, Any]) -> bool:
        return has_assistant_turn(body.get("input"))

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> Answer:
        max_tokens = body.get("max_output_tokens")
        schema = self._schema(body)
        if schema is not None:
            return structured_answer(schema, key, fault, max_tokens)
        inp = body.get("input")
        return cut("echo: " + (inp if isinstance(inp, str) else last_user_text(inp)), max_tokens)

    @staticmethod
    def _part(ans: Answer) -> dict[str, Any]:
        if ans.refusal is not None:
            return {"type": "refusal", "refusal": ans.refusal}
        return {"type": "output_text", "annotations": [], "text": ans.text}

    def _item(self, seq: int, ans: Answer) -> dict[str, Any]:
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
            "model": model_name(body),
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
    def _usage(prompt_tokens: int, ans: Answer) -> dict[str, Any]:
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": ans.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + ans.tokens,
        }

    def _final(self, body: dict[str, Any], seq: int, created: int, prompt_tokens: int,
               ans: Answer) -> dict[str, Any]:
        if ans.truncated:
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            status, incomplete = "completed", None
        return self._response(body, seq, created, status, [self._item(seq, ans)],
                              self._usage(prompt_tokens, ans), incomplete)

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> bytes:
        return orjson.dumps(self._final(body, seq, int(time.time()), prompt_tokens, ans))

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> Frames:
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
                       for p in pieces(ans.refusal)]
            events.append(("response.refusal.done", {**where, "refusal": ans.refusal}, False))
        else:
            events.append(("response.content_part.added", {**where, "part": {
                "type": "output_text", "annotations": [], "text": ""}}, False))
            events += [("response.output_text.delta", {**where, "delta": p, "logprobs": []}, True)
                       for p in pieces(ans.text)]
            events.append(("response.output_text.done",
                           {**where, "text": ans.text, "logprobs": []}, False))
        events.append(("response.content_part.done", {**where, "part": self._part(ans)}, False))
        events.append(("response.output_item.done",
                       {"output_index": 0, "item": self._item(seq, ans)}, False))
        final = self._final(body, seq, created, prompt_tokens, ans)
        events.append(("response.incomplete" if ans.truncated else "response.completed",
                       {"response": final}, False))
        return [(sse(name, {"type": name, "sequence_number": n, **data}), delta)
                for n, (name, data, delta) in enumerate(events)]

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        # The reference documents code/message/param at the top level of the error event; the
        # live API nests them under "error" (what the official SDKs raise on). Send both.
        error = {"type": "server_error", "code": "server_error", "message": _STREAM_ERROR,
                 "param": None}
        failed = self._response(body, seq, int(time.time()), "failed", [], None,
                                error={"code": "server_error", "message": _STREAM_ERROR})
        return [
            sse("error", {"type": "error", "sequence_number": sent, "code": "server_error",
                          "message": _STREAM_ERROR, "param": None, "error": error}),
            sse("response.failed", {"type": "response.failed", "sequence_number": sent + 1,
                                    "response": failed}),
        ]
