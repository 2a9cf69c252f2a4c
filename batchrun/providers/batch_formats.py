"""The providers' batch API results lines, for ``batchrun export --format``.

Each item becomes the line the provider's own batch API would have put in its
results file, so existing consumers of those files work. One builder per
``batch_format`` of the provider registry; plain functions over an item's
stored fields: no HTTP stack and no ledger import (export hands them the
ledger's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from batchrun.jsonutil import json_or_none
from batchrun.states import ItemState


class ExportedItem(Protocol):
    """The fields of an item a results line is built from (the ledger's ``ItemRow`` has them)."""

    @property
    def line(self) -> int: ...
    @property
    def custom_id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def status_code(self) -> int | None: ...
    @property
    def request_id(self) -> str | None: ...
    @property
    def response(self) -> str | None: ...


# (job id, item, the item's error as export describes it: {"class", "message", ...} or None) -> line
ResultsLine = Callable[[int, ExportedItem, Mapping[str, Any] | None], dict[str, Any]]


def _error_or_state(item: ExportedItem, error: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return error or {"class": item.state, "message": f"item is {item.state}"}


def openai_batch_line(job_id: int, item: ExportedItem, error: Mapping[str, Any] | None) -> dict[str, Any]:
    """The OpenAI Batch API output line shape."""
    response = None
    batch_error = None
    body = json_or_none(item.response.encode()) if item.response else None
    if item.state == ItemState.SUCCEEDED or (item.status_code is not None and body is not None):
        response = {"status_code": item.status_code, "request_id": item.request_id or "", "body": body}
    else:
        err = _error_or_state(item, error)
        batch_error = {"code": err["class"], "message": err["message"]}
    return {"id": f"batch_req_{job_id}_{item.line}", "custom_id": item.custom_id, "response": response,
            "error": batch_error}


def anthropic_batch_line(job_id: int, item: ExportedItem, error: Mapping[str, Any] | None) -> dict[str, Any]:
    """The Anthropic Message Batches results line shape (``result.type``: succeeded, errored, canceled)."""
    result: dict[str, Any]
    if item.state == ItemState.SUCCEEDED:
        result = {"type": "succeeded", "message": json_or_none(item.response.encode()) if item.response else None}
    elif item.state == ItemState.CANCELLED:
        result = {"type": "canceled"}
    else:
        err = _error_or_state(item, error)
        body = json_or_none(item.response.encode()) if item.response else None
        if not (isinstance(body, dict) and body.get("type") == "error"):
            body = {"type": "error", "error": {"type": err["class"], "message": err["message"]}}
        result = {"type": "errored", "error": body}
    return {"custom_id": item.custom_id, "result": result}


# By the registry's batch_format names.
RESULTS_LINES: Mapping[str, ResultsLine] = {"openai-batch": openai_batch_line, "anthropic-batch": anthropic_batch_line}
