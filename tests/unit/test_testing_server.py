"""Tests for batchrun.testing.FakeOpenAIServer, run against the real server over TCP."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from batchrun.testing import FakeOpenAIServer, Faults, RequestRecord, default_key_fn

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]


def chat(content: str, **extra: Any) -> dict[str, Any]:
    """A minimal Chat Completions request body."""
    return {"model": "gpt-test", "messages": [{"role": "user", "content": content}], **extra}


def wait_for(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Poll ``cond`` until true or timeout; returns its final value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def raw_request(path: str, body: bytes, *, extra_headers: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n" % (path.encode(), len(body), extra_headers)
    ) + body


def read_response(f: Any) -> tuple[int, dict[str, str], bytes]:
    """Read one Content-Length framed response from a socket file."""
    status_line = f.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = f.read(int(headers["content-length"]))
    return status, headers, body


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv


@pytest.fixture
def client(server: FakeOpenAIServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
        yield c


# ---------------------------------------------------------------------- normal operation


def test_ok_reply_echo_usage_and_headers(server: FakeOpenAIServer, client: httpx.Client) -> None:
    body = {
        "model": "gpt-test",
        "messages": [
            {"role": "system", "content": "You are terse."},  # 14 chars -> 4
            {"role": "user", "content": "first question"},  # 14 chars -> 4
            {"role": "assistant", "content": "ok"},  # 2 chars -> 1
            {"role": "user", "content": "hello world, how are you?"},  # 25 chars -> 7
        ],
    }
    r = client.post("/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-request-id"] == "req_0"
    assert "x-ratelimit-limit-requests" not in r.headers
    data = r.json()
    reply = "echo: hello world, how are you?"
    assert data["id"] == "chatcmpl-0"
    assert data["object"] == "chat.completion"
    assert data["model"] == "gpt-test"
    assert abs(data["created"] - time.time()) < 5
    assert data["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": reply},
        "finish_reason": "stop",
    }]
    completion = len(reply) // 4 + 1
    assert data["usage"] == {
        "prompt_tokens": 4 + 4 + 1 + 7,
        "completion_tokens": completion,
        "total_tokens": 16 + completion,
    }
    (rec,) = server.log
    assert rec == dataclasses.replace(
        rec, seq=0, method="POST", path="/v1/chat/completions", key="first question",
        outcome="ok", status=200, prompt_tokens=16, completion_tokens=completion,
    )
    assert rec.received_at <= rec.finished_at


def test_alternate_route_and_default_model(server: FakeOpenAIServer) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=5.0) as c:
        r = c.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    assert r.json()["model"] == "fake-model"
    assert r.json()["choices"][0]["message"]["content"] == "echo: x"
    assert server.log[0].path == "/chat/completions"


def test_keep_alive_reuses_one_connection(server: FakeOpenAIServer, client: httpx.Client) -> None:
    local_addrs = set()
    for i in range(10):
        r = client.post("/chat/completions", json=chat(f"msg {i}"))
        assert r.status_code == 200
        assert r.headers["connection"] == "keep-alive"
        assert r.json()["choices"][0]["message"]["content"] == f"echo: msg {i}"
        local_addrs.add(r.extensions["network_stream"].get_extra_info("client_addr"))
    assert len(local_addrs) == 1
    assert [rec.seq for rec in server.log] == list(range(10))


def test_connection_close_is_honoured(server: FakeOpenAIServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("bye")),
                              extra_headers=b"Connection: close\r\n"))
        with s.makefile("rb") as f:
            status, headers, body = read_response(f)
            assert status == 200
            assert headers["connection"] == "close"
            assert orjson.loads(body)["choices"][0]["message"]["content"] == "echo: bye"
            assert f.read() == b""  # server closed its side


def test_pipelined_and_chunked_requests(server: FakeOpenAIServer) -> None:
    payload = orjson.dumps(chat("chunky"))
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % 10 + payload[:10] + b"\r\n"
        + b"%x;ext=1\r\n" % (len(payload) - 10) + payload[10:] + b"\r\n"
        + b"0\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("one")))
                  + chunked
                  + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        with s.makefile("rb") as f:
            replies = [read_response(f) for _ in range(3)]
    assert [st for st, _, _ in replies] == [200, 200, 200]
    assert orjson.loads(replies[0][2])["choices"][0]["message"]["content"] == "echo: one"
    assert orjson.loads(replies[1][2])["choices"][0]["message"]["content"] == "echo: chunky"
    assert orjson.loads(replies[2][2]) == {"ok": True}
    assert [r.key for r in server.log] == ["one", "chunky"]  # /health is not logged


def test_expect_100_continue(server: FakeOpenAIServer) -> None:
    payload = orjson.dumps(chat("patience"))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(payload))
        with s.makefile("rb") as f:
            assert f.readline() == b"HTTP/1.1 100 Continue\r\n"
            assert f.readline() == b"\r\n"
            s.sendall(payload)
            status, _, body = read_response(f)
    assert status == 200
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "echo: patience"


def test_latency_is_applied() -> None:
    with FakeOpenAIServer(Faults(latency_s=0.2, latency_jitter_s=0.1, seed=1)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        t0 = time.perf_counter()
        r = c.post("/chat/completions", json=chat("slow"))
        elapsed = time.perf_counter() - t0
    assert r.status_code == 200
    assert 0.2 <= elapsed < 1.5


# ---------------------------------------------------------------------- errors and faults


def test_429_retry_after_headers() -> None:
    with FakeOpenAIServer(Faults(p_429=1.0, retry_after_s=0.25)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        r = c.post("/chat/completions", json=chat("a"))
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"  # whole seconds, rounded up
        assert r.headers["retry-after-ms"] == "250"
        assert r.json() == {"error": {
            "message": "Rate limit reached for requests.", "type": "requests", "param": None,
            "code": "rate_limit_exceeded",
        }}
        srv.faults.retry_after_s = 2.0
        r = c.post("/chat/completions", json=chat("a"))
        assert r.headers["retry-after"] == "2"
        assert "retry-after-ms" not in r.headers
        srv.faults.retry_after_s = None
        r = c.post("/chat/completions", json=chat("a"))
        assert r.status_code == 429
        assert "retry-after" not in r.headers
        assert "retry-after-ms" not in r.headers
    assert [(rec.outcome, rec.status) for rec in srv.log] == [("429", 429)] * 3


@pytest.mark.parametrize(("field", "status", "etype"), [
    ("p_500", 500, "server_error"),
    ("p_503", 503, "overloaded"),
])
def test_server_errors(field: str, status: int, etype: str) -> None:
    with FakeOpenAIServer(Faults(**{field: 1.0})) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        r = c.post("/chat/completions", json=chat("a"))
        assert r.status_code == status
        assert r.headers["x-request-id"] == "req_0"
        err = r.json()["error"]
        assert err["type"] == etype
        assert err["param"] is None
        assert err["message"]
        # the connection stays usable after an error response
        srv.faults = Faults()
        assert c.post("/chat/completions", json=chat("b")).status_code == 200
    assert [(rec.outcome, rec.status) for rec in srv.log] == [(str(status), status), ("ok", 200)]


def test_reset_drops_connection_with_rst() -> None:
    with FakeOpenAIServer(Faults(p_reset=1.0)) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
            with pytest.raises(httpx.TransportError):
                c.post("/chat/completions", json=chat("boom"))
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("boom"))))
            with pytest.raises(ConnectionResetError):
                s.recv(1024)
        assert wait_for(lambda: len(srv.log) == 2)
    assert [(r.outcome, r.status, r.key) for r in srv.log] == [("reset", None, "boom")] * 2


def test_hang_until_client_gives_up() -> None:
    with FakeOpenAIServer(Faults(p_hang=1.0)) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=httpx.Timeout(5.0, read=0.5)) as c:
            t0 = time.perf_counter()
            with pytest.raises(httpx.ReadTimeout):
                c.post("/chat/completions", json=chat("wait"))
            assert time.perf_counter() - t0 >= 0.5
        assert srv.requests_by_key() == {"wait": 1}
        # the client closed its socket, which ends the hang on the server side
        assert wait_for(lambda: len(srv.log) == 1)
    (rec,) = srv.log
    assert (rec.outcome, rec.status, rec.key) == ("hang", None, "wait")
    assert rec.finished_at - rec.received_at >= 0.4


def test_bad_body_is_invalid_json_but_connection_survives() -> None:
    with FakeOpenAIServer(Faults(p_bad_body=1.0)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        r = c.post("/chat/completions", json=chat("x"))
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert r.content == b'{"id": "chatcmpl-broken", "choices": ['
        with pytest.raises(ValueError):
            r.json()
        srv.faults.p_bad_body = 0.0
        assert c.post("/chat/completions", json=chat("y")).status_code == 200
    assert [r.outcome for r in srv.log] == ["bad_body", "ok"]


def test_truncated_body_raises_protocol_error() -> None:
    with FakeOpenAIServer(Faults(p_truncated=1.0)) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete|complete message"):
                c.post("/chat/completions", json=chat("cut"))
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("cut"))))
            with s.makefile("rb") as f:
                status_line = f.readline()
                headers = {}
                while (line := f.readline()) != b"\r\n":
                    name, _, value = line.decode().partition(":")
                    headers[name.lower()] = value.strip()
                rest = f.read()  # until the server closes
        assert status_line.startswith(b"HTTP/1.1 200")
        assert 0 < len(rest) < int(headers["content-length"])
    assert [(r.outcome, r.status) for r in srv.log] == [("truncated", 200)] * 2


def test_status_override_401() -> None:
    with FakeOpenAIServer(Faults(status_override=401, p_500=1.0)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        r = c.post("/chat/completions", json=chat("key?"))
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key"
    assert err["type"] == "invalid_request_error"
    assert [(rec.outcome, rec.status) for rec in srv.log] == [("status_401", 401)]


def test_burst_429_windows() -> None:
    faults = Faults(burst_429_period_s=1.0, burst_429_duration_s=0.4)
    with FakeOpenAIServer(faults) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        started = time.monotonic()  # the burst clock starts at or just before this
        r1 = c.post("/chat/completions", json=chat("a"))  # phase ~0.0 -> in burst
        time.sleep(max(0.0, started + 0.65 - time.monotonic()))
        r2 = c.post("/chat/completions", json=chat("a"))  # phase ~0.65 -> outside
        time.sleep(max(0.0, started + 1.1 - time.monotonic()))
        r3 = c.post("/chat/completions", json=chat("a"))  # phase ~0.1 -> in burst
    assert r1.status_code == 429
    assert r1.json()["error"]["code"] == "rate_limit_exceeded"
    assert r1.headers["retry-after"] == "1"
    assert 0 < int(r1.headers["retry-after-ms"]) <= 400
    assert r2.status_code == 200
    assert r3.status_code == 429
    assert [rec.outcome for rec in srv.log] == ["429", "ok", "429"]


def test_rpm_limit_sliding_window() -> None:
    with FakeOpenAIServer(Faults(rpm_limit=5)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        replies = [c.post("/chat/completions", json=chat(f"r{i}")) for i in range(7)]
        srv.faults.rpm_limit = 8  # raising the limit frees slots immediately
        later = c.post("/chat/completions", json=chat("later"))
    assert [r.status_code for r in replies] == [200] * 5 + [429, 429]
    assert [r.headers["x-ratelimit-limit-requests"] for r in replies] == ["5"] * 7
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == [
        "4", "3", "2", "1", "0", "0", "0"]
    blocked = replies[5]
    assert blocked.json()["error"]["code"] == "rate_limit_exceeded"
    assert blocked.headers["retry-after"] == "60"
    assert 58_000 < int(blocked.headers["retry-after-ms"]) <= 60_000
    assert later.status_code == 200
    assert later.headers["x-ratelimit-limit-requests"] == "8"
    assert later.headers["x-ratelimit-remaining-requests"] == "2"
    assert srv.ok_by_key() == {f"r{i}": 1 for i in range(5)} | {"later": 1}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_truncates_reply(server: FakeOpenAIServer, client: httpx.Client,
                                    field: str) -> None:
    text = "a fairly long user message that will not fit"
    r = client.post("/chat/completions", json=chat(text, **{field: 3}))
    data = r.json()
    assert data["choices"][0]["message"]["content"] == ("echo: " + text)[:12]
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 3
    assert server.log[0].completion_tokens == 3
    # a generous limit changes nothing
    r = client.post("/chat/completions", json=chat("short", **{field: 100}))
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["message"]["content"] == "echo: short"


def test_not_found_bad_request_and_health(server: FakeOpenAIServer, client: httpx.Client) -> None:
    r = client.post("/embeddings", json={"input": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "/v1/embeddings" in r.json()["error"]["message"]
    assert client.get("/chat/completions").status_code == 404
    r = client.post("/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert client.post("/chat/completions", json=[1, 2]).status_code == 400
    r = client.get(f"http://127.0.0.1:{server.port}/health")
    assert (r.status_code, r.json()) == (200, {"ok": True})
    assert [(rec.outcome, rec.status, rec.method) for rec in server.log] == [
        ("not_found", 404, "POST"), ("not_found", 404, "GET"),
        ("bad_request", 400, "POST"), ("bad_request", 400, "POST"),
    ]
    assert all(rec.key is None for rec in server.log)


def test_malformed_http_gets_400_and_close(server: FakeOpenAIServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        with s.makefile("rb") as f:
            status, headers, _ = read_response(f)
            assert (status, headers["connection"]) == (400, "close")
            assert f.read() == b""
    assert server.log == []


# ---------------------------------------------------------------------- log and counters


def test_log_counters_and_reset() -> None:
    with FakeOpenAIServer(Faults(p_429=0.5, retry_after_s=None, seed=7)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        statuses = {k: [c.post("/chat/completions", json=chat(k)).status_code for _ in range(n)]
                    for k, n in (("a", 8), ("b", 5), ("c", 3))}
        c.post("/nope", json=chat("a"))  # counted per key, never ok
        log = srv.log
        assert len(log) == 17
        assert [r.seq for r in log] == list(range(17))
        assert srv.requests_by_key() == {"a": 9, "b": 5, "c": 3}
        assert srv.ok_by_key() == {k: v.count(200) for k, v in statuses.items() if 200 in v}
        assert {r.outcome for r in log} == {"ok", "429", "not_found"}
        # one 1-char message -> 1 prompt token; 404s do no work
        assert {(r.outcome, r.prompt_tokens) for r in log if r.outcome != "ok"} == {
            ("429", 1), ("not_found", 0)}
        assert {(r.prompt_tokens, r.completion_tokens) for r in log if r.outcome == "ok"} == {
            (1, 2)}  # "echo: a" -> 7 chars -> 2 completion tokens
        log.clear()  # a snapshot: the server's log is unaffected
        assert len(srv.log) == 17
        srv.reset_log()
        assert srv.log == []
        assert srv.requests_by_key() == {}
        srv.faults.p_429 = 0.0
        c.post("/chat/completions", json=chat("z"))
    assert [(r.seq, r.key) for r in srv.log] == [(17, "z")]  # seq keeps counting
    assert srv.ok_by_key() == {"z": 1}


def test_custom_key_fn() -> None:
    def key_fn(body: dict[str, Any]) -> str | None:
        return body.get("metadata", {}).get("id")

    with FakeOpenAIServer(key_fn=key_fn) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        c.post("/chat/completions", json=chat("x", metadata={"id": "row-1"}))
        c.post("/chat/completions", json=chat("x"))
    assert srv.requests_by_key() == {"row-1": 1}
    assert [r.key for r in srv.log] == ["row-1", None]


def test_default_key_fn() -> None:
    assert default_key_fn({"messages": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "last"}, {"role": "assistant", "content": "y"},
    ]}) == "first"
    assert default_key_fn({"messages": [{"role": "system", "content": "s"}]}) is None
    assert default_key_fn({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) is None
    assert default_key_fn({}) is None


def test_log_path_file(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with FakeOpenAIServer(Faults(p_500=0.5, seed=3), log_path=path) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        for i in range(6):
            c.post("/chat/completions", json=chat(f"k{i}"))
        c.post("/missing", content=b"plain text")
        # flushed per line: readable while the server still runs
        lines = path.read_bytes().splitlines()
        assert len(lines) == 7
    rows = [orjson.loads(line) for line in lines]
    assert [RequestRecord(**row) for row in rows] == srv.log
    assert rows[0]["key"] == "k0"
    assert rows[-1]["outcome"] == "not_found" and rows[-1]["key"] is None
    # appends across restarts
    with FakeOpenAIServer(log_path=path) as srv2, \
            httpx.Client(base_url=srv2.base_url, timeout=5.0) as c:
        c.post("/chat/completions", json=chat("again"))
    assert len(path.read_bytes().splitlines()) == 8


def _outcomes(seed: int | None) -> list[str]:
    faults = Faults(p_429=0.2, p_500=0.2, p_503=0.2, p_bad_body=0.1, retry_after_s=None,
                    seed=seed)
    with FakeOpenAIServer(faults) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        for i in range(40):
            c.post("/chat/completions", json=chat(str(i)))
    return [r.outcome for r in srv.log]


def test_seeded_reproducibility() -> None:
    first = _outcomes(1234)
    assert first == _outcomes(1234)
    assert {"ok", "429", "500", "503", "bad_body"} <= set(first)
    assert _outcomes(4321) != first


# ---------------------------------------------------------------------- lifecycle


def test_stop_is_quick_with_hung_connection() -> None:
    srv = FakeOpenAIServer(Faults(p_hang=1.0)).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("stuck"))))
            assert wait_for(lambda: srv.requests_by_key() == {"stuck": 1})
            t0 = time.perf_counter()
            srv.stop()
            assert time.perf_counter() - t0 < 1.0
            try:
                assert s.recv(1024) == b""  # the server dropped the connection
            except ConnectionResetError:
                pass
    finally:
        srv.stop()
    srv.stop()  # idempotent
    assert [(r.outcome, r.status) for r in srv.log] == [("hang", None)]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()


def test_stop_during_latency_records_reset() -> None:
    srv = FakeOpenAIServer(Faults(latency_s=30.0)).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("slow"))))
            assert wait_for(lambda: srv.requests_by_key() == {"slow": 1})
            t0 = time.perf_counter()
            srv.stop()
            assert time.perf_counter() - t0 < 1.0
    finally:
        srv.stop()
    assert [(r.outcome, r.status) for r in srv.log] == [("reset", None)]


def test_start_twice_and_port_in_use() -> None:
    with FakeOpenAIServer() as srv:
        assert srv.start() is srv
        assert srv.base_url == f"http://127.0.0.1:{srv.port}/v1"
        other = FakeOpenAIServer(port=srv.port)
        with pytest.raises(OSError):
            other.start()
        other.stop()  # harmless when never started


def test_faults_can_be_replaced_while_running(server: FakeOpenAIServer,
                                              client: httpx.Client) -> None:
    assert client.post("/chat/completions", json=chat("a")).status_code == 200
    server.faults = Faults(status_override=403)
    assert client.post("/chat/completions", json=chat("a")).status_code == 403
    server.faults.status_override = None
    server.faults.p_503 = 1.0
    assert client.post("/chat/completions", json=chat("a")).status_code == 503
    assert [r.outcome for r in server.log] == ["ok", "status_403", "503"]


def test_cli_serve(tmp_path: Path) -> None:
    log = tmp_path / "cli.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun.testing", "serve", "--port", "0", "--rpm", "2",
         "--latency", "0.01", "--log", str(log)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("listening on http://127.0.0.1:")
        base_url = line.removeprefix("listening on ")
        assert base_url.endswith("/v1")
        with httpx.Client(base_url=base_url, timeout=5.0) as c:
            codes = [c.post("/chat/completions", json=chat("cli")).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert b"stopped after 3 requests" in err
    assert [orjson.loads(x)["outcome"] for x in log.read_bytes().splitlines()] == [
        "ok", "ok", "429"]
