"""Anthropic's Message Batches (kind ``anthropic``): ``POST /v1/messages/batches`` with the requests
inline, results as JSONL from the batch's ``results_url``.

Quirks it owns: there is no file to upload, so the create body (up to 256 MB) is
built on disk and streamed; a ``custom_id`` must match ``^[a-zA-Z0-9_-]{1,64}$``;
times are RFC 3339 strings; request counts move only when the batch ends; an
``errored`` result carries an error type, not a status (mapped to the status the
online API answers that type with, so it is classified as an online error); and
a batch carries no metadata, so its lines name their shard (``<tag>_<item id>``) and a
batch created but never recorded is recognised by when it was created, how many requests
it holds, and — once it has ended — the line ids of its results
(:meth:`AnthropicBatchApi.candidates`).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from batchrun.errors import PermanentError
from batchrun.providers.base import PreparedRequest
from batchrun.providers.batches import (
    BatchHttp,
    Candidate,
    FileFormat,
    RemoteBatch,
    ResultLine,
    lines_of,
    refused,
    spooled,
)

if TYPE_CHECKING:
    from batchrun.ledger.shards import ShardRecord
    from batchrun.providers.anthropic import AnthropicProvider

MAX_REQUESTS = 100_000
MAX_BYTES = 256 * 1000 * 1000  # "256 MB"
# The status the online Messages API answers each error type with.
ERROR_STATUS = {
    "invalid_request_error": 400, "authentication_error": 401, "billing_error": 402, "permission_error": 403,
    "not_found_error": 404, "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
    "timeout_error": 504, "overloaded_error": 529,
}
UNWORKED = {"expired": "expired", "canceled": "cancelled"}
REQUEST_INDEX = re.compile(r"\brequests\.(\d+)\b")
LIST_PAGES = 20  # reconciliation looks at most this many pages of 100 batches (newest first)
CREATE_TIMEOUT_S = 60.0  # a create call's default timeout, plus 8 s per MB of its body
SKEW_S = 300.0  # the provider's clock and ours may differ by this much


class AnthropicBatchApi:
    """Message Batches over an :class:`~batchrun.providers.anthropic.AnthropicProvider` (its base URL and key)."""

    kind = "anthropic"
    max_requests = MAX_REQUESTS
    max_bytes = MAX_BYTES
    file_format = FileFormat(b'{"requests":[', b",", b"]}")

    def __init__(self, provider: AnthropicProvider, *, timeout: httpx.Timeout, retry_seconds: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.provider = provider
        self.batches_url = provider.endpoint(None) + "/batches"
        self.http = BatchHttp(provider, provider.headers, timeout=timeout, retry_seconds=retry_seconds,
                              transport=transport)

    def create_timeout(self, request_bytes: int) -> float:
        """A minute, and 8 s per MB of body: the requests go with the create (up to 256 MB), and a
        create cut off by its timeout while its body is still going out is sent again (1 Mbit/s fits)."""
        return CREATE_TIMEOUT_S + 8 * request_bytes / 1e6

    def endpoint_of(self, url: str | None) -> None:
        return None

    def accepts_custom_id(self, custom_id: str) -> bool:
        """Never: a batch carries no metadata, so its lines name their shard ("<shard tag>_<item id>",
        which Anthropic's ``^[a-zA-Z0-9_-]{1,64}$`` takes): results then tell a shard's batch from any
        look-alike, whatever the items' own custom_ids."""
        return False

    def line(self, custom_id: str, endpoint: str | None, request: PreparedRequest) -> bytes:
        return orjson.dumps({"custom_id": custom_id, "params": orjson.Fragment(request.content)})

    async def upload(self, shard: ShardRecord, path: Path) -> None:
        return None  # the requests go with the create call

    async def find_upload(self, shard: ShardRecord) -> None:
        return None

    async def create(self, shard: ShardRecord, path: Path, timeout: float) -> RemoteBatch:
        size = path.stat().st_size

        async def body() -> AsyncIterator[bytes]:
            with path.open("rb") as f:
                while chunk := f.read(1 << 16):
                    yield chunk

        try:
            data = await self.http.json(
                "POST", self.batches_url, content=body(), headers={"content-length": str(size)}, retry=False,
                timeout=httpx.Timeout(timeout),
            )
        except PermanentError as exc:
            # "requests.17.params.max_tokens: ...": the request it names (0-based) is the file's line 18.
            named = REQUEST_INDEX.search(exc.message)
            raise refused(exc, line=int(named.group(1)) + 1 if named else None) from exc
        return batch_of(data)

    async def get(self, batch_id: str) -> RemoteBatch:
        return batch_of(await self.http.json("GET", f"{self.batches_url}/{batch_id}"))

    async def candidates(self, shard: ShardRecord, sent_at: float, timeout: float) -> list[Candidate]:
        """Batches created around the shard's create call (``sent_at``, our clock; the provider's is read
        from its ``Date`` headers) holding as many requests as it does.

        None is certain (there is no metadata): the caller adopts one only once it has ended
        and its results carry the shard's own line ids.
        """
        sent = sent_at + self.http.clock_skew
        window = (sent - SKEW_S, sent + timeout + SKEW_S)
        found: list[Candidate] = []
        async for page in self.http.pages(self.batches_url, {"limit": 100}, cursor="after_id", max_pages=LIST_PAGES):
            batches = [batch_of(b) for b in page]
            for batch in batches:
                if (batch.created_at is not None and window[0] <= batch.created_at <= window[1]
                        and batch.total == shard.requests):
                    found.append(Candidate(batch, certain=False))
            created = [b.created_at for b in batches if b.created_at is not None]
            if created and max(created) < window[0]:
                break
        return found

    async def cancel(self, batch_id: str) -> RemoteBatch:
        return batch_of(await self.http.json("POST", f"{self.batches_url}/{batch_id}/cancel"))

    async def results(self, batch: RemoteBatch, shard: ShardRecord) -> AsyncIterator[ResultLine]:
        with spooled(f"batchrun-{shard.token}-") as path:
            await self.http.download(f"{self.batches_url}/{batch.id}/results", path)
            for raw in lines_of(path):
                line = result_line(raw)
                if line is not None:
                    yield line

    async def discard(self, shard: ShardRecord) -> None:
        if shard.batch_id:
            await self.http.delete(f"{self.batches_url}/{shard.batch_id}")

    async def aclose(self) -> None:
        await self.http.aclose()


def batch_of(data: Mapping[str, Any]) -> RemoteBatch:
    """A ``message_batch`` object in batch mode's words."""
    status = str(data.get("processing_status"))
    counts_value = data.get("request_counts")
    counts = {k: int(v) for k, v in counts_value.items() if isinstance(v, int)} if isinstance(counts_value, dict) else {}
    return RemoteBatch(
        id=str(data.get("id")),
        status=status,
        ended=status == "ended",
        counts=counts,
        total=sum(counts.values()) if counts else None,
        created_at=_seconds(data.get("created_at")),
        ended_at=_seconds(data.get("ended_at")),
        expires_at=_seconds(data.get("expires_at")),
    )


def result_line(raw: bytes) -> ResultLine | None:
    """One line of a results file; None for a line that names no request."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("custom_id"), str):
        return None
    custom_id = data["custom_id"]
    result_value = data.get("result")
    result: dict[str, Any] = result_value if isinstance(result_value, dict) else {}
    kind = result.get("type")
    if kind == "succeeded":
        message = result.get("message")
        request_id = message.get("id") if isinstance(message, dict) else None
        return ResultLine(custom_id, status_code=200, body=orjson.dumps(message), request_id=request_id)
    if kind in UNWORKED:
        return ResultLine(custom_id, unworked=UNWORKED[kind])
    error_value = result.get("error")
    error: dict[str, Any] = error_value if isinstance(error_value, dict) else {}
    inner_value = error.get("error")
    inner: dict[str, Any] = inner_value if isinstance(inner_value, dict) else error
    status = ERROR_STATUS.get(str(inner.get("type")), 500)
    body = error if error.get("type") == "error" else {"type": "error", "error": inner or {"message": "errored"}}
    return ResultLine(custom_id, status_code=status, body=orjson.dumps(body))


def _seconds(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
