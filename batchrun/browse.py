"""One item at a time, as ``batchrun show`` prints it: the request as sent, each attempt, the answer or error.

Like ``llm logs`` shows a conversation: read from the ledger (:meth:`LedgerQueries.find_items`,
:meth:`~LedgerQueries.item_attempts`), nothing sent. The request is rebuilt by the job's provider
from the stored item exactly as a run sends it (the structured-output request included), with
the item's re-asks (each invalid answer and the feedback it got) after it. An attempt keeps its
status, error class, latency, time to first byte, tokens, cost and its error's message
(shortened); the item keeps the last error's message and the
raw text of its final answer or error body.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from batchrun.export import results_line
from batchrun.jsonutil import json_or_none
from batchrun.ledger import AttemptRow, ItemDetail, Ledger, LedgerQueries
from batchrun.spec import JobSpec
from batchrun.states import ItemState

DEFAULT_LIMIT = 20


@dataclass(frozen=True)
class ItemView:
    """An item of a job with what was sent for it and what came back."""

    job_id: int
    detail: ItemDetail
    attempts: list[AttemptRow]
    request_url: str | None  # the full URL, None when the provider cannot say (no base_url stored)
    request_body: Any  # the JSON body of the first request as sent, else the stored one
    structured: bool

    def to_json(self) -> dict[str, Any]:
        """One JSON object: the item's ``results`` line, its ``line``, the request, re-asks, attempts and raw text."""
        row = self.detail.row
        return {
            **results_line(row, structured=self.structured),
            "line": row.line,
            "request": {"url": self.request_url, "body": self.request_body},
            "reasks": [{"answer": answer, "feedback": feedback} for answer, feedback in self.reasks],
            "attempt_log": [_attempt_json(a) for a in self.attempts],
            "raw": self.raw,
            "cached_from": row.cached_from,
        }

    @property
    def reasks(self) -> list[tuple[str, str]]:
        followups = self.detail.followups
        return [(str(a), str(f)) for a, f in orjson.loads(followups)] if followups else []

    @property
    def raw(self) -> str | None:
        """The raw text: the model's answer (also an invalid one), else the error's response body."""
        row = self.detail.row
        return row.output if row.output is not None else row.response


def show_items(
    ledger: Ledger, job_id: int, custom_id: str | None = None, where: Mapping[str, Any] | None = None,
    *, limit: int = DEFAULT_LIMIT,
) -> list[ItemView]:
    """The job's items (``custom_id``'s alone, or the first ``limit`` that match ``where``) with their attempts.

    JobNotFoundError for an unknown job; an unknown custom_id is an empty list.
    """
    spec = ledger.get_job(job_id).spec
    queries = LedgerQueries(ledger.engine)
    chosen = dict(where or {})
    if custom_id is not None:
        chosen["custom_id"] = custom_id
    details = queries.find_items(job_id, chosen, limit=limit)
    attempts = queries.item_attempts(job_id, [d.row.item_id for d in details])
    prepare = _preparer(spec)
    views = []
    for detail in details:
        url, body = prepare(detail)
        views.append(ItemView(job_id, detail, attempts[detail.row.item_id], url, body, spec.output.schema is not None))
    return views


def _preparer(spec: JobSpec) -> Any:
    """(url, JSON body) of an item's first request as the job's provider sends it; the stored body if it cannot."""
    from batchrun.errors import BatchrunError
    from batchrun.providers import provider_for

    try:
        provider = provider_for(spec, read_key=False)
    except BatchrunError:
        provider = None

    def prepare(detail: ItemDetail) -> tuple[str | None, Any]:
        if detail.body is None:
            return None, None
        if provider is None:
            return detail.url, json_or_none(detail.body)
        request = provider.prepare(detail.url, detail.body, max_tokens=detail.max_tokens)
        return request.url, json_or_none(request.content)

    return prepare


def _attempt_json(attempt: AttemptRow) -> dict[str, Any]:
    data = dataclasses.asdict(attempt)
    del data["item_id"]
    return data


def render_item(view: ItemView) -> str:
    """The item as text: a heading, the request, each re-ask, the attempts, the answer or the error."""
    row = view.detail.row
    line = results_line(row, structured=view.structured)
    out = [f"# {row.custom_id}  (job {view.job_id}, line {row.line}): {row.state}, "
           f"{len(view.attempts)} request{'s' if len(view.attempts) != 1 else ''}"]
    if view.request_body is not None:
        out += ["", "## Request", f"POST {view.request_url or '(the provider default route)'}", _json_text(view.request_body)]
    for n, (answer, feedback) in enumerate(view.reasks, 1):
        out += ["", f"## Re-ask {n}", "answer:", _indent(answer), "feedback:", _indent(feedback)]
    if view.attempts:
        out += ["", "## Attempts"]
        out += [_attempt_text(n, a) for n, a in enumerate(view.attempts, 1)]
    if row.cached_from is not None:
        out += ["", f"answer reused from item {row.cached_from} (the response cache): no request, no cost"]
    if row.state == ItemState.SUCCEEDED:
        out += ["", "## Answer", _json_text(line["output"]) if view.structured else str(line["output"])]
    elif line["error"] is not None:
        error = line["error"]
        status = f" (HTTP {error['status_code']})" if error.get("status_code") else ""
        out += ["", "## Error", f"{error['class']}{status}: {error['message']}"]
        for problem in error.get("errors") or []:
            out.append(f"  - {_json_text(problem, indent=False)}")
        if view.raw is not None:
            out += ["", "## Raw", _indent(view.raw)]
    if line["usage"]:
        usage = line["usage"]
        cost = f", ${usage['cost_usd']:.6f}" if usage.get("cost_usd") is not None else ""
        out += ["", f"usage: {usage['input_tokens']} in, {usage['output_tokens']} out{cost}"]
    return "\n".join(out)


def _attempt_text(n: int, attempt: AttemptRow) -> str:
    started = datetime.datetime.fromtimestamp(attempt.started_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    status = str(attempt.status_code) if attempt.status_code is not None else "no response"
    parts = [f"{n:>3}  {started}Z  {status}", attempt.error_class or "ok"]
    if attempt.latency_ms is not None:
        parts.append(f"{attempt.latency_ms:.0f} ms")
    if attempt.ttfb_ms is not None:
        parts.append(f"ttfb {attempt.ttfb_ms:.0f} ms")
    if attempt.ttft_ms is not None:
        parts.append(f"ttft {attempt.ttft_ms:.0f} ms")
    if attempt.queue_wait_ms is not None:
        parts.append(f"queued {attempt.queue_wait_ms:.0f} ms")
    if attempt.input_tokens is not None or attempt.output_tokens is not None:
        parts.append(f"{attempt.input_tokens or 0} in / {attempt.output_tokens or 0} out")
    if attempt.cost_usd is not None:
        parts.append(f"${attempt.cost_usd:.6f}")
    if attempt.error_message:
        parts.append(attempt.error_message.replace("\n", " "))
    return "  ".join(parts)


def _json_text(value: Any, *, indent: bool = True) -> str:
    option = orjson.OPT_INDENT_2 if indent else 0
    return orjson.dumps(value, option=option).decode()


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines() or [""])
