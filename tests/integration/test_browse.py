"""``batchrun show`` underneath (batchrun/browse.py, LedgerQueries.find_items / item_attempts): the request
as the server received it, every attempt, the answer or the error with its raw text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchrun.browse import render_item, show_items
from batchrun.errors import JobNotFoundError
from batchrun.ledger import Ledger
from batchrun.spec import parse_spec
from batchrun.states import ItemState
from batchrun.submission import submit
from batchrun.testing import FakeProviderServer, Faults

from .test_structured import FAST, SCHEMA


def spec(server: FakeProviderServer, **output: Any) -> Any:
    return parse_spec(
        {"provider": {"base_url": server.base_url, "model": "m"},
         "request": {"template": "Classify: {text}", "max_tokens": 200},
         "run": {"concurrency": 2, "max_attempts": 3}, **({"output": output} if output else {})},
        where="test",
    )


def test_a_failed_item_shows_the_request_as_sent_each_attempt_and_the_error(
    ledger: Ledger, write_jsonl: Callable[..., Path]
) -> None:
    with FakeProviderServer(Faults(status_override=503), record_bodies=True) as server:
        job = submit(ledger, spec(server), write_jsonl([{"id": "a", "text": "x"}]), options=FAST).job_id
        sent = server.bodies
    [view] = show_items(ledger, job, "a")
    assert view.request_body == sent[0]  # the body the server got, byte for byte the same JSON
    assert view.request_url == f"{server.base_url}/chat/completions"
    assert [(a.status_code, a.error_class) for a in view.attempts] == [(503, "server_error")] * 3
    data = view.to_json()
    assert data["status"] == ItemState.FAILED and data["line"] == 1
    assert data["error"]["class"] == "server_error" and data["error"]["status_code"] == 503
    assert len(data["attempt_log"]) == 3 and data["attempt_log"][0]["latency_ms"] is not None
    assert all("HTTP 503" in a["error_message"] for a in data["attempt_log"])  # each attempt keeps its message
    assert data["raw"] is not None and "error" in data["raw"]  # the provider's error body
    text = render_item(view)
    assert text.startswith(f"# a  (job {job}, line 1): failed, 3 requests")
    for part in ("## Request", f"POST {server.base_url}/chat/completions", '"Classify: x"', "## Attempts",
                 "503  server_error", "## Error", "server_error (HTTP 503):", "## Raw"):
        assert part in text, part


def test_where_and_limit_choose_items_in_input_order(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    with FakeProviderServer() as server:
        job = submit(ledger, spec(server, schema=SCHEMA),
                     write_jsonl([{"id": f"r{i}", "text": str(i)} for i in range(6)] + ["{bad", {"id": "n"}]),
                     options=FAST).job_id
    assert [v.detail.row.custom_id for v in show_items(ledger, job, limit=3)] == ["r0", "r1", "r2"]
    rejected = show_items(ledger, job, where={"state": "rejected"})
    assert [(v.detail.row.custom_id, v.detail.row.error_class) for v in rejected] == [("7", "invalid_json"),
                                                                                      ("n", "missing_field")]
    assert rejected[0].request_body is None and rejected[0].attempts == []
    assert "## Error\ninvalid_json: not valid JSON" in render_item(rejected[0])
    assert [v.detail.row.custom_id for v in show_items(ledger, job, where={"error_class": "missing_field"})] == ["n"]
    answered = show_items(ledger, job, "r4")[0]
    assert answered.to_json()["output"]["label"] in ("spam", "ham")  # parsed JSON for a schema job
    assert '"response_format"' in render_item(answered)  # the schema goes out with the request
    assert show_items(ledger, job, "nobody") == []
    with pytest.raises(ValueError, match="only by state, error_class, status_code, custom_id"):
        show_items(ledger, job, where={"body": "x"})
    with pytest.raises(JobNotFoundError):
        show_items(ledger, 99)


def test_an_item_being_reasked_shows_each_invalid_answer_and_its_feedback(
    ledger: Ledger, write_jsonl: Callable[..., Path]
) -> None:
    with FakeProviderServer() as server:
        job = submit(ledger, spec(server, schema=SCHEMA), write_jsonl([{"id": "a", "text": "x"}]), run=False).job_id
    with ledger.engine.begin() as conn:  # as a run leaves it between two re-asks
        from sqlalchemy import text

        conn.execute(text("update items set state = 'running', followups = :f"),
                      {"f": '[["{\\"label\\": 3}", "label: 3 is not one of [spam, ham]"]]'})
    [view] = show_items(ledger, job, "a")
    assert view.to_json()["reasks"] == [{"answer": '{"label": 3}', "feedback": "label: 3 is not one of [spam, ham]"}]
    assert '## Re-ask 1\nanswer:\n  {"label": 3}\nfeedback:\n  label: 3 is not one of [spam, ham]' in render_item(view)
