"""OpenAI's Files and Batch APIs, as the fake server speaks them.

Shapes follow openai-python ``src/openai/types/``: ``file_object.py``, ``file_deleted.py``,
``file_list_params.py`` (limit 1..10,000, default 10,000; ``order`` asc/desc by creation, default
desc; ``purpose``; ``after``), ``batch.py``, ``batch_create_params.py``, ``batch_request_counts.py``,
``batch_error.py``, ``batch_usage.py``, ``batch_list_params.py`` (limit 1..100, default 20;
``after``); lists are ``{"object": "list", "data", "first_id", "last_id", "has_more"}``, newest
first.

A batch is ``validating`` for ``BatchFaults.validating_s``, then its input file is checked line
by line, as the real API does: each line JSON with a ``custom_id`` unique in the file,
``method`` POST, ``url`` equal to the batch's endpoint, a ``body`` whose ``model`` is the same on
every line; at most ``max_file_requests`` lines and ``max_file_bytes`` bytes. A bad file makes the
batch ``failed`` with ``errors.data`` naming each bad line (codes the docs name:
``invalid_json_line``, ``duplicate_custom_id``, ``url_mismatch``, ``model_mismatch``,
``empty_file``, ``too_many_tasks``, ``token_limit_exceeded``; the fake's own words for the rest:
``missing_required_parameter``, ``invalid_method``, ``file_too_large``). Then ``in_progress``
(lines answered), ``finalizing``, ``completed``; or ``expired`` / ``cancelling`` -> ``cancelled``.

Output file lines are ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}``; a line answered with an error status goes, in that same shape, to the error
file, as do the lines a batch never answered: ``"response": null, "error": {"code":
"batch_expired" | "batch_cancelled", "message"}``. ``output_file_id`` is null when no line
succeeded; ``error_file_id``, when none failed, is null, "" or absent (``clean_error_file_id``).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from batchrun.testing.batch_http import ApiError, Call, Reply, json_reply
from batchrun.testing.batch_store import FileRecord, derived_id, new_hex_id, new_id
from batchrun.testing.batch_work import APIS, LIVE, Batch, BatchWorker
from batchrun.testing.batch_pages import cursor_page

# The endpoints batch_create_params.py allows, and those the fake model answers.
_ENDPOINTS = ("/v1/responses", "/v1/chat/completions", "/v1/embeddings", "/v1/completions",
              "/v1/moderations", "/v1/images/generations", "/v1/images/edits", "/v1/videos")
_ANSWERED = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}
_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
_DAY_S = 86_400
_FILE_TTL_S = 30 * _DAY_S  # purpose=batch files expire after 30 days by default
_MAX_ERRORS = 100
_UNANSWERED = {
    "expired": ("batch_expired",
                "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def _ts(t: float | None) -> int | None:
    return None if t is None else int(t)


class OpenAIBatches:
    """The Files and Batch routes, and how an OpenAI batch is validated, answered and ended."""

    name = "openai"

    def __init__(self, worker: BatchWorker, draw: Callable[[], float]) -> None:
        self.worker = worker
        self.store = worker.store
        self.files: dict[str, FileRecord] = {}
        self._draw = draw  # the service's fault draw

    def load(self) -> None:
        self.files = {f.id: f for f in self.store.load_files()}

    # ------------------------------------------------------------------ routes

    async def handle(self, call: Call) -> Reply:
        p, m = call.parts, call.method
        if p[1] == "files":
            if len(p) == 2 and m == "POST":
                return await self._upload(call)
            if len(p) == 2 and m == "GET":
                return self._list_files(call)
            if len(p) == 3 and m == "GET":
                return json_reply(self._file(p[2]).to_api())
            if len(p) == 3 and m == "DELETE":
                self._file(p[2])
                del self.files[p[2]]
                self.store.delete_file(p[2])
                return json_reply({"id": p[2], "object": "file", "deleted": True})
            if len(p) == 4 and p[3] == "content" and m == "GET":
                self._file(p[2])
                return Reply(file=self.store.file_path(p[2]), content_type=b"application/octet-stream")
        else:
            if len(p) == 2 and m == "POST":
                return await self._create(call)
            if len(p) == 2 and m == "GET":
                batches = self.worker.newest_first(self.name)
                page = cursor_page([b.rec.id for b in batches], batches,
                                   call.int_param("limit", 20, 1, 100), call.query.get("after"))
                return json_reply({"object": "list", **page.render(self.to_api)})
            if len(p) == 3 and m == "GET":
                return json_reply(self.to_api(self._batch(p[2])))
            if len(p) == 4 and p[3] == "cancel" and m == "POST":
                return self._cancel(self._batch(p[2]))
        raise ApiError(404, f"Invalid URL ({m} {call.req.target.partition('?')[0]})")

    def _file(self, file_id: str) -> FileRecord:
        rec = self.files.get(file_id)
        if rec is None:
            raise ApiError(404, f"No such File object: {file_id}")
        return rec

    def _batch(self, batch_id: str) -> Batch:
        batch = self.worker.find(self.name, batch_id)
        if batch is None:
            raise ApiError(404, f"No batch found with id '{batch_id}'.")
        return batch

    async def _upload(self, call: Call) -> Reply:
        bf = self.worker.host.batch_faults
        form, data = await call.form(bf.max_upload_bytes)
        try:
            purpose = form.fields.get("purpose")
            if form.file_field != "file" or form.filename is None:
                raise ApiError(400, "Missing required parameter: 'file'.")
            if purpose is None:
                raise ApiError(400, "Missing required parameter: 'purpose'.")
            if purpose not in _PURPOSES:
                raise ApiError(400, f"'{purpose}' is not one of {list(_PURPOSES)} - 'purpose'")
            if purpose == "batch" and not form.filename.endswith(".jsonl"):
                raise ApiError(400, "Invalid file format for Batch API. Must be .jsonl")
            now = int(time.time())
            rec = FileRecord(new_id("file-", 22), form.file_bytes, now, form.filename, purpose,
                             self._next_file_order(), now + _FILE_TTL_S if purpose == "batch" else None)
            self.store.save_file(rec, data)
            self.files[rec.id] = rec
        finally:
            data.unlink(missing_ok=True)
        if self._draw() < bf.p_upload_500:
            raise ApiError(500, "The server had an error while processing your request.")
        return json_reply(rec.to_api())

    def _next_file_order(self) -> int:
        return max((f.order for f in self.files.values()), default=0) + 1

    def _list_files(self, call: Call) -> Reply:
        order = call.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order: must be 'asc' or 'desc', got {order!r}.")
        purpose = call.query.get("purpose")
        files = sorted((f for f in self.files.values() if purpose is None or f.purpose == purpose),
                       key=lambda f: f.order, reverse=order == "desc")
        page = cursor_page([f.id for f in files], files,
                           call.int_param("limit", 10_000, 1, 10_000), call.query.get("after"))
        return json_reply({"object": "list", **page.render(FileRecord.to_api)})

    async def _create(self, call: Call) -> Reply:
        body = await call.json()
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        file_id = body.get("input_file_id")
        endpoint = body.get("endpoint")
        if not isinstance(file_id, str):
            raise ApiError(400, "Missing required parameter: 'input_file_id'.")
        source = self.files.get(file_id)
        if source is None:
            raise ApiError(400, f"The input file {file_id} does not exist.")
        if source.purpose != "batch":
            raise ApiError(400, f"The input file {file_id} must be uploaded with purpose 'batch'.")
        if endpoint not in _ENDPOINTS:
            raise ApiError(400, f"'{endpoint}' is not one of {list(_ENDPOINTS)} - 'endpoint'")
        if endpoint not in _ANSWERED:
            raise ApiError(400, f"The fake server answers batches for {sorted(_ANSWERED)} only.")
        if body.get("completion_window") != "24h":
            raise ApiError(400, "completion_window: only '24h' is supported.")
        metadata = body.get("metadata")
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= 16
                and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                        for k, v in metadata.items())):
            raise ApiError(400, "metadata: at most 16 pairs of strings, keys of at most 64 "
                                "characters, values of at most 512.")
        bf = self.worker.host.batch_faults
        if bf.create_s > 0:  # the batch is made after this, the client there to hear of it or not
            await asyncio.sleep(bf.create_s)
            if file_id not in self.files:
                raise ApiError(400, f"The input file {file_id} does not exist.")
        batch_id = new_hex_id("batch_")
        self.store.link_requests(batch_id, self.store.file_path(file_id))
        batch = self.worker.create(
            batch_id, self.name, _ANSWERED[endpoint], int(self._draw() * 2**53), phases=True,
            status="validating", endpoint=endpoint, input_file_id=file_id, metadata=metadata,
            clean_error_file_id=bf.clean_error_file_id)
        if self._draw() < bf.p_create_500:  # created all the same: the client must look
            raise ApiError(500, "The server had an error while processing your request.")
        return json_reply(self.to_api(batch))

    def _cancel(self, batch: Batch) -> Reply:
        status = batch.rec.status
        if status not in LIVE:
            raise ApiError(400, f"Cannot cancel a batch with status '{status}'.")
        self.worker.cancel(batch, time.time())
        return json_reply(self.to_api(batch))

    # ------------------------------------------------------------------ the batch object

    def to_api(self, batch: Batch) -> dict[str, Any]:
        """The Batch object (openai-python ``types/batch.py``)."""
        r = batch.rec
        ended = r.status in ("completed", "expired", "cancelled")
        usage = {
            "input_tokens": batch.input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": batch.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": batch.input_tokens + batch.output_tokens,
        }
        out: dict[str, Any] = {
            "id": r.id, "object": "batch", "endpoint": r.endpoint, "model": r.model,
            "errors": {"object": "list", "data": r.errors} if r.errors else None,
            "input_file_id": r.input_file_id, "completion_window": "24h", "status": r.status,
            "output_file_id": r.output_file_id, "error_file_id": r.error_file_id,
            "created_at": int(r.created_at), "in_progress_at": _ts(r.in_progress_at),
            "expires_at": int(r.expires_at), "finalizing_at": _ts(r.finalizing_at),
            "completed_at": _ts(r.completed_at), "failed_at": _ts(r.failed_at),
            "expired_at": _ts(r.expired_at), "cancelling_at": _ts(r.cancelling_at),
            "cancelled_at": _ts(r.cancelled_at),
            "request_counts": {"total": r.total, "completed": batch.succeeded,
                               "failed": batch.failed + r.unanswered},
            "usage": usage, "metadata": r.metadata,
        }
        if ended and r.error_file_id is None:
            if r.clean_error_file_id == "empty":
                out["error_file_id"] = ""
            elif r.clean_error_file_id == "absent":
                del out["error_file_id"]
        return out

    # ------------------------------------------------------------------ Kind

    def validate(self, batch: Batch, worker: BatchWorker, now: float) -> None:
        r = batch.rec
        bf = worker.host.batch_faults
        api = APIS[r.api]
        errors: list[dict[str, Any]] = []

        def bad(code: str, line: int | None, message: str, param: str | None = None) -> None:
            if len(errors) < _MAX_ERRORS:
                errors.append({"code": code, "line": line, "message": message, "param": param})

        path = self.store.requests_path(r.id)
        offsets: array[int] = array("q")
        seen: set[str] = set()
        model: str | None = None
        tokens = lines = 0
        if path.stat().st_size > bf.max_file_bytes:
            bad("file_too_large", None,
                f"The input file is larger than the {bf.max_file_bytes} bytes a batch may hold.")
        pos = 0
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                start, pos = pos, pos + len(raw)
                if not raw.strip():
                    continue
                lines += 1
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict):
                    bad("invalid_json_line", number, "This line is not parseable as valid JSON.")
                    continue
                custom_id = obj.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id:
                    bad("missing_required_parameter", number,
                        "Missing required parameter: 'custom_id'.", "custom_id")
                elif custom_id in seen:
                    bad("duplicate_custom_id", number,
                        "The custom_id for this request is a duplicate of another request. The "
                        "custom_id parameter must be unique for each request in a batch.", "custom_id")
                else:
                    seen.add(custom_id)
                if obj.get("method") != "POST":
                    bad("invalid_method", number, "The method of each request must be 'POST'.",
                        "method")
                if obj.get("url") != r.endpoint:
                    bad("url_mismatch", number,
                        f"The provided URL '{obj.get('url')}' does not match the batch endpoint "
                        f"'{r.endpoint}'.", "url")
                body = obj.get("body")
                line_model = body.get("model") if isinstance(body, dict) else None
                if not isinstance(line_model, str):
                    bad("missing_required_parameter", number,
                        "Missing required parameter: 'body.model'.", "body.model")
                elif model is None:
                    model = line_model
                elif line_model != model:
                    bad("model_mismatch", number,
                        f"The model '{line_model}' does not match the model '{model}' of the "
                        "batch's other requests: a batch holds requests for one model.", "body.model")
                if isinstance(body, dict):
                    tokens += api.prompt_tokens(body)
                offsets.append(start)
                offsets.append(pos)
        if lines == 0:
            bad("empty_file", None, "The input file is empty.")
        elif lines > bf.max_file_requests:
            bad("too_many_tasks", None,
                f"The input file has {lines} requests; a batch may hold {bf.max_file_requests}.")
        limit = bf.enqueued_token_limit
        if not errors and limit is not None and worker.enqueued_tokens(model) + tokens > limit:
            bad("token_limit_exceeded", None,
                f"Enqueued token limit reached for {model} in organization org-fake. Limit: "
                f"{limit:,} enqueued tokens. Please try again once some in_progress batches have "
                "been completed.")
        if errors:
            r.status, r.failed_at, r.errors = "failed", now, errors
            return
        self.store.write_index(r.id, offsets)
        r.status, r.in_progress_at = "in_progress", now
        r.total, r.model, r.tokens = lines, model, tokens

    def request(self, line: Any) -> tuple[str, Any]:
        return line["custom_id"], line.get("body")

    def result(self, batch: Batch, custom_id: str, status: int, body: bytes) -> bytes:
        return b'{"id":"%s","custom_id":%s,"response":{"status_code":%d,"request_id":"%s","body":%s},"error":null}' % (
            new_hex_id("batch_req_").encode(), orjson.dumps(custom_id), status,
            new_hex_id("req_").encode(), body)

    def end(self, batch: Batch, worker: BatchWorker, how: str, unanswered: list[str]) -> None:
        r = batch.rec
        out_path, out = self.store.spool()
        err_path, err = self.store.spool()
        n_out = n_err = 0
        with out, err:
            for line in worker.journal(batch):
                if line["response"]["status_code"] == 200:
                    out.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
                    n_out += 1
                else:
                    err.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
                    n_err += 1
            if unanswered:
                code, message = _UNANSWERED[how]
                for custom_id in unanswered:
                    err.write(orjson.dumps({"id": new_hex_id("batch_req_"), "custom_id": custom_id,
                                            "response": None,
                                            "error": {"code": code, "message": message}},
                                           option=orjson.OPT_APPEND_NEWLINE))
                    n_err += 1
        r.output_file_id = self._output_file(r.id, "output", out_path) if n_out else None
        r.error_file_id = self._output_file(r.id, "error", err_path) if n_err else None
        out_path.unlink(missing_ok=True)
        err_path.unlink(missing_ok=True)

    def _output_file(self, batch_id: str, which: str, data: Path) -> str:
        # The id follows from the batch: a server killed while ending a batch ends it again at
        # its next start, and writes the same files again rather than two more.
        file_id = derived_id("file-", 22, f"{batch_id}/{which}")
        old = self.files.get(file_id)
        rec = FileRecord(file_id, data.stat().st_size, int(time.time()),
                         f"batch_{batch_id}_{which}.jsonl", "batch_output",
                         old.order if old is not None else self._next_file_order())
        self.store.save_file(rec, data)
        self.files[rec.id] = rec
        return rec.id
