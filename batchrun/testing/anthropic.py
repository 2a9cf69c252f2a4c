"""Anthropic Messages, as the fake server speaks it.

Streams (one chunk per event, the answer in 16-character deltas):
``event: NAME\\ndata: {"type": NAME, ...}\\n\\n`` — ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta`` (``text_delta`` or ``input_json_delta``)…,
``content_block_stop``, ``message_delta`` (stop reason, cumulative ``output_tokens``),
``message_stop``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson

from batchrun.testing.answers import (
    Answer,
    content_text,
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

# status -> (error type, message) for Anthropic-shaped error bodies (the API's errors page);
# other 4xx are invalid_request_error, other 5xx api_error.
_ERRORS: dict[int, tuple[str, str]] = {
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


def _error(status: int, message: str | None = None) -> dict[str, str]:
    """The ``error`` object of an Anthropic-shaped error for ``status``."""
    etype, default_msg = _ERRORS.get(
        status,
        ("api_error" if status >= 500 else "invalid_request_error", f"Error {status}."),
    )
    return {"type": etype, "message": message or default_msg}


class MessagesApi(Api):
    """Anthropic Messages."""

    name = "messages"
    rid = b"request-id"
    overloaded_status = 529
    bad_body = b'{"id": "msg_broken", "type": "message", "content": ['

    def prompt_tokens(self, body: dict[str, Any]) -> int:
        tokens = messages_tokens(body.get("messages"))
        system = body.get("system")
        if system is not None:
            tokens += len(content_text(system)) // 4 + 1
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
        return json_schema_format(config.get("format") if isinstance(config, dict) else body.get("output_format"))

    def structured(self, body: dict[str, Any]) -> bool:
        return self._tool(body) is not None or self._output_schema(body) is not None

    def is_reask(self, body: dict[str, Any]) -> bool:
        return has_assistant_turn(body.get("messages"))

    def validate(self, body: dict[str, Any], headers: Headers) -> str | None:
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

    def auth_error(self, headers: Headers, api_key: bytes) -> str | None:
        # The key goes in x-api-key, or as a bearer token (what recent SDKs send).
        if headers.x_api_key is not None:
            return None if headers.x_api_key == api_key else "invalid x-api-key"
        auth = headers.authorization
        if auth is not None and auth.startswith(b"Bearer "):
            return None if auth[7:].strip() == api_key else "Invalid bearer token"
        return "x-api-key header is required"  # never echo the key

    def error_body(self, status: int, message: str | None, req_id: bytes) -> bytes:
        return orjson.dumps({"type": "error", "error": _error(status, message),
                             "request_id": "req_" + req_id.decode()})

    def ratelimit_headers(self, limit: int, remaining: int, reset_at: float, *, reset_s: float | None = None) -> bytes:
        reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(reset_at)))
        return (b"anthropic-ratelimit-requests-limit: %d\r\n"
                b"anthropic-ratelimit-requests-remaining: %d\r\n"
                b"anthropic-ratelimit-requests-reset: %s\r\n" % (limit, remaining, reset.encode()))

    def answer(self, body: dict[str, Any], key: str | None, fault: str | None) -> Answer:
        max_tokens = body.get("max_tokens")
        tool = self._tool(body)
        schema = tool[1] if tool is not None else self._output_schema(body)
        if schema is not None:
            ans = structured_answer(schema, key, fault, max_tokens)
            # a forced tool is called, unless the fault is an answer in words instead
            if tool is not None and ans.refusal is None and fault not in ("fenced", "prose", "not_json"):
                ans.tool = tool[0]
            return ans
        text = "echo: " + last_user_text(body.get("messages"))
        stop_sequence: str | None = None
        stops = body.get("stop_sequences")
        if isinstance(stops, list):
            at = len(text)
            for stop in stops:
                if isinstance(stop, str) and stop and 0 <= (i := text.find(stop)) < at:
                    at, stop_sequence = i, stop
            text = text[:at]
        ans = cut(text, max_tokens)
        if not ans.truncated:
            ans.stop_sequence = stop_sequence
        return ans

    @staticmethod
    def _stop_reason(ans: Answer) -> str:
        if ans.refusal is not None:
            return "refusal"
        if ans.truncated:
            return "max_tokens"
        if ans.tool is not None:
            return "tool_use"
        return "stop_sequence" if ans.stop_sequence is not None else "end_turn"

    @staticmethod
    def _stop_details(ans: Answer) -> dict[str, Any]:
        return {"type": "refusal", "category": None, "explanation": ans.refusal}

    def _message(self, body: dict[str, Any], seq: int, content: list[Any], stop_reason: str | None,
                 stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {
            "id": f"msg_{seq}",
            "type": "message",
            "role": "assistant",
            "model": model_name(body),
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

    def render(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> bytes:
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

    def frames(self, body: dict[str, Any], seq: int, prompt_tokens: int, ans: Answer) -> Frames:
        start = self._message(body, seq, [], None, None, prompt_tokens, 1)
        out: Frames = [(sse("message_start", {"type": "message_start", "message": start}), False)]
        if ans.refusal is None:
            if ans.tool is not None:
                block: dict[str, Any] = {"type": "tool_use", "id": f"toolu_{seq}", "name": ans.tool,
                                         "input": {}}
                kind, field = "input_json_delta", "partial_json"
            else:
                block = {"type": "text", "text": ""}
                kind, field = "text_delta", "text"
            out.append((sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                    "content_block": block}), False))
            out.append((sse("ping", {"type": "ping"}), False))
            out += [(sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": kind, field: p}}), True)
                    for p in pieces(ans.text)]
            out.append((sse("content_block_stop", {"type": "content_block_stop", "index": 0}), False))
        else:
            out.append((sse("ping", {"type": "ping"}), False))
        delta: dict[str, Any] = {"stop_reason": self._stop_reason(ans),
                                 "stop_sequence": ans.stop_sequence}
        if ans.refusal is not None:
            delta["stop_details"] = self._stop_details(ans)
        out.append((sse("message_delta", {"type": "message_delta", "delta": delta,
                                          "usage": {"output_tokens": ans.tokens}}), False))
        out.append((sse("message_stop", {"type": "message_stop"}), False))
        return out

    def error_frames(self, body: dict[str, Any], seq: int, sent: int) -> list[bytes]:
        return [sse("error", {"type": "error", "error": _error(529)})]
