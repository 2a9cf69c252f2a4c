"""batchrun.testing's Anthropic Message Batches API, over real HTTP: lifecycle, results, create
checks, lists, cancel and expiry with partial results, delete."""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any

import httpx
import orjson
import pytest

from batchrun.testing import BatchFaults
from tests.unit.batch_helpers import (
    messages_request,
    parse_jsonl,
    serving,
    wait_anthropic,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
TOOL = {"name": "classify", "description": "Classify.",
        "input_schema": {"type": "object", "properties": {"label": {"type": "string", "enum": ["x", "y"]}},
                         "required": ["label"]}}


def _create(client: httpx.Client, requests: list[dict[str, Any]]) -> dict[str, Any]:
    reply = client.post("/v1/messages/batches", json={"requests": requests})
    assert reply.status_code == 200, reply.text
    batch: dict[str, Any] = reply.json()
    return batch


def _results(client: httpx.Client, batch: dict[str, Any]) -> list[dict[str, Any]]:
    reply = client.get(batch["results_url"])
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/x-jsonl"
    return parse_jsonl(reply.content)


def _rfc3339(value: str) -> datetime.datetime:
    assert value.endswith("Z"), value
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_lifecycle_counts_move_only_at_the_end_and_answers_match_online() -> None:
    with serving(BatchFaults(turnaround_s=1.0)) as (server, _, client):
        requests = [messages_request(f"req-{i}", f"hello {i}") for i in range(8)]
        requests.append(messages_request("tool_1", "pick", tools=[TOOL],
                                         tool_choice={"type": "tool", "name": "classify"}))
        created = _create(client, requests)
        assert created["type"] == "message_batch" and created["id"].startswith("msgbatch_")
        assert created["processing_status"] == "in_progress"
        assert created["results_url"] is None and created["ended_at"] is None
        assert created["archived_at"] is None and created["cancel_initiated_at"] is None
        assert _rfc3339(created["expires_at"]) - _rfc3339(created["created_at"]) == datetime.timedelta(days=1)
        mid = wait_until(lambda: client.get(f"/v1/messages/batches/{created['id']}").json(),
                         lambda b: len(server.log) >= 3, timeout=10)
        assert mid["processing_status"] == "in_progress"
        assert mid["request_counts"] == {"processing": 9, "succeeded": 0, "errored": 0,
                                         "canceled": 0, "expired": 0}
        batch = wait_anthropic(client, created["id"])
        assert batch["request_counts"] == {"processing": 0, "succeeded": 9, "errored": 0,
                                           "canceled": 0, "expired": 0}
        assert _rfc3339(batch["ended_at"]) >= _rfc3339(batch["created_at"])
        assert batch["results_url"] == (f"{server.anthropic_base_url}/v1/messages/batches/"
                                        f"{batch['id']}/results")
        results = {line["custom_id"]: line["result"] for line in _results(client, batch)}
        assert set(results) == {r["custom_id"] for r in requests}
        assert {r["type"] for r in results.values()} == {"succeeded"}
        online = client.post("/v1/messages", json=requests[3]["params"]).json()
        assert results["req-3"]["message"]["content"] == online["content"]
        assert results["req-3"]["message"]["usage"] == online["usage"]
        tool = client.post("/v1/messages", json=requests[-1]["params"]).json()
        assert results["tool_1"]["message"]["content"][0]["input"] == tool["content"][0]["input"]
        assert results["tool_1"]["message"]["stop_reason"] == "tool_use"
        billed = server.billed_by_key()
        assert billed == Counter({f"hello {i}": 1 for i in range(8)}) + Counter(["pick", "pick", "hello 3"])
        assert {r.api for r in server.log if r.batch_id} == {"batch:messages"}


@pytest.mark.parametrize("body,message", [
    ({"requests": [messages_request("has space")]}, "should match pattern"),
    ({"requests": [messages_request("x" * 65)]}, "at most 64 characters"),
    ({"requests": [messages_request("")]}, "at least 1 character"),
    ({"requests": [messages_request("a"), messages_request("a")]}, "requests.1.custom_id: Duplicate"),
    ({"requests": [{"custom_id": "a"}]}, "requests.0.params: Field required"),
    ({"requests": [{"params": {}}]}, "requests.0.custom_id: Field required"),
    ({"requests": []}, "at least 1 item"),
    ({"requests": [messages_request(f"r{i}") for i in range(4)]}, "at most 3 items"),
    ({}, "requests: Field required"),
])
def test_create_refused(body: dict[str, Any], message: str) -> None:
    with serving(BatchFaults(turnaround_s=0.5, max_batch_requests=3)) as (_, _, client):
        reply = client.post("/v1/messages/batches", json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"]
        assert client.get("/v1/messages/batches").json()["data"] == []


def test_create_needs_version_header_json_and_a_body_under_the_limit() -> None:
    with serving(BatchFaults(turnaround_s=0.5, max_batch_bytes=10_000)) as (_, _, client):
        body = {"requests": [messages_request("a")]}
        no_version = httpx.post(f"{client.base_url}/v1/messages/batches", json=body)
        assert no_version.status_code == 400 and "anthropic-version" in no_version.text
        assert client.post("/v1/messages/batches", content=b"{nope").status_code == 400
        big = client.post("/v1/messages/batches",
                          json={"requests": [messages_request("a", "x" * 20_000)]})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        assert client.post("/v1/messages/batches", json=body).status_code == 200


@pytest.mark.slow
def test_a_create_body_bigger_than_the_online_limit() -> None:
    with serving(BatchFaults(turnaround_s=0.5)) as (server, _, client):
        text = "y" * 60_000
        requests = [messages_request(f"r{i}", f"{i} {text}", max_tokens=5) for i in range(1200)]
        raw = orjson.dumps({"requests": requests})
        assert len(raw) > 64 * 1024 * 1024  # what an online route would refuse
        reply = client.post("/v1/messages/batches", content=raw,
                            headers={"content-type": "application/json"}, timeout=60)
        assert reply.status_code == 200, reply.text[:300]
        batch = wait_anthropic(client, reply.json()["id"], timeout=60)
        assert batch["request_counts"]["succeeded"] == 1200
        assert len(server.billed_by_key()) == 1200


def test_invalid_params_and_line_faults_are_errored_results() -> None:
    with serving(BatchFaults(turnaround_s=0.5, p_line_500=0.3, seed=2)) as (server, _, client):
        bad = {"custom_id": "bad", "params": {"model": "m", "messages": [{"role": "user", "content": "b"}]}}
        batch = wait_anthropic(client, _create(client, [bad] + [messages_request(f"r{i}") for i in range(30)])["id"])
        results = {line["custom_id"]: line["result"] for line in _results(client, batch)}
        assert results["bad"]["type"] == "errored"
        error = results["bad"]["error"]
        assert error["type"] == "error" and error["error"] == {
            "type": "invalid_request_error", "message": "max_tokens: Field required"}
        api_errors = [r for r in results.values() if r["type"] == "errored" and r is not results["bad"]]
        assert api_errors and {r["error"]["error"]["type"] for r in api_errors} == {"api_error"}
        counts = batch["request_counts"]
        assert counts["errored"] == 1 + len(api_errors) and counts["succeeded"] == 30 - len(api_errors)
        assert sum(server.billed_by_key().values()) == counts["succeeded"]


def test_list_newest_first_with_before_and_after_ids() -> None:
    with serving(BatchFaults(turnaround_s=5.0)) as (_, _, client):
        ids = [_create(client, [messages_request(f"r{i}")])["id"] for i in range(5)]
        newest = ids[::-1]
        page = client.get("/v1/messages/batches", params={"limit": 2}).json()
        assert set(page) == {"data", "first_id", "last_id", "has_more"}
        assert [b["id"] for b in page["data"]] == newest[:2] and page["has_more"] is True
        assert (page["first_id"], page["last_id"]) == (newest[0], newest[1])
        page = client.get("/v1/messages/batches", params={"limit": 2, "after_id": page["last_id"]}).json()
        assert [b["id"] for b in page["data"]] == newest[2:4] and page["has_more"] is True
        page = client.get("/v1/messages/batches", params={"limit": 2, "after_id": page["last_id"]}).json()
        assert [b["id"] for b in page["data"]] == newest[4:] and page["has_more"] is False
        back = client.get("/v1/messages/batches", params={"limit": 2, "before_id": newest[4]}).json()
        assert [b["id"] for b in back["data"]] == newest[2:4] and back["has_more"] is True
        back = client.get("/v1/messages/batches", params={"limit": 5, "before_id": newest[2]}).json()
        assert [b["id"] for b in back["data"]] == newest[:2] and back["has_more"] is False
        assert [b["id"] for b in client.get("/v1/messages/batches").json()["data"]] == newest
        for params in ({"limit": 0}, {"limit": 1001}, {"after_id": ids[0], "before_id": ids[1]}):
            assert client.get("/v1/messages/batches", params=params).status_code == 400


def test_cancel_part_way_keeps_partial_results() -> None:
    n = 40
    with serving(BatchFaults(turnaround_s=2.0, cancel_s=0.3)) as (server, _, client):
        created = _create(client, [messages_request(f"r{i}") for i in range(n)])
        wait_until(lambda: {}, lambda _: len(server.log) >= n // 3)
        canceling = client.post(f"/v1/messages/batches/{created['id']}/cancel").json()
        assert canceling["processing_status"] == "canceling" and canceling["cancel_initiated_at"]
        answered = len(server.log)
        batch = wait_anthropic(client, created["id"])
        assert len(server.log) == answered
        counts = batch["request_counts"]
        assert counts["succeeded"] == answered and counts["canceled"] == n - answered
        assert counts["processing"] == counts["errored"] == counts["expired"] == 0
        results = _results(client, batch)
        assert Counter(line["result"]["type"] for line in results) == Counter(
            succeeded=answered, canceled=n - answered)
        assert all(line["result"] == {"type": "canceled"} for line in results
                   if line["result"]["type"] == "canceled")
        again = client.post(f"/v1/messages/batches/{created['id']}/cancel")
        assert again.status_code == 400


def test_expiry_part_way_keeps_partial_results() -> None:
    n = 40
    with serving(BatchFaults(turnaround_s=3.0, expire_after_s=1.0)) as (server, _, client):
        created = _create(client, [messages_request(f"r{i}") for i in range(n)])
        assert (_rfc3339(created["expires_at"]) - _rfc3339(created["created_at"])).total_seconds() == 1.0
        batch = wait_anthropic(client, created["id"])
        counts = batch["request_counts"]
        assert 0 < counts["succeeded"] < n and counts["expired"] == n - counts["succeeded"]
        results = _results(client, batch)
        assert Counter(line["result"]["type"] for line in results) == Counter(
            succeeded=counts["succeeded"], expired=counts["expired"])
        assert sum(server.billed_by_key().values()) == counts["succeeded"]


def test_results_and_delete_only_once_ended() -> None:
    with serving(BatchFaults(turnaround_s=0.6)) as (_, _, client):
        batch_id = _create(client, [messages_request("a")])["id"]
        early = client.get(f"/v1/messages/batches/{batch_id}/results")
        assert early.status_code == 400 and early.json()["error"]["type"] == "invalid_request_error"
        assert client.delete(f"/v1/messages/batches/{batch_id}").status_code == 400
        wait_anthropic(client, batch_id)
        assert client.delete(f"/v1/messages/batches/{batch_id}").json() == {
            "id": batch_id, "type": "message_batch_deleted"}
        for reply in (client.get(f"/v1/messages/batches/{batch_id}"),
                      client.get(f"/v1/messages/batches/{batch_id}/results"),
                      client.delete(f"/v1/messages/batches/{batch_id}")):
            assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
        assert client.get("/v1/messages/batches").json()["data"] == []
