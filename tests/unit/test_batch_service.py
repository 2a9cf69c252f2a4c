"""batchrun.testing's batch routes as a whole, over real HTTP: faults of the HTTP calls (5xx after
create, 429/5xx on polls), auth, restarts on a state directory (nothing billed twice), the log,
the command line, and the online routes left as they were."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest

from batchrun.testing import BatchFaults, FakeProviderServer, Faults
from tests.unit.batch_helpers import (
    ANTHROPIC_HEADERS,
    chat_line,
    content,
    jsonl,
    messages_request,
    parse_jsonl,
    serving,
    upload,
    wait_anthropic,
    wait_openai,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parents[2]
CREATE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


def test_5xx_on_create_after_the_batch_was_created() -> None:
    with serving(BatchFaults(turnaround_s=0.4, p_create_500=1.0)) as (server, openai, anthropic):
        reply = openai.post("/batches", json={"input_file_id": upload(openai, jsonl([chat_line("a")])),
                                              **CREATE, "metadata": {"shard": "s1"}})
        assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
        (listed,) = openai.get("/batches").json()["data"]
        assert listed["metadata"] == {"shard": "s1"}
        assert wait_openai(openai, listed["id"])["status"] == "completed"
        reply = anthropic.post("/v1/messages/batches", json={"requests": [messages_request("a")]})
        assert reply.status_code == 500 and reply.json()["error"]["type"] == "api_error"
        (listed,) = anthropic.get("/v1/messages/batches").json()["data"]
        assert wait_anthropic(anthropic, listed["id"])["request_counts"]["succeeded"] == 1
        assert server.billed_by_key() == Counter({"a": 2})


def test_5xx_on_upload_after_the_file_was_stored() -> None:
    with serving(BatchFaults(p_upload_500=1.0)) as (_, openai, _):
        reply = openai.post("/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"})
        assert reply.status_code == 500
        (listed,) = openai.get("/files").json()["data"]
        assert listed["filename"] == "in.jsonl" and openai.get(f"/files/{listed['id']}/content").content == b"{}\n"


def test_429_and_5xx_on_polls_but_not_on_creates() -> None:
    faults = BatchFaults(turnaround_s=0.3, p_poll_429=0.3, p_poll_500=0.3, seed=4)
    with serving(faults, Faults(retry_after_s=2.0)) as (_, openai, anthropic):
        file_id = upload(openai, jsonl([chat_line("a")]))
        batch_id = openai.post("/batches", json={"input_file_id": file_id, **CREATE}).json()["id"]
        msg_id = anthropic.post("/v1/messages/batches", json={"requests": [messages_request("a")]}).json()["id"]
        statuses: Counter[int] = Counter()
        for path, client in ((f"/batches/{batch_id}", openai), ("/batches", openai),
                             (f"/files/{file_id}", openai), (f"/v1/messages/batches/{msg_id}", anthropic),
                             ("/v1/messages/batches", anthropic)):
            for _ in range(30):
                reply = client.get(path)
                statuses[reply.status_code] += 1
                if reply.status_code == 429:
                    assert reply.headers["retry-after"] == "2"
                    assert reply.json()["error"]["type"] in ("requests", "rate_limit_error")
                elif reply.status_code == 500:
                    assert "error" in reply.json()
        assert set(statuses) == {200, 429, 500} and statuses[200] > 20


def test_api_key_is_checked_on_every_batch_route() -> None:
    with serving(api_key="sk-test") as (_, openai, anthropic):
        assert openai.get("/batches").status_code == 401
        assert openai.post("/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}).status_code == 401
        assert anthropic.get("/v1/messages/batches").status_code == 401
        assert openai.get("/batches", headers={"authorization": "Bearer sk-test"}).status_code == 200
        assert anthropic.get("/v1/messages/batches", headers={"x-api-key": "sk-test"}).status_code == 200
        wrong = anthropic.get("/v1/messages/batches", headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and "nope" not in wrong.text


@pytest.mark.slow
def test_restart_on_a_state_dir_mid_batch_bills_nothing_twice(tmp_path: Path) -> None:
    state, log = tmp_path / "state", tmp_path / "server.jsonl"
    faults = BatchFaults(turnaround_s=3.0, validating_s=0.1, finalizing_s=0.1)
    n = 60
    first = FakeProviderServer(batch_faults=faults, batch_state_dir=state, log_path=log).start()
    port = first.port
    try:
        with httpx.Client(base_url=first.base_url, timeout=10) as openai, \
                httpx.Client(base_url=first.anthropic_base_url, timeout=10, headers=ANTHROPIC_HEADERS) as anthropic:
            file_id = upload(openai, jsonl([chat_line(f"o{i}") for i in range(n)]))
            batch_id = openai.post("/batches", json={"input_file_id": file_id, **CREATE}).json()["id"]
            msg_id = anthropic.post("/v1/messages/batches", json={
                "requests": [messages_request(f"a{i}") for i in range(n)]}).json()["id"]
            wait_until(lambda: {}, lambda _: len(first.log) >= n // 2)
    finally:
        first.stop()
    before = Counter(r.custom_id for r in first.log)
    assert 0 < len(before) < 2 * n and set(before.values()) == {1}
    time.sleep(0.3)  # the server is down while the clock runs on
    second = FakeProviderServer(port=port, batch_faults=faults, batch_state_dir=state, log_path=log).start()
    try:
        assert second.port == port
        with httpx.Client(base_url=second.base_url, timeout=10) as openai, \
                httpx.Client(base_url=second.anthropic_base_url, timeout=10, headers=ANTHROPIC_HEADERS) as anthropic:
            assert openai.get(f"/files/{file_id}").json()["bytes"] > 0
            batch = wait_openai(openai, batch_id)
            assert batch["status"] == "completed"
            assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
            assert sorted(line["custom_id"] for line in content(openai, batch["output_file_id"])) == sorted(
                f"o{i}" for i in range(n))
            msg = wait_anthropic(anthropic, msg_id)
            assert msg["request_counts"]["succeeded"] == n
            results = parse_jsonl(anthropic.get(msg["results_url"]).content)
            assert sorted(line["custom_id"] for line in results) == sorted(f"a{i}" for i in range(n))
            assert second.billed_by_key() == Counter({f"o{i}": 1 for i in range(n)} | {f"a{i}": 1 for i in range(n)})
            seqs = [r.seq for r in second.log]
            assert len(set(seqs)) == len(seqs)
            # the created_at of a batch is kept across the restart: its clock is the wall clock
            assert batch["created_at"] <= int(time.time()) - 2
    finally:
        second.stop()
    logged = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert Counter(r["custom_id"] for r in logged if r["status"] == 200) == Counter(
        {f"o{i}": 1 for i in range(n)} | {f"a{i}": 1 for i in range(n)})


def test_a_kill_between_journal_and_log_loses_nothing(tmp_path: Path) -> None:
    """A torn journal line is cut (that line is answered again, once); records the journal has
    and the log file lacks are written to it at the next start."""
    state, log = tmp_path / "state", tmp_path / "server.jsonl"
    faults = BatchFaults(turnaround_s=0.5)
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state, log_path=log) as server, \
            httpx.Client(base_url=server.anthropic_base_url, timeout=10, headers=ANTHROPIC_HEADERS) as client:
        batch_id = client.post("/v1/messages/batches", json={
            "requests": [messages_request(f"a{i}") for i in range(10)]}).json()["id"]
        wait_anthropic(client, batch_id)
    journal = state / "batches" / batch_id / "answered.jsonl"
    entries = journal.read_bytes().splitlines(keepends=True)
    assert len(entries) == 10
    # as if killed: the last line half written, the log file missing the last three records
    journal.write_bytes(b"".join(entries[:-1]) + entries[-1][: len(entries[-1]) // 2])
    record = orjson.loads(state.joinpath("batches", batch_id, "batch.json").read_bytes())
    record.update(status="in_progress", completed_at=None)
    state.joinpath("batches", batch_id, "batch.json").write_bytes(orjson.dumps(record))
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[:-3]))
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state, log_path=log) as server, \
            httpx.Client(base_url=server.anthropic_base_url, timeout=10, headers=ANTHROPIC_HEADERS) as client:
        batch = wait_anthropic(client, batch_id)
        assert batch["request_counts"]["succeeded"] == 10
        assert server.billed_by_key() == Counter({f"a{i}": 1 for i in range(10)})
    logged = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert Counter(r["custom_id"] for r in logged) == Counter({f"a{i}": 1 for i in range(10)})


def test_seq_goes_on_across_restarts_though_a_deleted_batch_took_its_journal(tmp_path: Path) -> None:
    """A batch answered and deleted, a restart, another batch answered, and a kill that lost its last log
    records: the next start writes them again, because seqs never repeat (the log file remembers them)."""
    state, log = tmp_path / "state", tmp_path / "server.jsonl"
    faults = BatchFaults(turnaround_s=0.3)

    def batch_of(prefix: str, delete: bool) -> None:
        with FakeProviderServer(batch_faults=faults, batch_state_dir=state, log_path=log) as server, \
                httpx.Client(base_url=server.anthropic_base_url, timeout=10, headers=ANTHROPIC_HEADERS) as client:
            batch_id = client.post("/v1/messages/batches", json={
                "requests": [messages_request(f"{prefix}{i}") for i in range(5)]}).json()["id"]
            wait_anthropic(client, batch_id)
            if delete:
                assert client.delete(f"/v1/messages/batches/{batch_id}").status_code == 200

    batch_of("a", delete=True)
    batch_of("b", delete=False)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[:-2]))  # as if killed before its last two records reached the file
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state, log_path=log):
        pass
    logged = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert sorted(r["custom_id"] for r in logged) == sorted([f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)])
    assert len({r["seq"] for r in logged}) == 10


def test_online_routes_keep_their_behaviour_while_batches_run() -> None:
    with serving(BatchFaults(turnaround_s=1.0)) as (server, openai, _):
        batch_id = openai.post("/batches", json={"input_file_id": upload(openai, jsonl([chat_line(
            f"b{i}") for i in range(20)])), **CREATE}).json()["id"]
        for i in range(20):
            reply = openai.post("/chat/completions", json={"model": "m", "messages": [
                {"role": "user", "content": f"online {i}"}]})
            assert reply.status_code == 200 and reply.headers["x-request-id"].startswith("req_")
        wait_openai(openai, batch_id)
        online = [r for r in server.log if r.api == "chat"]
        assert len(online) == 20 and all(r.batch_id is None and r.custom_id is None for r in online)
        assert server.ok_by_key() == Counter({f"online {i}": 1 for i in range(20)} | {f"b{i}": 1 for i in range(20)})
        assert server.batch_calls()["POST /v1/batches"] == 1
        assert server.batch_calls()["GET /v1/batches/{id}"] >= 1


def test_a_server_used_online_only_never_loads_the_batch_apis() -> None:
    code = ("import sys, httpx\nfrom batchrun.testing import FakeProviderServer\n"
            "with FakeProviderServer() as s:\n"
            "    r = httpx.post(s.base_url + '/chat/completions', json={'model': 'm', 'messages': []})\n"
            "    print(r.status_code, s.batch_calls(), 'batchrun.testing.batch_service' in sys.modules)\n"
            "    httpx.get(s.base_url + '/batches')\n"
            "    print('batchrun.testing.batch_service' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout.split("\n")
    assert out[:2] == ["200 Counter() False", "True"]


def test_cli_serve_batch_flags_and_a_restart(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def serve(port: int) -> tuple[subprocess.Popen[bytes], str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchrun.testing", "serve", "--port", str(port),
             "--batch-state", str(tmp_path / "state"), "--batch-turnaround", "0.5",
             "--batch-p-create-500", "1", "--batch-clean-error-file-id", "empty",
             "--batch-max-requests", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
        assert proc.stdout is not None
        return proc, proc.stdout.readline().decode().strip().removeprefix("listening on ")

    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
        assert proc.returncode == 0

    proc, base_url = serve(0)
    try:
        with httpx.Client(base_url=base_url, timeout=10) as client:
            reply = client.post("/batches", json={"input_file_id": upload(client, jsonl([chat_line("a")])), **CREATE})
            assert reply.status_code == 500
            (batch,) = client.get("/batches").json()["data"]
            too_many = client.post("/batches", json={"input_file_id": upload(client, jsonl(
                [chat_line(f"r{i}") for i in range(3)])), **CREATE})
            assert too_many.status_code == 500
    finally:
        stop(proc)
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    proc, base_url = serve(port)
    try:
        with httpx.Client(base_url=base_url, timeout=10) as client:
            done = wait_openai(client, batch["id"])
            assert done["status"] == "completed" and done["error_file_id"] == ""
            failed = [b for b in client.get("/batches").json()["data"] if b["id"] != batch["id"]]
            assert wait_openai(client, failed[0]["id"])["errors"]["data"][0]["code"] == "too_many_tasks"
    finally:
        stop(proc)


def test_a_kill_while_ending_writes_the_same_files_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    faults = BatchFaults(turnaround_s=0.4, p_line_500=0.5, seed=1)
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state) as server, \
            httpx.Client(base_url=server.base_url, timeout=10) as client:
        file_id = upload(client, jsonl([chat_line(f"r{i}") for i in range(10)]))
        batch = wait_openai(client, client.post("/batches", json={"input_file_id": file_id, **CREATE}).json()["id"])
        out, err = content(client, batch["output_file_id"]), content(client, batch["error_file_id"])
    path = state / "batches" / batch["id"] / "batch.json"
    record = orjson.loads(path.read_bytes())
    record.update(status="finalizing", completed_at=None)  # as if killed before saving the end
    path.write_bytes(orjson.dumps(record))
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state) as server, \
            httpx.Client(base_url=server.base_url, timeout=10) as client:
        again = wait_openai(client, batch["id"])
        assert (again["output_file_id"], again["error_file_id"]) == (batch["output_file_id"], batch["error_file_id"])
        assert sorted(map(str, content(client, again["output_file_id"]))) == sorted(map(str, out))
        assert len(content(client, again["error_file_id"])) == len(err)
        outputs = client.get("/files", params={"purpose": "batch_output"}).json()["data"]
        assert len(outputs) == 2
        assert server.billed_by_key() == Counter(line["custom_id"] for line in out)


def test_a_slow_create_makes_its_batch_though_the_client_left_and_logs_it(tmp_path: Path) -> None:
    """``create_s``: the batch is made that long after the body is in, whether the client is still there or
    not (a client timed out or killed meanwhile); each batch made is logged with its requests' keys, in the
    state directory, across a restart."""
    state = tmp_path / "state"
    faults = BatchFaults(turnaround_s=0.3, create_s=0.6)
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state) as server:
        with httpx.Client(base_url=server.base_url, timeout=10) as openai, \
                httpx.Client(base_url=server.anthropic_base_url, timeout=0.2, headers=ANTHROPIC_HEADERS) as gone:
            file_id = upload(openai, jsonl([chat_line("o1"), chat_line("o2")]))
            began = time.monotonic()
            made = openai.post("/batches", json={"input_file_id": file_id, **CREATE, "metadata": {"s": "1"}})
            assert made.status_code == 200 and time.monotonic() - began >= 0.6
            with pytest.raises(httpx.ReadTimeout):
                gone.post("/v1/messages/batches", json={"requests": [messages_request("a1")]})
            assert [b["kind"] for b in server.created_batches()] == ["openai"]
            wait_until(lambda: {}, lambda _: len(server.created_batches()) == 2)
        created = server.created_batches()
        assert [(b["kind"], b["total"], b["custom_ids"], b["keys"]) for b in created] == [
            ("openai", 2, ["o1", "o2"], ["o1", "o2"]), ("anthropic", 1, ["a1"], ["a1"])]
        assert created[0]["id"] == made.json()["id"] and created[0]["metadata"] == {"s": "1"}
        assert created[0]["input_file_id"] == file_id
    with FakeProviderServer(batch_faults=faults, batch_state_dir=state) as again:
        assert again.created_batches() == created
