"""OpenAI Chat Completions (and OpenAI-compatible servers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from batchrun import tokens
from batchrun.context import classified
from batchrun.errors import PermanentError, ProviderError, RetryableError
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
from batchrun.ratelimit import parse_reset
from batchrun.spec import JobSpec
from batchrun.tokens import REPLY_PRIMING, TOKENS_PER_MESSAGE, count_tokens
from batchrun.validate import strict_problem

CHAT_PATH = "/chat/completions"


class OpenAIProvider:
    """``kind = "openai"``: POST /v1/chat/completions with a Bearer key."""

    kind = "openai"
    path = CHAT_PATH  # the route under the versioned base URL

    def __init__(self, spec: JobSpec, api_key: str | None) -> None:
        if not spec.provider.base_url:
            raise ValueError("base_url is required")
        self.spec = spec
        self.base_url = spec.provider.base_url.rstrip("/")
        self.model = spec.provider.model
        self._base_has_path = urlsplit(self.base_url).path not in ("", "/")
        headers = dict(JSON_HEADERS)
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.headers = httpx.Headers(headers)  # built once; each request copies it cheaply
        self.warnings: list[str] = []
        self.response_format = self._response_format(spec)
        self.stream = spec.run.stream
        # How the request is served (flex: cheaper, slower); batch lines have their own price and carry none.
        self.service_tier = spec.run.service_tier if spec.run.service_tier and spec.run.mode == "online" else None
        self.answer_limit_keys = provider_entry(self.kind).max_tokens_params

    def _response_format(self, spec: JobSpec) -> dict[str, Any] | None:
        """``response_format`` with the job's schema: strict when the schema allows it."""
        output = spec.output
        if output.schema is None:
            return None
        strict = output.strict
        if strict is None:
            problem = strict_problem(output.schema)
            strict = problem is None
            if problem:
                self.warnings.append(
                    f"the output schema is sent with strict = false ({problem}); answers are still "
                    "validated here. Set [output] strict = false to silence this."
                )
        return {
            "type": "json_schema",
            "json_schema": {"name": output.name, "schema": dict(output.schema), "strict": strict},
        }

    def endpoint(self, path: str | None) -> str:
        """The full URL for a batch line's ``url`` (``/v1/chat/completions``) or the default route.

        A base URL that already ends in a version (``…/v1``, the SDK convention)
        is not given a second one; a bare host gets ``/v1``.
        """
        if path is None:
            return self.base_url + (self.path if self._base_has_path else "/v1" + self.path)
        if self._base_has_path and path.startswith("/v1/") and self.base_url.endswith("/v1"):
            path = path[3:]
        return self.base_url + path

    def render_body(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        req = self.spec.request
        body: dict[str, Any] = {}
        if self.model:
            body["model"] = self.model
        body["messages"] = list(messages)
        if req.max_tokens is not None:
            body["max_tokens"] = req.max_tokens
        if req.temperature is not None:
            body["temperature"] = req.temperature
        body.update(req.extra)
        return body

    def check_batch_line(self, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        method, url, body = record.get("method"), record.get("url"), record.get("body")
        if "params" in record and "body" not in record:
            raise ValueError(
                "this is an Anthropic Message Batches request ('params'): use [provider] kind = \"anthropic\" "
                "(or --provider anthropic)"
            )
        if not isinstance(body, dict):
            raise ValueError("not an OpenAI Batch API request: 'body' must be a JSON object")
        if method is not None and str(method).upper() != "POST":
            raise ValueError(f"method {method!r} is not supported (only POST)")
        if not isinstance(url, str) or not url.startswith("/"):
            raise ValueError("not an OpenAI Batch API request: 'url' must be a path such as /v1/chat/completions")
        if "model" not in body and not self.model:
            raise ValueError("body has no 'model' and none is configured (use --model or [provider] model)")
        return url, body

    def prepare(
        self,
        url: str | None,
        body: str,
        *,
        max_tokens: int | None = None,
        followups: Sequence[tuple[str, str]] = (),
    ) -> PreparedRequest:
        if not (self.model or self.response_format or max_tokens is not None or followups or self.stream
                or self.service_tier):
            return PreparedRequest(self.endpoint(url), self.headers, body.encode())
        data = orjson.loads(body)
        if self.service_tier:
            data["service_tier"] = self.service_tier
        if self.stream:
            data["stream"] = True
            data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
        if self.model:
            data["model"] = self.model
        if self.response_format is not None and "response_format" not in data:
            data["response_format"] = self.response_format
        if max_tokens is not None:
            key = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
            data[key] = max_tokens
        if followups:
            data["messages"] = [*data.get("messages", []), *followup_turns(followups)]
        return PreparedRequest(self.endpoint(url), self.headers, orjson.dumps(data), stream=self.stream)

    def stream_assembler(self) -> StreamAssembler:
        return ChatStreamAssembler()

    def parse(
        self, status_code: int, headers: httpx.Headers, content: bytes, *, latency_ms: float,
        ttfb_ms: float | None = None,
    ) -> Reply:
        data, text = parse_openai_body(status_code, headers, content)
        choices = data.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        answer = first.get("message") if isinstance(first, dict) else None
        if not isinstance(first, dict) or not isinstance(answer, dict):
            raise no_answer(status_code, text, "no choices[0].message")
        content_value = answer.get("content")
        output = content_value if isinstance(content_value, str) else None
        refusal_value = answer.get("refusal")
        refusal = refusal_value if isinstance(refusal_value, str) else None
        finish_reason = first.get("finish_reason")
        if not output and not (refusal or any(answer.get(k) for k in ("tool_calls", "function_call", "audio"))):
            if finish_reason == "content_filter":
                raise content_filtered(status_code, text, filtered_categories(first.get("content_filter_results")))
            if finish_reason == "length":
                raise cut_before_any_text(status_code, text)
            if output is None:
                raise no_answer(status_code, text, "message.content is null and the message holds nothing else")
        usage_value = data.get("usage")
        usage: dict[str, Any] = usage_value if isinstance(usage_value, dict) else {}
        details = usage.get("prompt_tokens_details")
        return Reply(
            status_code=status_code,
            body=text,
            output=output,
            finish_reason=finish_reason,
            input_tokens=int_or_none(usage.get("prompt_tokens")),
            output_tokens=int_or_none(usage.get("completion_tokens")),
            request_id=headers.get("x-request-id"),
            refusal=refusal,
            limits=openai_rate_limits(headers),
            cached_tokens=int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None,
            model=data.get("model") if isinstance(data.get("model"), str) else None,
            headers=headers,
            ttfb_ms=ttfb_ms,
        )

    def estimate_tokens(self, request: PreparedRequest) -> TokenEstimate:
        """The prompt counted with tiktoken when it is installed and knows the model, else ~4 bytes
        of request JSON per token; plus the answer's limit."""
        return estimate_tokens(request.content, self.answer_limit_keys, chat_prompt_tokens)


def chat_prompt_tokens(data: dict[str, Any]) -> int | None:
    """A chat request's prompt tokens in its model's encoding (OpenAI's counting recipe); None when
    they cannot be counted here (no tiktoken, an unknown model, an image or audio part)."""
    return counted_prompt(data, data.get("messages"), ("tools", "response_format"))


# What a chat message or a Responses message item may hold for its prompt to be counted;
# anything else (audio, a function call's output item, ...) leaves the estimate to request size.
COUNTABLE_TURN_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "type"})


def counted_prompt(data: dict[str, Any], turns: Any, extra_keys: Sequence[str], lead: Sequence[str] = ()) -> int | None:
    """Tokens of the ``lead`` messages (instructions), the ``turns`` (chat messages or Responses
    message items) and the JSON of ``extra_keys`` (tools, a response schema: sent to the model
    too), in OpenAI's counting recipe: every value of a message, 3 tokens around each message,
    1 more for a name, 3 to prime the reply. None when something is not plain text."""
    encoding = tokens.COUNTER.encoding(data.get("model"))
    if encoding is None or not isinstance(turns, list):
        return None
    texts = list(lead)
    names = 0
    for turn in turns:
        if not isinstance(turn, dict) or not turn.keys() <= COUNTABLE_TURN_KEYS or turn.get("type", "message") != "message":
            return None
        parts = message_texts(turn.get("content"))
        if parts is None:
            return None
        texts += parts
        texts += [v for k in ("role", "name", "tool_call_id") if isinstance(v := turn.get(k), str)]
        names += "name" in turn
        if turn.get("tool_calls"):
            texts.append(orjson.dumps(turn["tool_calls"]).decode())
    texts += [orjson.dumps(data[k]).decode() for k in extra_keys if data.get(k)]
    return count_tokens(encoding, texts) + TOKENS_PER_MESSAGE * (len(lead) + len(turns)) + names + REPLY_PRIMING


def message_texts(content: Any) -> list[str] | None:
    """The texts of a message's content (a string, or a list of text parts); None if a part is not text."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            return None
        texts.append(part["text"])
    return texts


class ChatStreamAssembler:
    """``chat.completion.chunk`` events back into one ``chat.completion`` body."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.refusal: list[str] = []
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.head: dict[str, Any] = {}
        self.done = False
        self.answered = False  # a chunk carried choice 0: without one, there is no answer to rebuild

    def feed(self, event: str, data: str) -> bool:
        if data == "[DONE]":
            self.done = True
            return False
        chunk = stream_event_json(data)
        if isinstance(chunk.get("error"), dict):
            raise openai_error_event(chunk["error"], data)
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model", "system_fingerprint") if k in chunk}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        carried = False
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self.answered = True
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.parts.append(delta["content"])
                carried = True
            if delta.get("refusal"):
                self.refusal.append(delta["refusal"])
                carried = True
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return carried

    def body(self) -> bytes:
        if not (self.done or (self.finish_reason and self.usage)):
            raise stream_error("no finish_reason and [DONE] after the last chunk")
        if not self.answered:
            raise RetryableError("the stream ended without any choice: no answer", error_class="bad_response")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.parts) if self.parts else None}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        elif message["content"] is None:
            message["content"] = ""
        return orjson.dumps({
            **self.head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
            "usage": self.usage,
        })


def no_answer(status_code: int, text: str, what: str) -> RetryableError:
    """A 2xx whose body holds no answer at all: broken on the way, so retryable (``bad_response``)."""
    return RetryableError(
        f"HTTP {status_code} with no answer in the body ({what}): {text[:200]!r}",
        status_code=status_code,
        error_class="bad_response",
        body=text,
    )


def content_filtered(status_code: int, text: str, detail: str | None) -> PermanentError:
    """The provider's content filter withheld the whole answer: asking again is paid for and
    filtered the same way, so it is permanent (``content_filter``); ``batchrun retry`` can re-ask."""
    reason = f" (flagged: {detail})" if detail else ""
    return PermanentError(
        f"HTTP {status_code}: the provider's content filter withheld the answer{reason}",
        status_code=status_code,
        error_class="content_filter",
        body=text,
    )


def cut_before_any_text(status_code: int, text: str) -> PermanentError:
    """The answer's token limit was spent before any text (a reasoning model's thinking, say):
    the same limit would be spent the same way, so it is permanent (``truncated``)."""
    return PermanentError(
        f"HTTP {status_code}: the answer reached its token limit before any text; give it more "
        "(batchrun retry JOB --where error_class=truncated --max-tokens N)",
        status_code=status_code,
        error_class="truncated",
        body=text,
    )


def filtered_categories(results: Any) -> str | None:
    """The categories an Azure-style ``content_filter_results`` object marks ``filtered``, with severity."""
    if not isinstance(results, dict):
        return None
    flagged = []
    for name, verdict in results.items():
        if isinstance(verdict, dict) and verdict.get("filtered") is True:
            severity = verdict.get("severity")
            flagged.append(f"{name} ({severity})" if isinstance(severity, str) else str(name))
    return ", ".join(flagged) or None


def parse_openai_body(status_code: int, headers: httpx.Headers, content: bytes) -> tuple[dict[str, Any], str]:
    """(JSON object, text) of a 2xx OpenAI answer; the right ProviderError for anything else."""
    data = json_or_none(content)
    text = content.decode("utf-8", errors="replace")
    if not 200 <= status_code < 300:
        message, code = text[:500], None
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            message, code = str(data["error"].get("message") or message), data["error"].get("code")
        raise classified(error_for_status(status_code, headers, message, text), code)
    if not isinstance(data, dict):
        raise RetryableError(
            f"HTTP {status_code} with a body that is not a JSON object: {text[:200]!r}",
            status_code=status_code,
            error_class="bad_response",
            body=text,
        )
    return data, text


# In-band errors of a stream carry no HTTP status: their type/code stands for one.
_OPENAI_ERROR_STATUS = {
    "rate_limit_exceeded": 429, "requests": 429, "tokens": 429, "insufficient_quota": 429,
    "server_error": 500, "internal_error": 500, "overloaded": 503, "service_unavailable": 503,
    "invalid_api_key": 401, "authentication_error": 401, "permission_denied": 403,
    "invalid_request_error": 400, "invalid_prompt": 400, "context_length_exceeded": 400,
}


def openai_error_event(error: Any, raw: str) -> ProviderError:
    """The ProviderError an OpenAI in-band error object (``{"message", "type", "code"}``) stands for."""
    error = error if isinstance(error, dict) else {}
    status = 500
    for key in ("code", "type"):
        value = error.get(key)
        if isinstance(value, str) and value in _OPENAI_ERROR_STATUS:
            status = _OPENAI_ERROR_STATUS[value]
            break
    message = str(error.get("message") or "error event in the stream")
    return classified(error_for_status(status, httpx.Headers(), f"(in the stream) {message}", raw), error.get("code"))


def openai_rate_limits(headers: httpx.Headers) -> RateLimits | None:
    """``x-ratelimit-limit-*`` / ``-remaining-*`` / ``-reset-*``, when the server sends them."""
    if "x-ratelimit-remaining-requests" not in headers and "x-ratelimit-remaining-tokens" not in headers:
        return None
    return RateLimits(
        remaining_requests=int_header(headers.get("x-ratelimit-remaining-requests")),
        reset_requests_s=parse_reset(headers.get("x-ratelimit-reset-requests")),
        remaining_tokens=int_header(headers.get("x-ratelimit-remaining-tokens")),
        reset_tokens_s=parse_reset(headers.get("x-ratelimit-reset-tokens")),
        limit_requests=int_header(headers.get("x-ratelimit-limit-requests")),
        limit_tokens=int_header(headers.get("x-ratelimit-limit-tokens")),
    )
