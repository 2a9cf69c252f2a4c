"""OpenAI Responses API (``POST /v1/responses``).

Differs from Chat Completions in: ``input`` and ``instructions`` instead of
``messages``, ``max_output_tokens``, structured output under ``text.format``,
an ``output`` list of items with ``output_text``/``refusal`` parts, ``status``
(``incomplete`` with a reason instead of ``finish_reason``), usage named
``input_tokens``/``output_tokens``, and typed stream events ending in
``response.completed``/``response.incomplete``/``response.failed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import orjson

from batchrun.errors import ProviderError
from batchrun.providers.base import (
    PreparedRequest,
    Reply,
    StreamAssembler,
    TokenEstimate,
    estimate_tokens,
    followup_turns,
    int_or_none,
    stream_error,
    stream_event_json,
)
from batchrun.providers.openai import (
    OpenAIProvider,
    content_filtered,
    counted_prompt,
    cut_before_any_text,
    no_answer,
    openai_error_event,
    openai_rate_limits,
    parse_openai_body,
)
from batchrun.spec import JobSpec

RESPONSES_PATH = "/responses"
_INCOMPLETE_FINISH = {"max_output_tokens": "length", "content_filter": "content_filter"}


class OpenAIResponsesProvider(OpenAIProvider):
    """``kind = "openai-responses"``: POST /v1/responses with a Bearer key."""

    kind = "openai-responses"
    path = RESPONSES_PATH

    def __init__(self, spec: JobSpec, api_key: str | None) -> None:
        super().__init__(spec, api_key)
        chat_format = self.response_format
        self.text_format: dict[str, Any] | None = None
        if chat_format is not None:
            inner = chat_format["json_schema"]
            self.text_format = {"type": "json_schema", "name": inner["name"], "schema": inner["schema"],
                                "strict": inner["strict"]}

    def render_body(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        req = self.spec.request
        body: dict[str, Any] = {}
        if self.model:
            body["model"] = self.model
        instructions = [m["content"] for m in messages if m["role"] in ("system", "developer")]
        if instructions:
            body["instructions"] = "\n\n".join(instructions)
        body["input"] = [dict(m) for m in messages if m["role"] not in ("system", "developer")]
        if req.max_tokens is not None:
            body["max_output_tokens"] = req.max_tokens
        if req.temperature is not None:
            body["temperature"] = req.temperature
        body.update(req.extra)
        return body

    def check_batch_line(self, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        url, body = super().check_batch_line(record)
        if not url.rstrip("/").endswith(RESPONSES_PATH):
            raise ValueError(f"url {url!r} is not the Responses API (/v1/responses); use [provider] kind = \"openai\"")
        if "input" not in body:
            raise ValueError("body has no 'input' (a Responses API request needs one)")
        return url, body

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
        if self.service_tier:
            data["service_tier"] = self.service_tier
        if self.stream:
            data["stream"] = True
        if self.text_format is not None and "format" not in (data.get("text") or {}):
            data["text"] = {**(data.get("text") or {}), "format": self.text_format}
        if max_tokens is not None:
            data["max_output_tokens"] = max_tokens
        if followups:
            turns = data.get("input", [])
            turns = [{"role": "user", "content": turns}] if isinstance(turns, str) else list(turns)
            data["input"] = [*turns, *followup_turns(followups)]
        return PreparedRequest(self.endpoint(url), self.headers, orjson.dumps(data), stream=self.stream)

    def stream_assembler(self) -> StreamAssembler:
        return ResponsesStreamAssembler()

    def parse(
        self, status_code: int, headers: httpx.Headers, content: bytes, *, latency_ms: float,
        ttfb_ms: float | None = None,
    ) -> Reply:
        data, text = parse_openai_body(status_code, headers, content)
        status = data.get("status")
        if status == "failed":
            raise _failed(data, text)
        items = data.get("output")
        if not isinstance(items, list):
            raise no_answer(status_code, text, "no output list")
        texts: list[str] = []
        refusals: list[str] = []
        for item in items:
            if not isinstance(item, dict) or item.get("type") != "message":
                continue
            for part in item.get("content") or ():
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                    refusals.append(part["refusal"])
        if status in ("queued", "in_progress"):
            raise no_answer(status_code, text, f"the response is still {status}")
        finish_reason: str | None = "stop"
        if status == "incomplete":
            details = data.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, dict) else None
            finish_reason = _INCOMPLETE_FINISH.get(str(reason), str(reason))
        if not (any(texts) or refusals or _calls(items)):
            if finish_reason == "content_filter":
                raise content_filtered(status_code, text, None)  # withheld before any answer
            if finish_reason == "length":
                raise cut_before_any_text(status_code, text)
            if not texts:  # (an output_text part, even empty, is an answer, as Chat's "" is)
                raise no_answer(status_code, text, "no message, refusal or tool call in the output")
        usage_value = data.get("usage")
        usage: dict[str, Any] = usage_value if isinstance(usage_value, dict) else {}
        details = usage.get("input_tokens_details")
        return Reply(
            status_code=status_code,
            body=text,
            output="".join(texts) if texts or not refusals else None,
            finish_reason=finish_reason,
            input_tokens=int_or_none(usage.get("input_tokens")),
            output_tokens=int_or_none(usage.get("output_tokens")),
            request_id=headers.get("x-request-id"),
            refusal="".join(refusals) if refusals else None,
            limits=openai_rate_limits(headers),
            cached_tokens=int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None,
            model=data.get("model") if isinstance(data.get("model"), str) else None,
            headers=headers,
            ttfb_ms=ttfb_ms,
        )

    def estimate_tokens(self, request: PreparedRequest) -> TokenEstimate:
        """As for chat: tiktoken's count of the instructions and input when it can, else the byte heuristic."""
        return estimate_tokens(request.content, self.answer_limit_keys, responses_prompt_tokens)


def responses_prompt_tokens(data: dict[str, Any]) -> int | None:
    """A Responses request's prompt tokens (instructions, input items, tools, text format); None if not countable."""
    items = data.get("input")
    lead = [data["instructions"]] if isinstance(data.get("instructions"), str) else []
    return counted_prompt(data, [{"content": items}] if isinstance(items, str) else items, ("tools", "text"), lead)


class ResponsesStreamAssembler:
    """Typed Responses events; the terminal event carries the whole response object."""

    def __init__(self) -> None:
        self.final: dict[str, Any] | None = None

    def feed(self, event: str, data: str) -> bool:
        payload = stream_event_json(data)
        kind = payload.get("type") or event
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            return bool(payload.get("delta"))
        if kind in ("response.completed", "response.incomplete"):
            response = payload.get("response")
            self.final = response if isinstance(response, dict) else None
        elif kind == "response.failed":
            response = payload.get("response")
            raise _failed(response if isinstance(response, dict) else {}, data)
        elif kind == "error":
            raise openai_error_event(payload.get("error", payload), data)
        return False

    def body(self) -> bytes:
        if self.final is None:
            raise stream_error("no response.completed or response.incomplete event")
        return orjson.dumps(self.final)


def _calls(items: list[Any]) -> bool:
    """Whether the output holds a tool call (an answer without text), not just messages or reasoning."""
    return any(isinstance(item, dict) and item.get("type") not in ("message", "reasoning") for item in items)


def _failed(response: Mapping[str, Any], raw: str) -> ProviderError:
    """A response whose ``status`` is ``failed``: its ``error.code`` decides the class."""
    error = response.get("error")
    return openai_error_event(error if isinstance(error, dict) else {"message": "the response failed"}, raw)
