"""OpenAI's Batch API (kinds ``openai`` and ``openai-responses``): a JSONL file uploaded to
``/v1/files``, then ``/v1/batches``.

Quirks it owns: one endpoint and one model per file; the batch carries ``metadata``
naming the shard (``batchrun_shard``), and the file is named after it, so a batch
created (or a file uploaded) whose answer was lost is found again by name; results
come in two files, either of which may be missing (``output_file_id`` is null when
every line failed, ``error_file_id`` null or "" when none did); a line whose
``response.status_code`` is not 2xx is a failure even with ``error: null``; lines
never worked carry ``error.code`` ``batch_expired`` or ``batch_cancelled``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from batchrun.errors import PermanentError
from batchrun.providers.base import PreparedRequest
from batchrun.providers.batches import (
    BatchHttp,
    BatchLineError,
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
    from batchrun.providers.openai import OpenAIProvider

MAX_REQUESTS = 50_000
MAX_BYTES = 200 * 1000 * 1000  # "up to 200 MB"
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
UNWORKED = {"batch_expired": "expired", "batch_cancelled": "cancelled"}
LIST_PAGES = 20  # reconciliation looks at most this many pages of 100 batches (newest first)
CREATE_TIMEOUT_S = 60.0  # a create call's default timeout ([batch] create_timeout)
LOOK_BACK_S = 3600.0  # ... and no further back than this before the shard's create call


def _name(shard: ShardRecord) -> str:
    return f"batchrun-{shard.token}.jsonl"


class OpenAIBatchApi:
    """Files + Batches over an :class:`~batchrun.providers.openai.OpenAIProvider` (its base URL and key)."""

    max_requests = MAX_REQUESTS
    max_bytes = MAX_BYTES
    file_format = FileFormat(b"", b"\n", b"\n")

    def __init__(self, provider: OpenAIProvider, *, timeout: httpx.Timeout, retry_seconds: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.kind = provider.kind
        self.provider = provider
        self.http = BatchHttp(provider, provider.headers, timeout=timeout, retry_seconds=retry_seconds,
                              transport=transport)

    def create_timeout(self, request_bytes: int) -> float:
        return CREATE_TIMEOUT_S  # the file is uploaded already: the create body is small

    def _url(self, path: str) -> str:
        return self.provider.endpoint("/v1" + path)

    def endpoint_of(self, url: str | None) -> str:
        return url if url else "/v1" + self.provider.path

    def accepts_custom_id(self, custom_id: str) -> bool:
        return True

    def line(self, custom_id: str, endpoint: str | None, request: PreparedRequest) -> bytes:
        return orjson.dumps(
            {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": orjson.Fragment(request.content)}
        )

    async def upload(self, shard: ShardRecord, path: Path) -> str:
        # Sent once: a failed upload may have stored the file (the caller looks for it by name
        # before sending it again), and a retry here would resend a half-read file object.
        with path.open("rb") as f:
            data = await self.http.json(
                "POST", self._url("/files"), data={"purpose": "batch"},
                files={"file": (_name(shard), f, "application/jsonl")}, retry=False,
            )
        return str(data["id"])

    async def find_upload(self, shard: ShardRecord) -> str | None:
        name = _name(shard)
        async for files in self.http.pages(self._url("/files"), {"purpose": "batch", "limit": 1000, "order": "desc"},
                                           cursor="after", max_pages=LIST_PAGES):
            for f in files:
                if f.get("filename") == name:
                    return str(f["id"])
        return None

    async def create(self, shard: ShardRecord, path: Path, timeout: float) -> RemoteBatch:
        body = {
            "input_file_id": shard.input_file_id,
            "endpoint": shard.endpoint,
            "completion_window": "24h",
            "metadata": {"batchrun_shard": shard.token, "batchrun_job": str(shard.job_id)},
        }
        try:
            data = await self.http.json("POST", self._url("/batches"), json=body, retry=False,
                                        timeout=httpx.Timeout(timeout))
        except PermanentError as exc:
            raise refused(exc) from exc
        return batch_of(data)

    async def get(self, batch_id: str) -> RemoteBatch:
        return batch_of(await self.http.json("GET", self._url(f"/batches/{batch_id}")))

    async def candidates(self, shard: ShardRecord, sent_at: float, timeout: float) -> list[Candidate]:
        """Batches carrying this shard's name in their metadata, or made from its uploaded file (certain)."""
        since = sent_at + self.http.clock_skew - LOOK_BACK_S
        found: list[Candidate] = []
        async for page in self.http.pages(self._url("/batches"), {"limit": 100}, cursor="after", max_pages=LIST_PAGES):
            batches = [batch_of(b) for b in page]
            for batch in batches:
                if batch.token == shard.token or (shard.input_file_id and batch.input_file_id == shard.input_file_id):
                    found.append(Candidate(batch, certain=True))
            created = [b.created_at for b in batches if b.created_at is not None]
            if created and max(created) < since:
                break
        return found

    async def cancel(self, batch_id: str) -> RemoteBatch:
        return batch_of(await self.http.json("POST", self._url(f"/batches/{batch_id}/cancel")))

    async def results(self, batch: RemoteBatch, shard: ShardRecord) -> AsyncIterator[ResultLine]:
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not file_id:  # null when every line failed (output) or none did (errors, also "")
                continue
            with spooled(f"batchrun-{shard.token}-") as path:
                await self.http.download(self._url(f"/files/{file_id}/content"), path)
                for raw in lines_of(path):
                    line = result_line(raw)
                    if line is not None:
                        yield line

    async def discard(self, shard: ShardRecord) -> None:
        for file_id in dict.fromkeys((shard.input_file_id, shard.output_file_id, shard.error_file_id)):
            if file_id:
                await self.http.delete(self._url(f"/files/{file_id}"))

    async def aclose(self) -> None:
        await self.http.aclose()


def batch_of(data: Mapping[str, Any]) -> RemoteBatch:
    """A ``batch`` object in batch mode's words."""
    status = str(data.get("status"))
    counts_value = data.get("request_counts")
    counts = {k: int(v) for k, v in counts_value.items() if isinstance(v, int)} if isinstance(counts_value, dict) else {}
    errors_value = data.get("errors")
    errors = tuple(
        BatchLineError(code=e.get("code"), message=str(e.get("message") or e.get("code") or "refused"),
                       line=e.get("line") if isinstance(e.get("line"), int) else None)
        for e in ((errors_value or {}).get("data") or [] if isinstance(errors_value, dict) else [])
        if isinstance(e, dict)
    )
    metadata = data.get("metadata")
    ended_at = next(
        (data.get(k) for k in ("completed_at", "failed_at", "expired_at", "cancelled_at") if data.get(k)), None
    )
    return RemoteBatch(
        id=str(data.get("id")),
        status=status,
        ended=status in TERMINAL,
        refused=status == "failed",
        errors=errors,
        counts=counts,
        total=counts.get("total"),
        created_at=_seconds(data.get("created_at")),
        in_progress_at=_seconds(data.get("in_progress_at")),
        ended_at=_seconds(ended_at),
        expires_at=_seconds(data.get("expires_at")),
        input_file_id=data.get("input_file_id") or None,
        output_file_id=data.get("output_file_id") or None,
        error_file_id=data.get("error_file_id") or None,
        token=metadata.get("batchrun_shard") if isinstance(metadata, dict) else None,
    )


def result_line(raw: bytes) -> ResultLine | None:
    """One line of an output or error file; None for a line that names no request."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("custom_id"), str):
        return None
    custom_id = data["custom_id"]
    response = data.get("response")
    if isinstance(response, dict) and isinstance(response.get("status_code"), int):
        body = response.get("body")
        return ResultLine(
            custom_id, status_code=response["status_code"],
            body=body.encode() if isinstance(body, str) else orjson.dumps(body),
            request_id=response.get("request_id") or None,
        )
    error = data.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if code in UNWORKED:
        return ResultLine(custom_id, unworked=UNWORKED[code])
    # An error with no answer: the line failed at the provider; read as a server error (retried).
    return ResultLine(custom_id, status_code=500, body=orjson.dumps({"error": error or {"message": "no response"}}))


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
