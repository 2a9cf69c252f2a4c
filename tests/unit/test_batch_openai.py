"""batchrun.testing's OpenAI Files and Batch APIs, over real HTTP: lifecycle, files, lists,
validation, limits, cancel and expiry with partial results, per-line failures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchrun.testing import BatchFaults
from tests.unit.batch_helpers import (
    chat_line,
    content,
    create_batch,
    jsonl,
    serving,
    upload,
    wait_openai,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b", "c"]},
                                           "score": {"type": "integer"}},
          "required": ["label", "score"], "additionalProperties": False}


def test_lifecycle_statuses_timestamps_counts_usage_and_answers() -> None:
    faults = BatchFaults(turnaround_s=1.2, validating_s=0.3, finalizing_s=0.3)
    with serving(faults) as (server, client, _):
        lines = [chat_line(f"r{i}", f"hello {i}", max_tokens=50) for i in range(12)]
        created = create_batch(client, lines, metadata={"job": "j1", "shard": "3"})
        assert created["status"] == "validating"
        assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
        assert created["object"] == "batch" and created["completion_window"] == "24h"
        assert created["id"].startswith("batch_") and created["metadata"] == {"job": "j1", "shard": "3"}
        assert created["expires_at"] == created["created_at"] + 86_400
        seen: list[str] = []

        def done(b: dict[str, Any]) -> bool:
            seen.append(b["status"])
            return bool(b["status"] == "completed")

        batch = wait_until(lambda: client.get(f"/batches/{created['id']}").json(), done)
        assert batch["status"] == "completed"
        assert [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s] == [
            "validating", "in_progress", "finalizing", "completed"]
        stamps = [batch[k] for k in ("created_at", "in_progress_at", "finalizing_at", "completed_at")]
        assert all(isinstance(t, int) for t in stamps) and stamps == sorted(stamps)
        assert batch["failed_at"] is None and batch["cancelled_at"] is None and batch["errors"] is None
        assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        assert batch["model"] == "m" and batch["error_file_id"] is None
        out = content(client, batch["output_file_id"])
        assert sorted(line["custom_id"] for line in out) == sorted(f"r{i}" for i in range(12))
        for line in out:
            assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
            assert line["id"].startswith("batch_req_")
            assert line["response"]["status_code"] == 200
            assert line["response"]["request_id"].startswith("req_")
        # each answer is the online route's answer to the same body
        by_id = {line["custom_id"]: line["response"]["body"] for line in out}
        online = client.post("/chat/completions", json=lines[5]["body"]).json()
        assert by_id["r5"]["choices"] == online["choices"] and by_id["r5"]["usage"] == online["usage"]
        usage = batch["usage"]
        assert usage["input_tokens"] == sum(b["usage"]["prompt_tokens"] for b in by_id.values())
        assert usage["output_tokens"] == sum(b["usage"]["completion_tokens"] for b in by_id.values())
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        assert usage["input_tokens_details"] == {"cached_tokens": 0}
        # billed once each, as batch lines, plus the one online request
        records = [r for r in server.log if r.api == "batch:chat"]
        assert sorted(r.custom_id or "" for r in records) == sorted(f"r{i}" for i in range(12))
        assert {r.batch_id for r in records} == {batch["id"]}
        assert server.billed_by_key() == Counter({f"hello {i}": 1 for i in range(12)}) + Counter(["hello 5"])
        output_file = client.get(f"/files/{batch['output_file_id']}").json()
        assert output_file["purpose"] == "batch_output"
        assert output_file["filename"] == f"batch_{batch['id']}_output.jsonl"


def test_responses_batch_structured_answers_match_online() -> None:
    with serving() as (server, client, _):
        fmt = {"format": {"type": "json_schema", "name": "t", "schema": SCHEMA, "strict": True}}
        lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "m", "input": f"ticket {i}", "text": fmt}} for i in range(4)]
        batch = wait_openai(client, create_batch(client, lines, endpoint="/v1/responses")["id"])
        assert batch["status"] == "completed" and batch["endpoint"] == "/v1/responses"
        out = {line["custom_id"]: line["response"]["body"] for line in content(client, batch["output_file_id"])}
        online = client.post("/responses", json=lines[2]["body"]).json()
        assert out["q2"]["output"][0]["content"] == online["output"][0]["content"]
        assert out["q2"]["object"] == "response" and out["q2"]["usage"] == online["usage"]
        assert {r.api for r in server.log} == {"batch:responses", "responses"}


def test_files_upload_retrieve_list_content_delete() -> None:
    with serving() as (_, client, _):
        data = os.urandom(3 * 1024 * 1024)  # binary, bigger than one read piece
        ids = [upload(client, data, "a.jsonl"), upload(client, b"x\n", "b.jsonl")]
        other = client.post("/files", files={"file": ("notes.txt", b"hi")}, data={"purpose": "user_data"})
        assert other.status_code == 200, other.text
        ids.append(other.json()["id"])
        meta = client.get(f"/files/{ids[0]}").json()
        assert meta == {"id": ids[0], "object": "file", "bytes": len(data), "created_at": meta["created_at"],
                        "filename": "a.jsonl", "purpose": "batch", "status": "processed",
                        "expires_at": meta["created_at"] + 30 * 86_400, "status_details": None}
        assert client.get(f"/files/{ids[0]}/content").content == data
        listed = client.get("/files").json()
        assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == ids[::-1]
        assert listed["first_id"] == ids[2] and listed["last_id"] == ids[0] and listed["has_more"] is False
        assert [f["id"] for f in client.get("/files?purpose=batch").json()["data"]] == ids[1::-1]
        page = client.get("/files", params={"limit": 1, "order": "asc"}).json()
        assert [f["id"] for f in page["data"]] == ids[:1] and page["has_more"] is True
        page = client.get("/files", params={"limit": 5, "order": "asc", "after": ids[0]}).json()
        assert [f["id"] for f in page["data"]] == ids[1:] and page["has_more"] is False
        assert client.delete(f"/files/{ids[1]}").json() == {"id": ids[1], "object": "file", "deleted": True}
        for path in (f"/files/{ids[1]}", f"/files/{ids[1]}/content"):
            gone = client.get(path)
            assert gone.status_code == 404 and gone.json()["error"]["type"] == "invalid_request_error"
        assert client.delete(f"/files/{ids[1]}").status_code == 404


@pytest.mark.parametrize("files,data,message", [
    ({"file": ("in.jsonl", b"{}\n")}, {}, "purpose"),
    (None, {"purpose": "batch"}, "multipart"),
    ({"file": ("in.csv", b"{}\n")}, {"purpose": "batch"}, "Must be .jsonl"),
    ({"file": ("in.jsonl", b"{}\n")}, {"purpose": "nonsense"}, "is not one of"),
])
def test_upload_refused(files: Any, data: dict[str, str], message: str) -> None:
    with serving() as (_, client, _):
        reply = client.post("/files", files=files, data=data)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"]
        assert client.get("/files").json()["data"] == []


def _serve_process(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "batchrun.testing", "serve", "--port", "0",
                             "--batch-state", str(tmp_path / "state")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode().strip().removeprefix("listening on ")


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_upload_of_hundreds_of_mb_streams_to_disk(tmp_path: Path) -> None:
    size = 300 * 1024 * 1024
    piece = (b'{"custom_id":"x","method":"POST","url":"/v1/chat/completions","body":{}}' + b" " * 951 + b"\n")
    assert len(piece) == 1024

    def body(boundary: bytes) -> Iterator[bytes]:
        yield (b"--%s\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--%s\r\n"
               b"Content-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
               b"Content-Type: application/octet-stream\r\n\r\n" % (boundary, boundary))
        block = piece * 1024
        for _ in range(size // len(block)):
            yield block
        yield b"\r\n--%s--\r\n" % boundary

    proc, base_url = _serve_process(tmp_path)
    try:
        before = _peak_rss_kib(proc.pid)
        with httpx.Client(base_url=base_url, timeout=120.0) as client:
            reply = client.post("/files", content=body(b"b0undary"),
                                headers={"content-type": "multipart/form-data; boundary=b0undary"})
            assert reply.status_code == 200, reply.text
            file_id = reply.json()["id"]
            assert reply.json()["bytes"] == size
            received = 0
            with client.stream("GET", f"/files/{file_id}/content") as stream:
                assert int(stream.headers["content-length"]) == size
                for chunk in stream.iter_bytes():
                    received += len(chunk)
            assert received == size
        grew_mib = (_peak_rss_kib(proc.pid) - before) / 1024
        assert grew_mib < 64, f"the server grew by {grew_mib:.0f} MiB for a {size >> 20} MiB upload"
        assert (tmp_path / "state" / "files" / f"{file_id}.data").stat().st_size == size
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_chunked_upload_and_expect_continue() -> None:
    with serving() as (server, client, _):
        form = (b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"c.jsonl\"\r\n\r\n"
                + jsonl([chat_line("a")]) + b"\r\n--xx\r\nContent-Disposition: form-data; "
                b"name=\"purpose\"\r\n\r\nbatch\r\n--xx--\r\n")
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(form[i:i + 7]), form[i:i + 7])
                          for i in range(0, len(form), 7)) + b"0\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"Expect: 100-continue\r\nContent-Type: multipart/form-data; boundary=xx\r\n\r\n")
            f = sock.makefile("rb")
            assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
            sock.sendall(chunks)
            assert f.readline().startswith(b"HTTP/1.1 200")
        listed = client.get("/files").json()["data"]
        assert [(f["filename"], f["bytes"]) for f in listed] == [("c.jsonl", len(jsonl([chat_line("a")])))]


def test_batch_list_newest_first_with_after_pagination() -> None:
    with serving(BatchFaults(turnaround_s=5.0)) as (_, client, _):
        ids = [create_batch(client, [chat_line(f"r{i}")])["id"] for i in range(5)]
        newest_first = ids[::-1]
        seen: list[str] = []
        after: str | None = None
        while True:
            page = client.get("/batches", params={"limit": 2, **({"after": after} if after else {})}).json()
            assert page["object"] == "list"
            got = [b["id"] for b in page["data"]]
            assert page["first_id"] == got[0] and page["last_id"] == got[-1]
            seen += got
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert seen == newest_first
        assert [b["id"] for b in client.get("/batches").json()["data"]] == newest_first
        for limit in (0, 101, "x"):
            assert client.get("/batches", params={"limit": limit}).status_code == 400


def test_validation_failure_names_each_bad_line() -> None:
    with serving() as (_, client, _):
        lines = [jsonl([chat_line("a")]), b"{not json\n", jsonl([chat_line("a")]),
                 jsonl([chat_line("c", url="/v1/responses")]), jsonl([chat_line("d", model="other")]),
                 jsonl([{**chat_line("e"), "method": "GET"}]), jsonl([{**chat_line("f"), "custom_id": ""}])]
        file_id = upload(client, b"".join(lines))
        created = client.post("/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}).json()
        batch = wait_openai(client, created["id"])
        assert batch["status"] == "failed" and isinstance(batch["failed_at"], int)
        assert batch["in_progress_at"] is None and batch["output_file_id"] is None
        assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
        errors = batch["errors"]
        assert errors["object"] == "list"
        assert [(e["code"], e["line"], e["param"]) for e in errors["data"]] == [
            ("invalid_json_line", 2, None), ("duplicate_custom_id", 3, "custom_id"),
            ("url_mismatch", 4, "url"), ("model_mismatch", 5, "body.model"),
            ("invalid_method", 6, "method"), ("missing_required_parameter", 7, "custom_id")]
        assert all(e["message"] for e in errors["data"])


@pytest.mark.parametrize("data,code", [(b"", "empty_file"), (b"\n\n", "empty_file"),
                                       (jsonl([chat_line(f"r{i}") for i in range(4)]), "too_many_tasks")])
def test_validation_failure_of_the_whole_file(data: bytes, code: str) -> None:
    with serving(BatchFaults(turnaround_s=0.5, max_file_requests=3)) as (_, client, _):
        created = client.post("/batches", json={"input_file_id": upload(client, data),
                                                "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"}).json()
        batch = wait_openai(client, created["id"])
        assert batch["status"] == "failed"
        assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [(code, None)]


@pytest.mark.slow
def test_token_limit_exceeded_counts_unfinished_batches_of_the_model() -> None:
    # each line: one user message of 20 chars = 6 tokens by the fake's count
    lines = [chat_line(f"r{i}", "x" * 20) for i in range(5)]  # 30 tokens
    with serving(BatchFaults(turnaround_s=1.5, enqueued_token_limit=50)) as (_, client, _):
        first = create_batch(client, lines)
        wait_openai(client, first["id"], ("in_progress",))
        second = wait_openai(client, create_batch(client, lines)["id"])
        assert second["status"] == "failed"
        (error,) = second["errors"]["data"]
        assert error["code"] == "token_limit_exceeded" and error["line"] is None
        assert "Limit: 50 enqueued tokens" in error["message"]
        other_model = wait_openai(client, create_batch(client, [chat_line("o", "x" * 20, model="n")])["id"])
        assert other_model["status"] == "completed"
        assert wait_openai(client, first["id"])["status"] == "completed"
        assert wait_openai(client, create_batch(client, lines)["id"])["status"] == "completed"
        alone_too_big = [chat_line(f"b{i}", "x" * 20) for i in range(9)]  # 54 tokens
        too_big = wait_openai(client, create_batch(client, alone_too_big)["id"])
        assert too_big["errors"]["data"][0]["code"] == "token_limit_exceeded"


def _partial(client: httpx.Client, batch: dict[str, Any], why: str, n: int) -> None:
    """An ended batch kept what it answered; the rest are ``why`` lines in the error file."""
    out = content(client, batch["output_file_id"])
    errors = content(client, batch["error_file_id"])
    assert 0 < len(out) < n, (len(out), batch)
    assert len(out) + len(errors) == n
    assert sorted(line["custom_id"] for line in out + errors) == sorted(f"r{i}" for i in range(n))
    for line in errors:
        assert line["response"] is None and line["error"]["code"] == why and line["error"]["message"]
    assert batch["request_counts"] == {"total": n, "completed": len(out), "failed": len(errors)}


def test_cancel_part_way_keeps_partial_results() -> None:
    n = 40
    with serving(BatchFaults(turnaround_s=2.0, validating_s=0.1, finalizing_s=0.1, cancel_s=0.3)) as (
            server, client, _):
        created = create_batch(client, [chat_line(f"r{i}") for i in range(n)])
        wait_until(lambda: client.get(f"/batches/{created['id']}").json(),
                   lambda b: b["request_counts"]["completed"] >= n // 3)
        cancelling = client.post(f"/batches/{created['id']}/cancel").json()
        assert cancelling["status"] == "cancelling" and isinstance(cancelling["cancelling_at"], int)
        answered = cancelling["request_counts"]["completed"]
        time.sleep(0.1)
        assert client.get(f"/batches/{created['id']}").json()["request_counts"]["completed"] == answered
        assert client.post(f"/batches/{created['id']}/cancel").json()["status"] == "cancelling"
        batch = wait_openai(client, created["id"])
        assert batch["status"] == "cancelled" and batch["cancelled_at"] >= batch["cancelling_at"]
        assert batch["completed_at"] is None
        _partial(client, batch, "batch_cancelled", n)
        assert sum(server.billed_by_key().values()) == answered
        again = client.post(f"/batches/{created['id']}/cancel")
        assert again.status_code == 400 and "cancelled" in again.json()["error"]["message"]


def test_expiry_part_way_keeps_partial_results() -> None:
    n = 40
    with serving(BatchFaults(turnaround_s=3.0, expire_after_s=1.0)) as (server, client, _):
        created = create_batch(client, [chat_line(f"r{i}") for i in range(n)])
        assert created["expires_at"] - created["created_at"] in (0, 1, 2)
        batch = wait_openai(client, created["id"])
        assert batch["status"] == "expired" and isinstance(batch["expired_at"], int)
        _partial(client, batch, "batch_expired", n)
        assert sum(server.billed_by_key().values()) == batch["request_counts"]["completed"]


def test_line_failures_go_to_the_error_file_as_responses() -> None:
    n = 60
    with serving(BatchFaults(turnaround_s=0.5, p_line_500=0.25, p_line_400=0.25, seed=3)) as (
            server, client, _):
        batch = wait_openai(client, create_batch(client, [chat_line(f"r{i}") for i in range(n)])["id"])
        assert batch["status"] == "completed"
        out, errors = content(client, batch["output_file_id"]), content(client, batch["error_file_id"])
        assert {line["response"]["status_code"] for line in errors} == {400, 500}
        for line in errors:  # a failure inside a 200 file: error stays null
            assert line["error"] is None and line["response"]["body"]["error"]["message"]
        assert len(out) + len(errors) == n and 10 < len(errors) < 50
        assert batch["request_counts"] == {"total": n, "completed": len(out), "failed": len(errors)}
        assert sum(server.billed_by_key().values()) == len(out)
        assert Counter(r.outcome for r in server.log) == Counter(
            ok=len(out), **{"500": sum(1 for e in errors if e["response"]["status_code"] == 500),
                            "400": sum(1 for e in errors if e["response"]["status_code"] == 400)})


def test_every_line_failed_means_no_output_file() -> None:
    with serving(BatchFaults(turnaround_s=0.3, p_line_500=1.0)) as (server, client, _):
        batch = wait_openai(client, create_batch(client, [chat_line(f"r{i}") for i in range(5)])["id"])
        assert batch["status"] == "completed" and batch["output_file_id"] is None
        assert len(content(client, batch["error_file_id"])) == 5
        assert server.billed_by_key() == Counter()


@pytest.mark.parametrize("quirk,expected", [("null", None), ("empty", ""), ("absent", "absent")])
def test_error_file_id_when_no_line_failed(quirk: Any, expected: str | None) -> None:
    with serving(BatchFaults(turnaround_s=0.3, clean_error_file_id=quirk)) as (_, client, _):
        batch = wait_openai(client, create_batch(client, [chat_line("a")])["id"])
        assert batch.get("error_file_id", "absent") == expected
        assert batch["output_file_id"]


def test_result_order_is_shuffled_unless_told_not_to() -> None:
    ids = [f"r{i:02d}" for i in range(30)]
    orders = []
    for shuffle in (True, False):
        with serving(BatchFaults(turnaround_s=0.3, shuffle=shuffle, seed=5)) as (_, client, _):
            batch = wait_openai(client, create_batch(client, [chat_line(i) for i in ids])["id"])
            orders.append([line["custom_id"] for line in content(client, batch["output_file_id"])])
    assert sorted(orders[0]) == ids and orders[0] != ids
    assert orders[1] == ids


def test_create_refusals_and_unknown_ids() -> None:
    with serving() as (_, client, _):
        file_id = upload(client, jsonl([chat_line("a")]))
        other = client.post("/files", files={"file": ("x.txt", b"x")}, data={"purpose": "user_data"}).json()["id"]
        good = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        for change in ({"input_file_id": "file-nope"}, {"input_file_id": other},
                       {"endpoint": "/v1/nope"}, {"endpoint": "/v1/embeddings"},
                       {"completion_window": "1h"}, {"metadata": {f"k{i}": "v" for i in range(17)}},
                       {"metadata": {"k": "v" * 513}}, {"input_file_id": None}):
            reply = client.post("/batches", json={**good, **change})
            assert reply.status_code == 400, (change, reply.text)
            assert reply.json()["error"]["type"] == "invalid_request_error"
        assert client.post("/batches", content=b"{oops").status_code == 400
        assert client.get("/batches").json()["data"] == []
        assert client.get("/batches/batch_nope").status_code == 404
        assert client.post("/batches/batch_nope/cancel").status_code == 404
        assert client.put("/batches").status_code == 404
        assert client.get("/files/x/y/z").status_code == 404


def test_cancel_while_validating_ends_with_no_lines() -> None:
    with serving(BatchFaults(turnaround_s=2.0, validating_s=1.0, cancel_s=0.1)) as (server, client, _):
        created = create_batch(client, [chat_line(f"r{i}") for i in range(5)])
        assert client.post(f"/batches/{created['id']}/cancel").json()["status"] == "cancelling"
        batch = wait_openai(client, created["id"])
        assert batch["status"] == "cancelled" and batch["in_progress_at"] is None
        assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
        assert batch["output_file_id"] is None and batch["error_file_id"] is None
        assert server.billed_by_key() == Counter()
