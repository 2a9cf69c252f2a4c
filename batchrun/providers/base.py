"""What every provider shares: the request/reply shapes, the HTTP client, reading
plain and streamed (SSE) answers, and turning transport failures and HTTP
statuses into our error classes."""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import functools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import aiohttp
import httpx
import orjson
from httpx_sse import EventSource, SSEError

from batchrun.errors import AuthError, PermanentError, ProviderError, RateLimitedError, RetryableError
from batchrun.jsonutil import json_or_none
from batchrun.redact import contains_secret, redact, redact_optional
from batchrun.spec import JobSpec
from batchrun.tokens import BYTES_PER_TOKEN

RETRYABLE_STATUS = frozenset({408, 409, 425})
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

    def parse(self, status_code: int, headers: httpx.Headers, content: bytes, *, latency_ms: float) -> Reply:
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


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """The delay a 429/503 asks for: ``retry-after-ms``, else ``retry-after`` (seconds or HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_for_status(status_code: int, headers: httpx.Headers, message: str, body: str) -> ProviderError:
    """Our error class for a non-2xx HTTP status (DESIGN.md: Calling the API)."""
    text = f"HTTP {status_code}: {message}"
    if status_code == 429:
        return RateLimitedError(text, retry_after=retry_after_seconds(headers), status_code=status_code, body=body)
    if status_code in (401, 403):
        return AuthError(text, status_code=status_code, body=body)
    retry_after = retry_after_seconds(headers)
    if status_code >= 500:
        return RetryableError(text, retry_after=retry_after, status_code=status_code, error_class="server_error", body=body)
    if status_code in RETRYABLE_STATUS:
        return RetryableError(
            text, retry_after=retry_after, status_code=status_code, error_class="retryable_status", body=body
        )
    return PermanentError(text, status_code=status_code, body=body)


# Clients made by make_client, with the transport and timeouts to send on directly.
_DIRECT: weakref.WeakKeyDictionary[httpx.AsyncClient, tuple[httpx.AsyncBaseTransport, dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)


def make_client(spec: JobSpec, *, transport: str = "aiohttp") -> httpx.AsyncClient:
    """The one AsyncClient of a run: explicit timeouts and limits, aiohttp transport by default.

    :func:`send` hands requests made for this client straight to its transport
    (``handle_async_request``, httpx's transport API): the client's per-request
    layers — cookies, auth, redirects, default headers, event hooks — are unused
    here and cost about 40% of the client's CPU per request.
    """
    timeout = httpx.Timeout(spec.run.timeout, connect=spec.run.connect_timeout)
    limits = httpx.Limits(
        max_connections=spec.run.concurrency + 8, max_keepalive_connections=spec.run.concurrency + 8
    )
    sender: httpx.AsyncBaseTransport
    if transport == "httpx":
        sender = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    elif transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        sender = AiohttpTransport(limits=limits, trust_env=False)
    else:
        raise ValueError(f"unknown transport {transport!r}: expected aiohttp or httpx")
    client = httpx.AsyncClient(transport=sender, timeout=timeout, follow_redirects=False, trust_env=False)
    _DIRECT[client] = (sender, timeout.as_dict())
    return client


async def send(
    client: httpx.AsyncClient, provider: Provider, request: PreparedRequest, *, total_timeout: float
) -> Reply:
    """One attempt: POST, read the whole answer (plain or streamed) within ``total_timeout``, parse.

    Transport failures become RetryableError with class ``timeout``,
    ``connection``, ``truncated_body`` or, for a stream that breaks midway,
    ``stream_broken`` (never a half answer); statuses are classified by the
    provider. Registered secrets are masked in every error and body.
    """
    try:
        return await _send(client, provider, request, total_timeout)
    except ProviderError as exc:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (redact(exc.args[0]), *exc.args[1:])
        exc.body = redact_optional(exc.body)
        raise


async def _send(client: httpx.AsyncClient, provider: Provider, request: PreparedRequest, total_timeout: float) -> Reply:
    started = time.perf_counter()
    response: httpx.Response | None = None
    first_token: float | None = None
    last_token = 0.0
    try:
        async with asyncio.timeout(total_timeout):
            direct = _DIRECT.get(client)
            if direct is not None:
                transport, timeouts = direct
                response = await transport.handle_async_request(_http_request(request, timeouts))
            else:  # a client the caller made (tests inject their own)
                response = await client.send(
                    client.build_request("POST", request.url, headers=request.headers, content=request.content),
                    stream=True,
                )
            try:
                if request.stream and 200 <= response.status_code < 300 and _is_event_stream(response):
                    assembler = provider.stream_assembler()
                    async for event in EventSource(response).aiter_sse():
                        if assembler.feed(event.event, event.data):
                            last_token = time.perf_counter()
                            if first_token is None:
                                first_token = last_token
                    content = assembler.body()
                else:
                    content = await response.aread()
            except httpx.DecodingError as exc:
                raise RetryableError(
                    f"response body could not be decoded: {exc}", status_code=response.status_code,
                    error_class="bad_response",
                ) from exc
            except (httpx.TransportError, aiohttp.ClientError, OSError, SSEError) as exc:
                what, error_class = (
                    ("stream broke off", "stream_broken") if request.stream else ("response body cut short", "truncated_body")
                )
                raise RetryableError(
                    f"{what}: {_describe(exc)}", status_code=response.status_code, error_class=error_class
                ) from exc
            finally:
                await response.aclose()
    except TimeoutError as exc:
        raise RetryableError(f"no complete answer within {total_timeout:g} s", error_class="timeout") from exc
    except (httpx.TransportError, aiohttp.ClientError, OSError) as exc:
        error_class = transport_error_class(exc)
        what = "timed out" if error_class == "timeout" else "connection failed"
        raise RetryableError(f"{what}: {_describe(exc)}", error_class=error_class) from exc
    latency_ms = (time.perf_counter() - started) * 1000.0
    try:
        reply = provider.parse(response.status_code, response.headers, content, latency_ms=latency_ms)
    except ProviderError as exc:
        exc.headers = response.headers
        raise
    if contains_secret(reply.body):
        reply = dataclasses.replace(reply, body=redact(reply.body), output=redact_optional(reply.output))
    if first_token is None:
        return reply
    ttft_ms = (first_token - started) * 1000.0
    tokens = reply.output_tokens or 0
    tpot_ms = (last_token - first_token) * 1000.0 / (tokens - 1) if tokens > 1 else None
    return dataclasses.replace(reply, ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def _http_request(request: PreparedRequest, timeouts: dict[str, Any]) -> httpx.Request:
    """The httpx request for a transport, with the headers httpx would add (Host, Content-Length) set here.

    ``httpx.Request(content=...)`` looks its headers up one by one to add those
    two and rebuilds them: 36 µs a request here, against 11 µs for the same
    request built from a body stream and read at once (the transport sends a
    read request's bytes as one body).
    """
    url = _parsed_url(request.url)
    headers = httpx.Headers(
        [(b"Host", url.netloc), *httpx.Headers(request.headers).raw, (b"Content-Length", b"%d" % len(request.content))]
    )
    http_request = httpx.Request(
        "POST", url, headers=headers, stream=httpx.ByteStream(request.content), extensions={"timeout": timeouts}
    )
    http_request.read()
    return http_request


@functools.lru_cache(maxsize=64)
def _parsed_url(url: str) -> httpx.URL:
    """An endpoint parsed once: a job has one or a few, and parsing costs more than the rest of the request."""
    return httpx.URL(url)


def _is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.partition(";")[0].strip() == "text/event-stream"


def stream_error(message: str) -> RetryableError:
    """A stream that ended (cleanly, as far as HTTP goes) before its final event."""
    return RetryableError(f"stream ended early: {message}", error_class="stream_broken")


def transport_error_class(exc: BaseException) -> str:
    """``timeout`` or ``connection``, judged by the underlying error.

    httpx-aiohttp maps every aiohttp connection error (a reset included) to
    httpx.ConnectTimeout, so the aiohttp cause decides when there is one.
    """
    cause = exc.__cause__
    if isinstance(cause, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout"
    if isinstance(cause, (aiohttp.ClientError, OSError)):
        return "connection"
    return "timeout" if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)) else "connection"


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__
    text = str(exc) or type(exc).__name__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} ({type(cause).__name__}: {cause})"
    elif not str(exc):
        text = type(cause).__name__ if cause is not None else type(exc).__name__
    return text


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
