"""Anthropic's Message Batches API, as the fake server speaks it.

Shapes follow anthropic-sdk-python ``src/anthropic/types/messages/``: ``message_batch.py``
(timestamps as RFC 3339 strings), ``message_batch_request_counts.py``,
``message_batch_individual_response.py`` and the ``message_batch_*_result.py`` files,
``batch_create_params.py``, ``batch_list_params.py`` (limit 1..1,000, default 20; ``before_id``,
``after_id``), ``deleted_message_batch.py``; lists are ``{"data", "first_id", "last_id",
"has_more"}``, newest first (the SDK's ``SyncPage``).

``POST /v1/messages/batches`` takes ``{"requests": [{"custom_id", "params"}]}`` (read to disk
first: up to ``max_batch_bytes``, else 413); the request list and its ``custom_id`` s are checked
at once (1 to 64 of ``[a-zA-Z0-9_-]``, unique, at most ``max_batch_requests``: else 400), each
``params`` when its line is answered (an invalid one is an ``errored`` result, as the real API
validates them asynchronously). ``processing_status`` is ``in_progress`` until the batch ends
(``canceling`` once cancelled), then ``ended``; ``request_counts`` only move then. Results
(``application/x-jsonl``, in the order answered) are ``{"custom_id", "result": {"type":
"succeeded", "message"} | {"type": "errored", "error": {"type": "error", "error": {"type",
"message"}, "request_id"}} | {"type": "canceled"} | {"type": "expired"}}``. A batch may be
deleted once ended.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import time
from array import array
from collections.abc import Callable
from typing import Any

import orjson

from batchrun.testing.batch_http import ApiError, Call, Reply, json_reply
from batchrun.testing.batch_pages import cursor_page
from batchrun.testing.batch_store import new_id
from batchrun.testing.batch_work import APIS, Batch, BatchWorker

_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ENDED = ("completed", "expired", "cancelled")
_UNANSWERED = {"expired": b'{"type":"expired"}', "cancelled": b'{"type":"canceled"}'}


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class AnthropicBatches:
    """The Message Batches routes, and how an Anthropic batch's lines and results look."""

    name = "anthropic"

    def __init__(self, worker: BatchWorker, draw: Callable[[], float],
                 base_url: Callable[[], str]) -> None:
        self.worker = worker
        self.store = worker.store
        self._draw = draw
        self._base_url = base_url

    # ------------------------------------------------------------------ routes

    async def handle(self, call: Call) -> Reply:
        p, m = call.parts, call.method
        if len(p) == 3 and m == "POST":
            return await self._create(call)
        if len(p) == 3 and m == "GET":
            if "after_id" in call.query and "before_id" in call.query:
                raise ApiError(400, "Only one of before_id and after_id may be given.")
            batches = self.worker.newest_first(self.name)
            page = cursor_page([b.rec.id for b in batches], batches,
                               call.int_param("limit", 20, 1, 1000), call.query.get("after_id"),
                               call.query.get("before_id"))
            return json_reply(page.render(self.to_api))
        if len(p) == 4 and m == "GET":
            return json_reply(self.to_api(self._batch(p[3])))
        if len(p) == 4 and m == "DELETE":
            batch = self._batch(p[3])
            if batch.rec.status not in _ENDED:
                raise ApiError(400, f"Message Batch {p[3]} is still processing: cancel it and "
                                    "wait for it to end before deleting it.")
            del self.worker.batches[p[3]]
            self.store.delete_batch(p[3])
            return json_reply({"id": p[3], "type": "message_batch_deleted"})
        if len(p) == 5 and p[4] == "cancel" and m == "POST":
            batch = self._batch(p[3])
            if batch.rec.status in _ENDED:
                raise ApiError(400, f"Message Batch {p[3]} has ended and cannot be canceled.")
            self.worker.cancel(batch, time.time())
            return json_reply(self.to_api(batch))
        if len(p) == 5 and p[4] == "results" and m == "GET":
            batch = self._batch(p[3])
            if batch.rec.status not in _ENDED:
                raise ApiError(400, f"Message Batch {p[3]} has not ended yet: its results are "
                                    "available once processing_status is 'ended'.")
            return Reply(file=self.store.results_path(p[3]), content_type=b"application/x-jsonl")
        raise ApiError(404, f"Invalid URL ({m} {call.req.target.partition('?')[0]})")

    def _batch(self, batch_id: str) -> Batch:
        batch = self.worker.find(self.name, batch_id)
        if batch is None:
            raise ApiError(404, f"Message Batch {batch_id} not found.")
        return batch

    async def _create(self, call: Call) -> Reply:
        bf = self.worker.host.batch_faults
        spooled = await call.spool(bf.max_batch_bytes)
        try:
            body = orjson.loads(spooled.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, "The request body is not valid JSON.") from exc
        finally:
            spooled.unlink(missing_ok=True)
        requests = _checked_requests(body, bf.max_batch_requests)
        if bf.create_s > 0:  # the batch is made after this, the client there to hear of it or not
            await asyncio.sleep(bf.create_s)
        now = time.time()
        batch_id = new_id("msgbatch_01", 22)
        api = APIS["messages"]
        offsets: array[int] = array("q")
        tokens = pos = 0
        with open(self.store.requests_path(batch_id), "wb") as f:
            for item in requests:
                line = orjson.dumps({"custom_id": item["custom_id"], "params": item["params"]},
                                    option=orjson.OPT_APPEND_NEWLINE)
                f.write(line)
                offsets.append(pos)
                pos += len(line)
                offsets.append(pos)
                tokens += api.prompt_tokens(item["params"])
        self.store.write_index(batch_id, offsets)
        batch = self.worker.create(
            batch_id, self.name, "messages", int(self._draw() * 2**53), phases=False,
            status="in_progress", endpoint="/v1/messages", total=len(requests), tokens=tokens,
            in_progress_at=now)
        if self._draw() < bf.p_create_500:  # created all the same: the client must look
            raise ApiError(500, "Internal server error")
        return json_reply(self.to_api(batch))

    # ------------------------------------------------------------------ the batch object

    def to_api(self, batch: Batch) -> dict[str, Any]:
        """The MessageBatch object (anthropic-sdk-python ``types/messages/message_batch.py``)."""
        r = batch.rec
        ended = r.status in _ENDED
        if ended:
            counts = {"processing": 0, "succeeded": batch.succeeded, "errored": batch.failed,
                      "canceled": r.unanswered if r.status == "cancelled" else 0,
                      "expired": r.unanswered if r.status == "expired" else 0}
        else:  # the real API moves its counts only when the batch ends
            counts = {"processing": r.total, "succeeded": 0, "errored": 0, "canceled": 0,
                      "expired": 0}
        return {
            "id": r.id, "type": "message_batch",
            "processing_status": "ended" if ended else (
                "canceling" if r.status == "cancelling" else "in_progress"),
            "request_counts": counts, "ended_at": _rfc3339(r.ended_at),
            "created_at": _rfc3339(r.created_at), "expires_at": _rfc3339(r.expires_at),
            "archived_at": None, "cancel_initiated_at": _rfc3339(r.cancelling_at),
            "results_url": f"{self._base_url()}/v1/messages/batches/{r.id}/results" if ended else None,
        }

    # ------------------------------------------------------------------ Kind

    def validate(self, batch: Batch, worker: BatchWorker, now: float) -> None:
        batch.rec.status = "in_progress"  # checked at creation already

    def request(self, line: Any) -> tuple[str, Any]:
        return line["custom_id"], line["params"]

    def result(self, batch: Batch, custom_id: str, status: int, body: bytes) -> bytes:
        if status == 200:
            return b'{"custom_id":%s,"result":{"type":"succeeded","message":%s}}' % (
                orjson.dumps(custom_id), body)
        return b'{"custom_id":%s,"result":{"type":"errored","error":%s}}' % (
            orjson.dumps(custom_id), body)

    def end(self, batch: Batch, worker: BatchWorker, how: str, unanswered: list[str]) -> None:
        path, f = self.store.spool()
        with f:
            for line in worker.journal(batch):
                f.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
            for custom_id in unanswered:
                f.write(b'{"custom_id":%s,"result":%s}\n' % (orjson.dumps(custom_id),
                                                              _UNANSWERED[how]))
        os.replace(path, self.store.results_path(batch.rec.id))


def _checked_requests(body: Any, max_requests: int) -> list[dict[str, Any]]:
    """The ``requests`` of a create body, or the 400 the real API answers."""
    if not isinstance(body, dict):
        raise ApiError(400, "Input should be a valid dictionary")
    requests = body.get("requests")
    if requests is None:
        raise ApiError(400, "requests: Field required")
    if not isinstance(requests, list):
        raise ApiError(400, "requests: Input should be a valid list")
    if not requests:
        raise ApiError(400, "requests: List should have at least 1 item after validation, not 0")
    if len(requests) > max_requests:
        raise ApiError(400, f"requests: List should have at most {max_requests} items after "
                            f"validation, not {len(requests)}")
    seen: set[str] = set()
    for i, item in enumerate(requests):
        where = f"requests.{i}"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where}: Input should be a valid dictionary")
        custom_id = item.get("custom_id")
        if custom_id is None:
            raise ApiError(400, f"{where}.custom_id: Field required")
        if not isinstance(custom_id, str):
            raise ApiError(400, f"{where}.custom_id: Input should be a valid string")
        if not custom_id:
            raise ApiError(400, f"{where}.custom_id: String should have at least 1 character")
        if len(custom_id) > 64:
            raise ApiError(400, f"{where}.custom_id: String should have at most 64 characters")
        if not _CUSTOM_ID.fullmatch(custom_id):
            raise ApiError(400, f"{where}.custom_id: String should match pattern "
                                "'^[a-zA-Z0-9_-]{1,64}$'")
        if custom_id in seen:
            raise ApiError(400, f"{where}.custom_id: Duplicate custom_id '{custom_id}': each "
                                "request in a Message Batch needs its own.")
        seen.add(custom_id)
        if "params" not in item:
            raise ApiError(400, f"{where}.params: Field required")
        if not isinstance(item["params"], dict):
            raise ApiError(400, f"{where}.params: Input should be a valid dictionary")
    return requests
