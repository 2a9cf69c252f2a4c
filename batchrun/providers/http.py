"""The HTTP side of every provider: the run's :class:`Sender`, reading plain and streamed
(SSE) answers, and turning transport failures and HTTP statuses into our error classes.

A provider says what to send and how to read the answer; this module sends it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import functools
import socket
import ssl
import time
from types import TracebackType
from typing import Any

import aiohttp
import httpx
from httpx_sse import EventSource, SSEError

from batchrun.errors import CONNECT_ERRORS, AuthError, PermanentError, ProviderError, RateLimitedError, RetryableError
from batchrun.providers.base import PreparedRequest, Provider, Reply
from batchrun.redact import contains_secret, redact, redact_optional
from batchrun.spec import JobSpec

RETRYABLE_STATUS = frozenset({408, 409, 425})
TRANSPORTS = ("aiohttp", "httpx")  # aiohttp: the fast one; httpx's own: for comparison and tests


class Sender:
    """The one HTTP client of a run: explicit timeouts and limits, closed with :meth:`aclose`
    (or ``async with``).

    Requests go straight to the transport (``handle_async_request``, httpx's
    transport API): an ``httpx.AsyncClient``'s per-request layers — cookies,
    auth, redirects, default headers, event hooks — are unused here and cost
    about 40% of the client's CPU per request. Tests inject any httpx transport
    (``httpx.MockTransport``, say).
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> None:
        self._transport = transport
        self._timeouts = timeout.as_dict()

    @classmethod
    def for_spec(cls, spec: JobSpec, *, transport: str = "aiohttp") -> Sender:
        """A sender sized for the spec's concurrency, on the aiohttp transport or httpx's own."""
        limits = httpx.Limits(
            max_connections=spec.run.concurrency + 8, max_keepalive_connections=spec.run.concurrency + 8
        )
        verify = tls_context(spec.provider.base_url)
        pool: httpx.AsyncBaseTransport
        if transport == "httpx":
            pool = httpx.AsyncHTTPTransport(verify=verify, limits=limits, trust_env=False)
        elif transport == "aiohttp":
            from httpx_aiohttp import AiohttpTransport

            pool = AiohttpTransport(verify=verify, limits=limits, trust_env=False)
        else:
            raise ValueError(f"unknown transport {transport!r}: expected {' or '.join(TRANSPORTS)}")
        return cls(pool, httpx.Timeout(spec.run.timeout, connect=spec.run.connect_timeout))

    async def send(self, provider: Provider, request: PreparedRequest, *, total_timeout: float) -> Reply:
        """One attempt: POST, read the whole answer (plain or streamed) within ``total_timeout``, parse.

        Transport failures become RetryableError with class ``timeout``,
        ``connection``, ``truncated_body`` or, for a stream that breaks midway,
        ``stream_broken`` (never a half answer); statuses are classified by the
        provider. Registered secrets are masked in every error and body.
        """
        try:
            return await self._send(provider, request, total_timeout)
        except ProviderError as exc:
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (redact(exc.args[0]), *exc.args[1:])
            exc.body = redact_optional(exc.body)
            raise

    async def aclose(self) -> None:
        """Close the connections."""
        await self._transport.aclose()

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _send(self, provider: Provider, request: PreparedRequest, total_timeout: float) -> Reply:
        started = time.perf_counter()
        response: httpx.Response | None = None
        first_token: float | None = None
        last_token = 0.0
        try:
            async with asyncio.timeout(total_timeout):
                response = await self._transport.handle_async_request(_http_request(request, self._timeouts))
                headers_at = time.perf_counter()  # time to first byte: the transport returns on the headers
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
                        content = await _read_body(response)
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
            raise RetryableError(f"{transport_error_what(error_class)}: {_describe(exc)}", error_class=error_class) from exc
        latency_ms = (time.perf_counter() - started) * 1000.0
        try:
            reply = provider.parse(
                response.status_code, response.headers, content, latency_ms=latency_ms,
                ttfb_ms=(headers_at - started) * 1000.0,
            )
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


def tls_context(base_url: str | None) -> ssl.SSLContext | bool:
    """``True`` (httpx's verified context on certifi's CAs) unless the job's endpoint is plain http.

    Every request of a run goes to its base URL, and loading certifi's bundle costs
    30-90 ms of start-up here that a plain-http endpoint (a local server) never uses
    (aiohttp loads the system store at import anyway). Such a job gets a context that
    trusts no certificate at all, so it could never carry an unverified TLS connection.
    """
    if base_url is None or not base_url.lower().startswith("http://"):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies hostnames and certificates, against no CAs


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


def transport_error_class(exc: BaseException) -> str:
    """``timeout``, ``connection_refused``, ``dns``, ``tls`` or ``connection`` (a reset, anything
    else), judged by the underlying errors.

    httpx-aiohttp maps every aiohttp connection error (a reset included) to
    httpx.ConnectTimeout, so the aiohttp cause decides when there is one.
    """
    cause = exc.__cause__
    if isinstance(cause, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout"
    for err in _chain(exc):
        if isinstance(err, (ssl.SSLError, ssl.CertificateError, aiohttp.ClientSSLError)):
            return "tls"
        if isinstance(err, socket.gaierror):
            return "dns"
        if isinstance(err, ConnectionRefusedError):
            return "connection_refused"
    if isinstance(cause, (aiohttp.ClientError, OSError)):
        return "connection"
    return "timeout" if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)) else "connection"


def transport_error_what(error_class: str) -> str:
    """The words a transport error's message starts with."""
    return "timed out" if error_class == "timeout" else CONNECT_ERRORS.get(error_class, "connection failed")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, its causes and contexts, and the OS errors aiohttp wraps (``os_error``), a few deep."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 12:
        err = todo.pop()
        if err is None or any(err is s for s in seen):
            continue
        seen.append(err)
        todo += [err.__cause__, err.__context__, getattr(err, "os_error", None)]
    return seen


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


async def _read_body(response: httpx.Response) -> bytes:
    """The whole body of a plain answer.

    From the aiohttp transport, a body that needs no decoding is read in one call
    to aiohttp: httpx's chunk iterators around it cost about 7 % of the client's
    CPU per request (bench/RESULTS.md). A compressed one (aiohttp asks for gzip and
    deflate) is left to httpx, which decodes it.
    """
    raw = getattr(response.stream, "_aiohttp_response", None)  # httpx_aiohttp.AiohttpResponseStream's
    if raw is not None and "content-encoding" not in response.headers:
        body: bytes = await raw.read()
        return body
    return await response.aread()


def _is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.partition(";")[0].strip() == "text/event-stream"


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__
    text = str(exc) or type(exc).__name__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} ({type(cause).__name__}: {cause})"
    elif not str(exc):
        text = type(cause).__name__ if cause is not None else type(exc).__name__
    return text
