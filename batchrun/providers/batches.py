"""What the providers' batch APIs share: the :class:`BatchApi` protocol, the shapes batch mode reads
(:class:`RemoteBatch`, :class:`ResultLine`), and :class:`BatchHttp`, their HTTP calls.

Each API has its module (:mod:`.openai_batch`: Files + Batch; :mod:`.anthropic_batch`:
Message Batches) and is named by its kind's entry in :mod:`batchrun.provider_registry`.
A batch API is built over the kind's online :class:`~batchrun.providers.base.Provider`:
the same base URL, key and headers, and the same ``parse`` reads a results line's answer
as it reads an online one, so an answer is classified, priced and validated alike
whichever way it came.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay, wait_exponential
from tenacity.wait import wait_base

from batchrun.errors import PermanentError, ProviderError, RetryableError
from batchrun.providers.base import PreparedRequest, Provider
from batchrun.providers.http import transport_error_class, transport_error_what

if TYPE_CHECKING:
    from batchrun.ledger.shards import ShardRecord


@dataclass(frozen=True)
class BatchLineError:
    """Why the provider refused a batch, or one line of it."""

    code: str | None
    message: str
    line: int | None = None  # 1-based line of the request file, when the provider names one


@dataclass(frozen=True)
class RemoteBatch:
    """A provider batch as its API describes it, in the words batch mode reads."""

    id: str
    status: str  # the provider's own word (validating, in_progress, ended, ...)
    ended: bool  # the provider is done with it: its results can be read
    refused: bool = False  # it ended without working any line (validation, a token limit)
    errors: tuple[BatchLineError, ...] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    total: int | None = None  # requests in it, when the provider says
    created_at: float | None = None
    in_progress_at: float | None = None
    ended_at: float | None = None
    expires_at: float | None = None
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    token: str | None = None  # the shard token it carries (OpenAI metadata), if any


@dataclass(frozen=True)
class ResultLine:
    """One line of a batch's results: an answer (any status), or a request never worked."""

    custom_id: str
    status_code: int | None = None  # the answer's HTTP status; None when there was no answer
    body: bytes | None = None  # the answer's body: a 2xx one, or an error body
    request_id: str | None = None
    unworked: str | None = None  # "expired" or "cancelled": never worked, never billed


@dataclass(frozen=True)
class Candidate:
    """A provider batch that may be a shard's own (reconciliation)."""

    batch: RemoteBatch
    certain: bool  # it carries the shard's own name (metadata, input file); else it only looks alike


@dataclass(frozen=True)
class FileFormat:
    """How a request file frames its entries: ``head``, entries joined by ``separator``, ``tail``."""

    head: bytes
    separator: bytes
    tail: bytes


class BatchApi(Protocol):
    """One provider's batch API, as batch mode drives it."""

    kind: str
    max_requests: int  # the provider's requests per batch
    max_bytes: int  # the provider's bytes per request file (or create body)
    file_format: FileFormat

    def create_timeout(self, request_bytes: int) -> float:
        """The provider's default for how long a create call of a request file this big may take."""
        ...

    def endpoint_of(self, url: str | None) -> str | None:
        """The endpoint a stored item is sent to ("/v1/chat/completions"; None where the API has one)."""
        ...

    def accepts_custom_id(self, custom_id: str) -> bool:
        """Whether an item's own custom_id can name its line."""
        ...

    def line(self, custom_id: str, endpoint: str | None, request: PreparedRequest) -> bytes:
        """The request file's entry for one request (no framing)."""
        ...

    async def upload(self, shard: ShardRecord, path: Path) -> str | None:
        """Upload the request file; its file id (None where the API takes the requests with create)."""
        ...

    async def find_upload(self, shard: ShardRecord) -> str | None:
        """The file an earlier upload of this shard left at the provider (its response lost), if any."""
        ...

    async def create(self, shard: ShardRecord, path: Path, timeout: float) -> RemoteBatch:
        """Create the batch, its call given ``timeout`` seconds. Any error but a refusal (PermanentError)
        leaves whether it exists unknown."""
        ...

    async def get(self, batch_id: str) -> RemoteBatch:
        ...

    async def candidates(self, shard: ShardRecord, sent_at: float, timeout: float) -> list[Candidate]:
        """Provider batches that may be this shard's, created but never recorded (``sent_at``: when its
        last create was sent, by this host's clock; ``timeout``: the time that create had)."""
        ...

    async def cancel(self, batch_id: str) -> RemoteBatch:
        ...

    def results(self, batch: RemoteBatch, shard: ShardRecord) -> AsyncIterator[ResultLine]:
        """Every results line of an ended batch (streamed through a file on disk, any order)."""
        ...

    async def discard(self, shard: ShardRecord) -> None:
        """Delete what the shard left at the provider (files; the batch where it can be deleted)."""
        ...

    async def aclose(self) -> None:
        ...


class BatchRefusedError(ProviderError):
    """The provider refused to create the batch (a 4xx on create): it does not exist.

    ``line`` is the 1-based line of the request file it names as the cause, when it names one.
    """

    error_class = "batch_refused"

    def __init__(self, message: str | None = None, *, line: int | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.line = line


def refused(exc: PermanentError, *, line: int | None = None) -> BatchRefusedError:
    """A create's 4xx (a retryable status is a RetryableError, never this) as the refusal it is."""
    return BatchRefusedError(exc.message, line=line, status_code=exc.status_code, body=exc.body)


class _WaitRetryAfter(wait_base):
    def __init__(self, fallback: wait_base) -> None:
        self.fallback = fallback

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, RetryableError) and exc.retry_after is not None:
            return exc.retry_after + random.uniform(0.0, 0.5)
        return self.fallback(retry_state)


class BatchHttp:
    """A batch API's HTTP calls: JSON in and out, files streamed both ways.

    A 429, 5xx, timeout or dropped connection is retried with backoff (honouring
    ``Retry-After``) for up to ``retry_seconds``; a call that must not be repeated
    (create) is made once. A non-2xx answer is read by the kind's online provider,
    so its error message and class are those of an online request.
    """

    def __init__(
        self,
        provider: Provider,
        headers: httpx.Headers,
        *,
        timeout: httpx.Timeout,
        retry_seconds: float = 300.0,
        backoff_initial: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.provider = provider
        self.headers = headers
        self.retry_seconds = retry_seconds
        self.backoff_initial = backoff_initial
        self.client = httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False, follow_redirects=True)
        self._skews: list[float] = []

    async def json(self, method: str, url: str, *, retry: bool = True, **kwargs: Any) -> Any:
        """A call whose answer is a JSON object; the object."""
        response = await self.call(method, url, retry=retry, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise RetryableError(
                f"{method} {url}: HTTP {response.status_code} with a body that is not JSON: {response.text[:200]!r}",
                status_code=response.status_code, error_class="bad_response",
            ) from exc

    async def call(self, method: str, url: str, *, retry: bool = True, **kwargs: Any) -> httpx.Response:
        """One call, retried while it fails transiently (unless ``retry`` is False); the 2xx response."""
        if not retry:
            return await self._once(method, url, **kwargs)
        async for attempt in self._retrying():
            with attempt:
                return await self._once(method, url, **kwargs)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def download(self, url: str, into: Path) -> None:
        """Stream a file's content to ``into`` (started again from its first byte after a failure)."""
        async for attempt in self._retrying():
            with attempt:
                try:
                    async with self.client.stream("GET", url, headers=self._headers({"accept": "*/*"})) as response:
                        if not 200 <= response.status_code < 300:
                            self._raise(response, await response.aread())
                        with into.open("wb") as out:
                            async for chunk in response.aiter_bytes(1 << 16):
                                out.write(chunk)
                except httpx.TransportError as exc:
                    raise _transport_error(exc) from exc

    async def delete(self, url: str) -> None:
        """Delete a file or batch; one already gone (404) is what was wanted."""
        try:
            await self.call("DELETE", url)
        except PermanentError as exc:
            if exc.status_code != 404:
                raise

    async def pages(
        self, url: str, params: Mapping[str, Any], *, cursor: str, max_pages: int
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """A list endpoint's pages (newest first at both providers), the next one asked for with
        ``cursor=<last id>`` while ``has_more``; at most ``max_pages``."""
        after: str | None = None
        for _ in range(max_pages):
            page = await self.json("GET", url, params={**params, **({cursor: after} if after else {})})
            data = [d for d in page.get("data") or [] if isinstance(d, dict)]
            yield data
            after = page.get("last_id") or (str(data[-1].get("id")) if data else None)
            if not page.get("has_more") or not data or not after:
                return

    async def aclose(self) -> None:
        await self.client.aclose()

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_delay(self.retry_seconds),
            wait=_WaitRetryAfter(wait_exponential(multiplier=self.backoff_initial, max=30.0)),
            retry=retry_if_exception_type(RetryableError),
            reraise=True,
        )

    async def _once(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        headers = self._headers(kwargs.pop("headers", None), multipart="files" in kwargs)
        try:
            response = await self.client.request(method, url, headers=headers, **kwargs)
        except httpx.TransportError as exc:
            raise _transport_error(exc) from exc
        self._note_clock(response)
        if not 200 <= response.status_code < 300:
            self._raise(response, response.content)
        return response

    def _note_clock(self, response: httpx.Response) -> None:
        """How far the provider's clock is ahead of ours (its ``Date`` header; whole seconds)."""
        date = response.headers.get("date")
        if not date:
            return
        try:
            theirs = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return
        self._skews.append(theirs - time.time())
        del self._skews[:-9]

    @property
    def clock_skew(self) -> float:
        """The provider's clock minus ours, in seconds (the median of the latest answers; 0 before any)."""
        if not self._skews:
            return 0.0
        return sorted(self._skews)[len(self._skews) // 2]

    def _headers(self, extra: Mapping[str, str] | None, *, multipart: bool = False) -> httpx.Headers:
        headers = httpx.Headers(self.headers)
        if multipart:  # httpx sets the multipart content type with its boundary
            headers.pop("content-type", None)
        headers.update(extra or {})
        return headers

    def _raise(self, response: httpx.Response, content: bytes) -> None:
        """The provider's reading of an error answer, raised (always raises for a non-2xx)."""
        self.provider.parse(response.status_code, response.headers, content, latency_ms=0.0)
        raise RetryableError(f"HTTP {response.status_code}", status_code=response.status_code)  # pragma: no cover


def _transport_error(exc: httpx.TransportError) -> RetryableError:
    error_class = transport_error_class(exc)
    return RetryableError(f"{transport_error_what(error_class)}: {exc or type(exc).__name__}", error_class=error_class)


@contextlib.contextmanager
def spooled(prefix: str) -> Iterator[Path]:
    """A temporary file's path, removed at the end of the block."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".jsonl")
    os.close(fd)
    try:
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def lines_of(path: Path) -> Iterator[bytes]:
    """The non-empty lines of a results file, streamed."""
    with path.open("rb") as f:
        for raw in f:
            line = raw.strip()
            if line:
                yield line
