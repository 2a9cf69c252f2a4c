"""What every provider shares: the request and reply shapes, the :class:`Provider`
protocol, and small helpers for building requests and reading answers.

Sending them is :mod:`batchrun.providers.http`'s job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import orjson

from batchrun.errors import RetryableError
from batchrun.jsonutil import json_or_none
from batchrun.tokens import BYTES_PER_TOKEN

if TYPE_CHECKING:
    import httpx

JSON_HEADERS = {"content-type": "application/json", "accept": "application/json", "user-agent": "batchrun"}
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})
DEFAULT_ANSWER_TOKENS = 1024  # assumed answer size when a request sets no max_tokens


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to send: full URL, headers (with the key) and body bytes."""

    url: str
    headers: Mapping[str, str]
    content: bytes
    stream: bool = False  # the body asks for server-sent events

    def __repr__(self) -> str:  # never show the key
        return (
            f"PreparedRequest(url={self.url!r}, headers={redact_headers(self.headers)!r}, "
            f"{len(self.content)} bytes, stream={self.stream})"
        )


@dataclass(frozen=True)
class RateLimits:
    """What the provider's rate-limit headers said about the budget left."""

    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    limit_requests: int | None = None  # the request limit the provider advertises (per minute, as a rule)
    limit_tokens: int | None = None


@dataclass(frozen=True)
class Reply:
    """A successful answer, parsed."""

    status_code: int
    body: str
    output: str | None
    finish_reason: str | None
    input_tokens: int | None
    output_tokens: int | None
    request_id: str | None
    refusal: str | None = None
    limits: RateLimits | None = None
    cached_tokens: int | None = None
    model: str | None = None
    ttft_ms: float | None = None  # streamed: time to the first output token
    tpot_ms: float | None = None  # streamed: ms per output token after the first
    headers: httpx.Headers | None = None  # as received (``batchrun check`` shows the rate-limit ones)
    ttfb_ms: float | None = None  # time from sending to the response's headers (streamed or not)


class StreamAssembler(Protocol):
    """Rebuilds one streamed answer from its SSE events.

    The result is the body the same request would have had without streaming,
    so :meth:`Provider.parse` reads both, and the ledger stores one shape.
    """

    def feed(self, event: str, data: str) -> bool:
        """Take one event; True when it carried output (the first marks time to first token).

        An in-band error event raises the ProviderError it stands for.
        """
        ...

    def body(self) -> bytes:
        """The whole answer as a non-streamed JSON body; RetryableError if the stream never finished."""
        ...


class Provider(Protocol):
    """One API's differences: request shape, auth, reply parsing, error bodies."""

    kind: str
    warnings: list[str]  # things the user should know about how requests are sent

    def render_body(self, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        """A request body from rendered chat messages and the spec's request settings."""
        ...

    def check_batch_line(self, record: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """(url or None for the default route, body) of a provider batch-form input line;
        ValueError with the reason if it is not one."""
        ...

    def prepare(
        self,
        url: str | None,
        body: str,
        *,
        max_tokens: int | None = None,
        followups: Sequence[tuple[str, str]] = (),
    ) -> PreparedRequest:
        """The HTTP request for a stored item.

        ``max_tokens`` replaces the body's limit (``batchrun retry --max-tokens``);
        ``followups`` are (previous answer, feedback) pairs of a re-ask. The job's
        structured-output request (its schema) is added here, not stored per item.
        """
        ...

    def parse(
        self, status_code: int, headers: httpx.Headers, content: bytes, *, latency_ms: float,
        ttfb_ms: float | None = None,
    ) -> Reply:
        """A Reply for a 2xx answer; raise the right ProviderError otherwise."""
        ...

    def estimate_tokens(self, request: PreparedRequest) -> TokenEstimate:
        """Tokens a request may use at most, before it is sent (prompt estimate, max_tokens)."""
        ...

    def stream_assembler(self) -> StreamAssembler:
        """A fresh assembler for one streamed answer."""
        ...


def followup_turns(followups: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    """A re-ask's extra turns: each earlier answer as the assistant's, its feedback as the user's."""
    turns: list[dict[str, str]] = []
    for answer, feedback in followups:
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    return turns


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: ("***" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def stream_error(message: str) -> RetryableError:
    """A stream that ended (cleanly, as far as HTTP goes) before its final event."""
    return RetryableError(f"stream ended early: {message}", error_class="stream_broken")


def stream_event_json(data: str) -> dict[str, Any]:
    """One SSE event's JSON object; a bad event is a retryable bad_response."""
    value = json_or_none(data)
    if not isinstance(value, dict):
        raise RetryableError(f"stream event is not a JSON object: {data[:200]!r}", error_class="bad_response")
    return value


class TokenEstimate(NamedTuple):
    """What a request may use at most, before it is sent."""

    prompt: int  # counted with tiktoken for OpenAI models when it can, else ~4 bytes of request JSON per token
    answer: int  # the request's answer limit (max_tokens), or DEFAULT_ANSWER_TOKENS when it sets none
    counted: bool = False  # the prompt was counted with tiktoken, not estimated from its size

    @property
    def total(self) -> int:
        return self.prompt + self.answer


def estimate_tokens(
    content: bytes,
    limit_keys: Sequence[str],
    exact_prompt: Callable[[dict[str, Any]], int | None] | None = None,
) -> TokenEstimate:
    """The prompt (``exact_prompt`` of the body when it can count it, else the byte heuristic) and the answer's limit."""
    data = orjson.loads(content)
    limit = next((data[k] for k in limit_keys if data.get(k)), DEFAULT_ANSWER_TOKENS)
    prompt = exact_prompt(data) if exact_prompt is not None else None
    if prompt is None:
        return TokenEstimate(len(content) // BYTES_PER_TOKEN, int(limit))
    return TokenEstimate(prompt, int(limit), counted=True)


def int_header(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
