"""Anthropic Messages (``POST /v1/messages``) and Message Batches input lines.

Differs from OpenAI in: ``x-api-key`` and ``anthropic-version`` headers,
``max_tokens`` required, ``system`` as a top-level field, content blocks
(``text``, ``tool_use``), ``stop_reason``, usage as ``input_tokens`` /
``output_tokens`` with cache reads counted apart, error bodies
``{"type": "error", "error": {"type", "message"}}``, 529 overloaded,
``anthropic-ratelimit-*`` headers with RFC 3339 reset times, and stream events
``message_start`` … ``message_stop``. Structured output is a forced call of one
tool whose ``input_schema`` is the job's schema.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from batchrun.context import classified
from batchrun.errors import ProviderError, RetryableError, SpecError
from batchrun.jsonutil import json_or_none
from batchrun.provider_registry import provider_entry
from batchrun.providers.base import (
    JSON_HEADERS,
    PreparedRequest,
    RateLimits,
    Reply,
    StreamAssembler,
    TokenEstimate,
    estimate_tokens,
    followup_turns,
    int_header,
    int_or_none,
    stream_error,
    stream_event_json,
)
from batchrun.providers.http import error_for_status
from batchrun.spec import JobSpec

MESSAGES_PATH = "/messages"
TOOL_DESCRIPTION = "Give the answer by calling this tool; its input is the answer, in exactly this structure."

_STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "stop", "pause_turn": "stop",
                 "max_tokens": "length", "model_context_window_exceeded": "length", "refusal": "refusal"}
# In-band stream errors carry no HTTP status: their type stands for one (Anthropic's errors page).
_ERROR_STATUS = {"invalid_request_error": 400, "authentication_error": 401, "billing_error": 402,
                 "permission_error": 403, "not_found_error": 404, "request_too_large": 413,
                 "rate_limit_error": 429, "api_error": 500, "timeout_error": 504, "overloaded_error": 529}
# OpenAI body fields the conversion drops because they change nothing here.
_DROPPED_WHEN_DEFAULT = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False}
_IGNORED = frozenset({"stream", "stream_options", "seed", "store", "service_tier", "parallel_tool_calls"})


class AnthropicProvider:
    """``kind = "anthropic"``: POST /v1/messages with ``x-api-key``."""

    kind = "anthropic"

    def __init__(self, spec: JobSpec, api_key: str | None) -> None:
        if not spec.provider.base_url:
            raise ValueError("base_url is required")
        self.spec = spec
        self.base_url = spec.provider.base_url.rstrip("/")
        self.model = spec.provider.model
        self._base_has_path = urlsplit(self.base_url).path not in ("", "/")
        headers = {
            **JSON_HEADERS,
            "anthropic-version": spec.provider.anthropic_version,
        }
        if api_key:
            headers["x-api-key"] = api_key
        self.headers = httpx.Headers(headers)  # built once; each request copies it cheaply
        self.warnings: list[str] = []
        self.stream = spec.run.stream
        if spec.run.service_tier:
            raise SpecError(
                f"{spec.path or 'spec'}: [run] service_tier is OpenAI's (kind openai or openai-responses); for the "
                "Messages API's own, use [request] extra = {{ service_tier = \"...\" }}"
            )
        self.answer_limit_keys = provider_entry(self.kind).max_tokens_params
        if spec.has_template and spec.request.max_tokens is None:
            raise SpecError(
                f"{spec.path or 'spec'}: [request] max_tokens is required by the Anthropic Messages API"
            )
        self.tool_name = spec.output.name
        self.tools: list[dict[str, Any]] | None = None
        if spec.output.schema is not None:
            schema = dict(spec.output.schema)
            if schema.get("type") != "object":
                raise SpecError(
                    f"{spec.path or 'spec'}: [output] schema: the Anthropic provider sends it as a tool's "
                    "input_schema, which must be a JSON object schema (\"type\": \"object\")"
                )
            self.tools = [{"name": self.tool_name, "description": TOOL_DESCRIPTION, "input_schema": schema}]

    def endpoint(self, path: str | None) -> str:
        """``…/v1/messages``; a base URL already ending in a version is not given a second one."""
        return self.base_url + (MESSAGES_PATH if self._base_has_path else "/v1" + MESSAGES_PATH)

    def render_body(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        req = self.spec.request
        body: dict[str, Any] = {}
        if self.model:
            body["model"] = self.model
        body["max_tokens"] = req.max_tokens
        system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
        if system:
            body["system"] = "\n\n".join(system)
        body["messages"] = [dict(m) for m in messages if m["role"] not in ("system", "developer")]
        if req.temperature is not None:
            body["temperature"] = req.temperature
        body.update(req.extra)
        return body

    def check_batch_line(self, record: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """An Anthropic Message Batches line (``{"custom_id", "params"}``), or an OpenAI Batch
        line converted when the spec sets ``convert_openai_input``."""
        if "params" not in record and "body" in record:
            if not self.spec.provider.convert_openai_input:
                raise ValueError(
                    "this is an OpenAI Batch API request ('body'): set [provider] convert_openai_input = true "
                    "to convert it to an Anthropic Messages request"
                )
            body = record["body"]
            if not isinstance(body, dict):
                raise ValueError("not an OpenAI Batch API request: 'body' must be a JSON object")
            params = openai_to_anthropic(body, default_max_tokens=self.spec.request.max_tokens)
        else:
            params_value = record.get("params")
            if not isinstance(params_value, dict):
                raise ValueError("not an Anthropic Message Batches request: 'params' must be a JSON object")
            params = params_value
        if not isinstance(params.get("messages"), list) or not params["messages"]:
            raise ValueError("params has no 'messages' list")
        max_tokens = params.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError("params has no positive integer 'max_tokens' (the Messages API requires one)")
        if "model" not in params and not self.model:
            raise ValueError("params has no 'model' and none is configured (use --model or [provider] model)")
        return None, params

    def prepare(
        self,
        url: str | None,
        body: str,
        *,
        max_tokens: int | None = None,
        followups: Sequence[tuple[str, str]] = (),
    ) -> PreparedRequest:
        data = orjson.loads(body)
        if self.model:
            data["model"] = self.model
        if self.stream:
            data["stream"] = True
        else:
            data.pop("stream", None)
        if self.tools is not None and "tools" not in data:
            data["tools"] = self.tools
            data["tool_choice"] = {"type": "tool", "name": self.tool_name}
        if max_tokens is not None:
            data["max_tokens"] = max_tokens
        if followups:
            data["messages"] = [*data.get("messages", []), *followup_turns(followups)]
        return PreparedRequest(self.endpoint(url), self.headers, orjson.dumps(data), stream=self.stream)

    def stream_assembler(self) -> StreamAssembler:
        return MessageStreamAssembler()

    def parse(
        self, status_code: int, headers: httpx.Headers, content: bytes, *, latency_ms: float,
        ttfb_ms: float | None = None,
    ) -> Reply:
        data = json_or_none(content)
        text = content.decode("utf-8", errors="replace")
        if not 200 <= status_code < 300:
            message = text[:500]
            error = data.get("error") if isinstance(data, dict) else None
            if isinstance(error, dict):
                message = f"{error.get('type', 'error')}: {error.get('message') or ''}".strip()
            raise _classified(error_for_status(status_code, headers, message, text))
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            raise RetryableError(
                f"HTTP {status_code} with a body that is not a Message: {text[:200]!r}",
                status_code=status_code,
                error_class="bad_response",
                body=text,
            )
        texts: list[str] = []
        tool_inputs: list[Any] = []
        for block in data["content"]:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif block.get("type") == "tool_use":
                if block.get("name") == self.tool_name:
                    tool_inputs.insert(0, block.get("input"))
                else:
                    tool_inputs.append(block.get("input"))
        output: str | None
        if tool_inputs and (self.tools is not None or not texts):
            value = tool_inputs[0]
            output = value if isinstance(value, str) else orjson.dumps(value).decode()
        else:
            output = "".join(texts)
        stop_reason = data.get("stop_reason")
        finish_reason = _STOP_REASONS.get(str(stop_reason), stop_reason if isinstance(stop_reason, str) else None)
        refusal = None
        if stop_reason == "refusal":
            details = data.get("stop_details")
            explanation = details.get("explanation") if isinstance(details, dict) else None
            refusal = explanation or "".join(texts) or "the model declined to answer (stop_reason = refusal)"
            finish_reason = "stop"
        usage_value = data.get("usage")
        usage: dict[str, Any] = usage_value if isinstance(usage_value, dict) else {}
        fresh = int_or_none(usage.get("input_tokens"))
        cache_read = int_or_none(usage.get("cache_read_input_tokens")) or 0
        cache_write = int_or_none(usage.get("cache_creation_input_tokens")) or 0
        return Reply(
            status_code=status_code,
            body=text,
            output=output,
            finish_reason=finish_reason,
            # Anthropic counts cache reads and writes apart from input_tokens; ours include them.
            input_tokens=fresh + cache_read + cache_write if fresh is not None else None,
            output_tokens=int_or_none(usage.get("output_tokens")),
            request_id=headers.get("request-id") or (data.get("id") if isinstance(data.get("id"), str) else None),
            refusal=refusal,
            limits=anthropic_rate_limits(headers),
            cached_tokens=cache_read if fresh is not None else None,
            model=data.get("model") if isinstance(data.get("model"), str) else None,
            headers=headers,
            ttfb_ms=ttfb_ms,
        )

    def estimate_tokens(self, request: PreparedRequest) -> TokenEstimate:
        """~4 bytes of request JSON per prompt token (tiktoken does not have Claude's encoding), plus max_tokens."""
        return estimate_tokens(request.content, self.answer_limit_keys)


class MessageStreamAssembler:
    """``message_start`` … ``message_stop`` back into one Message body."""

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, list[str]] = {}
        self.done = False

    def feed(self, event: str, data: str) -> bool:
        if event == "ping":
            return False
        payload = stream_event_json(data)
        kind = payload.get("type") or event
        if kind == "message_start":
            message = payload.get("message")
            self.message = dict(message) if isinstance(message, dict) else {}
        elif kind == "content_block_start":
            block = payload.get("content_block")
            self.blocks[int(payload.get("index", len(self.blocks)))] = dict(block) if isinstance(block, dict) else {}
        elif kind == "content_block_delta":
            index = int(payload.get("index", 0))
            delta = payload.get("delta") or {}
            block = self.blocks.setdefault(index, {"type": "text", "text": ""})
            if delta.get("type") == "text_delta" and delta.get("text"):
                block["text"] = block.get("text", "") + delta["text"]
                return True
            if delta.get("type") == "input_json_delta" and delta.get("partial_json"):
                self.partial_json.setdefault(index, []).append(delta["partial_json"])
                return True
        elif kind == "message_delta":
            if self.message is None:
                self.message = {}
            self.message.update({k: v for k, v in (payload.get("delta") or {}).items() if v is not None})
            usage = payload.get("usage")
            if isinstance(usage, dict):  # cumulative counts
                self.message["usage"] = {**(self.message.get("usage") or {}), **{
                    k: v for k, v in usage.items() if v is not None}}
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            raise anthropic_error_event(payload.get("error"), data)
        return False

    def body(self) -> bytes:
        if not self.done or self.message is None:
            raise stream_error("no message_stop event")
        content = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if block.get("type") == "tool_use" and index in self.partial_json:
                raw = "".join(self.partial_json[index])
                try:
                    block["input"] = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    block["input"] = raw  # kept as text, so validation says what is wrong with it
            content.append(block)
        return orjson.dumps({**self.message, "content": content})


def anthropic_error_event(error: Any, raw: str) -> ProviderError:
    """The ProviderError an in-band ``error`` event stands for (``overloaded_error`` → 529, …)."""
    error = error if isinstance(error, dict) else {}
    kind = str(error.get("type") or "api_error")
    message = f"(in the stream) {kind}: {error.get('message') or ''}".strip()
    return _classified(error_for_status(_ERROR_STATUS.get(kind, 500), httpx.Headers(), message, raw))


def _classified(error: ProviderError) -> ProviderError:
    if error.status_code == 529:
        error.error_class = "overloaded"  # type: ignore[misc]
    return classified(error)


def anthropic_rate_limits(headers: httpx.Headers) -> RateLimits | None:
    """``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` (reset is an RFC 3339 time)."""
    if "anthropic-ratelimit-requests-remaining" not in headers and "anthropic-ratelimit-tokens-remaining" not in headers:
        return None
    return RateLimits(
        remaining_requests=int_header(headers.get("anthropic-ratelimit-requests-remaining")),
        reset_requests_s=_seconds_until(headers.get("anthropic-ratelimit-requests-reset")),
        remaining_tokens=int_header(headers.get("anthropic-ratelimit-tokens-remaining")),
        reset_tokens_s=_seconds_until(headers.get("anthropic-ratelimit-tokens-reset")),
        limit_requests=int_header(headers.get("anthropic-ratelimit-requests-limit")),
        limit_tokens=int_header(headers.get("anthropic-ratelimit-tokens-limit")),
    )


def _seconds_until(value: str | None) -> float | None:
    if not value:
        return None
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - time.time())


def openai_to_anthropic(body: Mapping[str, Any], *, default_max_tokens: int | None) -> dict[str, Any]:
    """An OpenAI Chat Completions body as an Anthropic Messages one.

    Converts messages (system/developer turns become ``system``), ``max_tokens`` /
    ``max_completion_tokens``, ``stop``, ``temperature``, ``top_p``, ``user`` and a
    ``json_schema`` response_format (a forced tool call). A field with no Anthropic
    equivalent is a ValueError naming it, never silently dropped.
    """
    params: dict[str, Any] = {}
    unknown = []
    for key, value in body.items():
        if key in _IGNORED or value is None or _DROPPED_WHEN_DEFAULT.get(key, object()) == value:
            continue
        if key == "model":
            params["model"] = value
        elif key == "messages":
            params.update(_convert_messages(value))
        elif key in ("max_tokens", "max_completion_tokens"):
            params["max_tokens"] = value
        elif key == "stop":
            params["stop_sequences"] = [value] if isinstance(value, str) else list(value)
        elif key == "temperature":
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"temperature {value!r} is outside the Anthropic range 0..1")
            params["temperature"] = value
        elif key == "top_p":
            params["top_p"] = value
        elif key == "user":
            params["metadata"] = {"user_id": str(value)}
        elif key == "response_format" and isinstance(value, dict) and value.get("type") == "json_schema":
            inner = value.get("json_schema") or {}
            name = str(inner.get("name") or "output")
            params["tools"] = [{"name": name, "description": TOOL_DESCRIPTION, "input_schema": inner.get("schema")}]
            params["tool_choice"] = {"type": "tool", "name": name}
        elif key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"cannot convert to an Anthropic request: {', '.join(sorted(unknown))} has no equivalent")
    if "max_tokens" not in params:
        if default_max_tokens is None:
            raise ValueError("body has no max_tokens and the spec sets no [request] max_tokens (Anthropic requires one)")
        params["max_tokens"] = default_max_tokens
    return params


def _convert_messages(messages: Any) -> dict[str, Any]:
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] is not an object")
        role, content = message.get("role"), message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}]: only text content parts can be converted")
            text = "".join(str(p.get("text", "")) for p in content)
        elif isinstance(content, str):
            text = content
        else:
            raise ValueError(f"messages[{i}]: content must be a string or a list of text parts")
        if role in ("system", "developer"):
            system.append(text)
        elif role in ("user", "assistant"):
            turns.append({"role": role, "content": text})
        else:
            raise ValueError(f"messages[{i}]: role {role!r} cannot be converted (only system, user, assistant)")
    out: dict[str, Any] = {"messages": turns}
    if system:
        out["system"] = "\n\n".join(system)
    return out
