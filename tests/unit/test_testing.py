"""batchrun.testing: the fake server run over real TCP (HTTP, faults, API shapes, log, CLI)."""

from __future__ import annotations

import dataclasses
import datetime
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

from batchrun.testing import FakeProviderServer, Faults, RequestRecord, default_key_fn

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
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer() as srv:
        yield srv


@pytest.fixture
def client(server: FakeProviderServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=5.0) as c:
        yield c


# ---------------------------------------------------------------------- normal operation


def test_ok_reply_echo_usage_and_headers(server: FakeProviderServer, client: httpx.Client) -> None:
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


def test_alternate_route_and_default_model(server: FakeProviderServer) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=5.0) as c:
        r = c.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    assert r.json()["model"] == "fake-model"
    assert r.json()["choices"][0]["message"]["content"] == "echo: x"
    assert server.log[0].path == "/chat/completions"


def test_keep_alive_reuses_one_connection(server: FakeProviderServer, client: httpx.Client) -> None:
    local_addrs = set()
    for i in range(10):
        r = client.post("/chat/completions", json=chat(f"msg {i}"))
        assert r.status_code == 200
        assert r.headers["connection"] == "keep-alive"
        assert r.json()["choices"][0]["message"]["content"] == f"echo: msg {i}"
        local_addrs.add(r.extensions["network_stream"].get_extra_info("client_addr"))
    assert len(local_addrs) == 1
    assert [rec.seq for rec in server.log] == list(range(10))


def test_connection_close_is_honoured(server: FakeProviderServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(raw_request("/v1/chat/completions", orjson.dumps(chat("bye")),
                              extra_headers=b"Connection: close\r\n"))
        with s.makefile("rb") as f:
            status, headers, body = read_response(f)
            assert status == 200
            assert headers["connection"] == "close"
            assert orjson.loads(body)["choices"][0]["message"]["content"] == "echo: bye"
            assert f.read() == b""  # server closed its side


def test_pipelined_and_chunked_requests(server: FakeProviderServer) -> None:
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


def test_expect_100_continue(server: FakeProviderServer) -> None:
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
    with FakeProviderServer(Faults(latency_s=0.2, latency_jitter_s=0.1, seed=1)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        t0 = time.perf_counter()
        r = c.post("/chat/completions", json=chat("slow"))
        elapsed = time.perf_counter() - t0
    assert r.status_code == 200
    assert 0.2 <= elapsed < 5  # at least the latency; the upper bound only catches a stuck server


# ---------------------------------------------------------------------- errors and faults


def test_429_retry_after_headers() -> None:
    with FakeProviderServer(Faults(p_429=1.0, retry_after_s=0.25)) as srv, \
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
    with FakeProviderServer(Faults(**{field: 1.0})) as srv, \
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
    with FakeProviderServer(Faults(p_reset=1.0)) as srv:
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
    with FakeProviderServer(Faults(p_hang=1.0)) as srv:
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
    with FakeProviderServer(Faults(p_bad_body=1.0)) as srv, \
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
    with FakeProviderServer(Faults(p_truncated=1.0)) as srv:
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
    with FakeProviderServer(Faults(status_override=401, p_500=1.0)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        r = c.post("/chat/completions", json=chat("key?"))
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key"
    assert err["type"] == "invalid_request_error"
    assert [(rec.outcome, rec.status) for rec in srv.log] == [("status_401", 401)]


def test_burst_429_windows() -> None:
    faults = Faults(burst_429_period_s=1.0, burst_429_duration_s=0.4)
    with FakeProviderServer(faults) as srv, \
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
    with FakeProviderServer(Faults(rpm_limit=5)) as srv, \
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
def test_max_tokens_truncates_reply(server: FakeProviderServer, client: httpx.Client,
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


def test_not_found_bad_request_and_health(server: FakeProviderServer, client: httpx.Client) -> None:
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


def test_malformed_http_gets_400_and_close(server: FakeProviderServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        with s.makefile("rb") as f:
            status, headers, _ = read_response(f)
            assert (status, headers["connection"]) == (400, "close")
            assert f.read() == b""
    assert server.log == []


# ---------------------------------------------------------------------- log and counters


def test_log_counters_and_reset() -> None:
    with FakeProviderServer(Faults(p_429=0.5, retry_after_s=None, seed=7)) as srv, \
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

    with FakeProviderServer(key_fn=key_fn) as srv, \
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
    with FakeProviderServer(Faults(p_500=0.5, seed=3), log_path=path) as srv, \
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
    with FakeProviderServer(log_path=path) as srv2, \
            httpx.Client(base_url=srv2.base_url, timeout=5.0) as c:
        c.post("/chat/completions", json=chat("again"))
    assert len(path.read_bytes().splitlines()) == 8


def _outcomes(seed: int | None) -> list[str]:
    faults = Faults(p_429=0.2, p_500=0.2, p_503=0.2, p_bad_body=0.1, retry_after_s=None,
                    seed=seed)
    with FakeProviderServer(faults) as srv, \
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
    srv = FakeProviderServer(Faults(p_hang=1.0)).start()
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
    srv = FakeProviderServer(Faults(latency_s=30.0)).start()
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
    with FakeProviderServer() as srv:
        assert srv.start() is srv
        assert srv.base_url == f"http://127.0.0.1:{srv.port}/v1"
        other = FakeProviderServer(port=srv.port)
        with pytest.raises(OSError):
            other.start()
        other.stop()  # harmless when never started


def test_faults_can_be_replaced_while_running(server: FakeProviderServer,
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


# ---------------------------------------------------------------------- three APIs, plain and streamed

ANTHROPIC = {"anthropic-version": "2023-06-01"}
LABEL_SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer", "minimum": 0,
                                                                 "maximum": 10}},
    "required": ["label", "score"],
    "additionalProperties": False,
}


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """Parse an SSE body: (event name or None, parsed data) per event; "[DONE]" stays a string."""
    events: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        payload = "\n".join(data)
        events.append((name, payload if payload == "[DONE]" else orjson.loads(payload)))
    return events


def read_stream(client: httpx.Client, path: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[httpx.Response, str, Exception | None]:
    """POST and read the body incrementally: (response, text received, transport error or None)."""
    received: list[bytes] = []
    error: Exception | None = None
    with client.stream("POST", path, json=body, headers=headers) as r:
        try:
            for chunk in r.iter_bytes():
                received.append(chunk)
        except httpx.TransportError as exc:
            error = exc
    return r, b"".join(received).decode(), error


def messages_body(content: Any = "hello there, friend", **extra: Any) -> dict[str, Any]:
    """A minimal Anthropic Messages request body."""
    return {"model": "claude-test", "max_tokens": 1024,
            "messages": [{"role": "user", "content": content}], **extra}


def responses_body(inp: Any = "hello there, friend", **extra: Any) -> dict[str, Any]:
    """A minimal OpenAI Responses request body."""
    return {"model": "gpt-test", "input": inp, **extra}


def label_tool(**extra: Any) -> dict[str, Any]:
    return {"tools": [{"name": "record_label", "description": "Record the label.",
                       "input_schema": LABEL_SCHEMA}],
            "tool_choice": {"type": "tool", "name": "record_label"}, **extra}


@pytest.fixture
def root(server: FakeProviderServer) -> Iterator[httpx.Client]:
    """A client on the server's root, so paths name the API: /v1/chat/completions, ..."""
    with httpx.Client(base_url=server.anthropic_base_url, timeout=5.0) as c:
        yield c


def test_chat_stream_events_and_usage(server: FakeProviderServer, root: httpx.Client) -> None:
    text = "a question long enough to need several deltas"
    r = root.post("/v1/chat/completions",
                  json=chat(text, stream=True, stream_options={"include_usage": True}))
    assert r.status_code == 200
    assert r.headers["content-type"].split(";")[0] == "text/event-stream"
    assert r.headers["transfer-encoding"] == "chunked"
    assert r.headers["x-request-id"] == "req_0"
    events = sse_events(r.text)
    assert all(name is None for name, _ in events)  # Chat frames are bare "data:" lines
    chunks = [data for _, data in events]
    assert chunks[-1] == "[DONE]"
    *body, usage_chunk, _ = chunks
    for c in body + [usage_chunk]:
        assert (c["id"], c["object"], c["model"]) == ("chatcmpl-0", "chat.completion.chunk", "gpt-test")
    assert all(c["usage"] is None for c in body)  # include_usage: null on every other chunk
    assert body[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]
    deltas = [c["choices"][0]["delta"]["content"] for c in body[1:-1]]
    assert len(deltas) >= 3 and all(len(d) <= 16 for d in deltas)
    reply = "echo: " + text
    assert "".join(deltas) == reply
    assert body[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert usage_chunk["choices"] == []
    (rec,) = server.log
    assert usage_chunk["usage"] == {"prompt_tokens": rec.prompt_tokens,
                                    "completion_tokens": rec.completion_tokens,
                                    "total_tokens": rec.prompt_tokens + rec.completion_tokens}
    assert (rec.prompt_tokens, rec.completion_tokens) == (len(text) // 4 + 1, len(reply) // 4 + 1)
    assert (rec.api, rec.stream, rec.outcome, rec.key) == ("chat", True, "ok", text)


def test_chat_stream_without_usage_and_keep_alive(server: FakeProviderServer, client: httpx.Client) -> None:
    r = client.post("/chat/completions", json=chat("hi", stream=True))
    chunks = [data for _, data in sse_events(r.text)]
    assert chunks[-1] == "[DONE]"
    assert all("usage" not in c and c["choices"] for c in chunks[:-1])  # no usage chunk
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    # the chunked stream ended cleanly: the same connection serves the next request
    assert client.post("/chat/completions", json=chat("again")).status_code == 200
    assert [(rec.stream, rec.outcome) for rec in server.log] == [(True, "ok"), (False, "ok")]


def test_chat_stream_structured_and_truncated(server: FakeProviderServer, client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL_SCHEMA}}
    plain = client.post("/chat/completions", json=chat("row 1", response_format=fmt)).json()
    r = client.post("/chat/completions", json=chat("row 1", response_format=fmt, stream=True,
                                                   stream_options={"include_usage": True}))
    chunks = [d for _, d in sse_events(r.text)][:-1]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == plain["choices"][0]["message"]["content"]
    assert set(orjson.loads(streamed)) == {"label", "score"}
    assert chunks[-1]["usage"] == plain["usage"]
    # max_tokens cuts the stream too: finish_reason "length", usage = the limit
    r = client.post("/chat/completions", json=chat("x" * 80, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True}))
    chunks = [d for _, d in sse_events(r.text)][:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == (
        "echo: " + "x" * 80)[:12]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3 == server.log[-1].completion_tokens


def test_chat_refusal_streamed() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL_SCHEMA}}
    with FakeProviderServer(Faults(p_refusal=1.0)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        plain = c.post("/chat/completions", json=chat("x", response_format=fmt)).json()
        r = c.post("/chat/completions", json=chat("x", response_format=fmt, stream=True))
    message = plain["choices"][0]["message"]
    assert message["content"] is None and message["refusal"]
    chunks = [d for _, d in sse_events(r.text)][:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None, "refusal": ""}
    assert "".join(c["choices"][0]["delta"].get("refusal") or "" for c in chunks) == message["refusal"]
    assert [rec.output_fault for rec in srv.log] == ["refusal", "refusal"]


def test_responses_plain(server: FakeProviderServer, root: httpx.Client) -> None:
    r = root.post("/v1/responses", json=responses_body(instructions="Be terse."))  # 9 chars -> 3
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req_0"
    data = r.json()
    reply = "echo: hello there, friend"
    assert data["id"] == "resp_0"
    assert (data["object"], data["status"], data["model"]) == ("response", "completed", "gpt-test")
    assert data["error"] is None and data["incomplete_details"] is None
    assert data["instructions"] == "Be terse."
    assert data["output"] == [{
        "id": "msg_0", "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": reply, "annotations": []}],
    }]
    (rec,) = server.log
    assert (rec.prompt_tokens, rec.completion_tokens) == (3 + 5, len(reply) // 4 + 1)
    assert data["usage"] == {
        "input_tokens": rec.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": rec.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": rec.prompt_tokens + rec.completion_tokens,
    }
    assert (rec.api, rec.stream, rec.key, rec.path) == ("responses", False, "hello there, friend",
                                                        "/v1/responses")
    # the short route and a list of messages with input_text parts; the last user turn is echoed
    r = root.post("/responses", json=responses_body([
        {"role": "user", "content": [{"type": "input_text", "text": "first"}]},
        {"role": "assistant", "content": "ok"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "second"}]},
    ]))
    assert r.json()["output"][0]["content"][0]["text"] == "echo: second"
    assert server.log[-1].key == "first"


def test_responses_stream_events_and_usage(server: FakeProviderServer, root: httpx.Client) -> None:
    text = "a question long enough to need several deltas"
    r = root.post("/v1/responses", json=responses_body(text, stream=True))
    assert r.headers["content-type"].split(";")[0] == "text/event-stream"
    events = sse_events(r.text)
    names = [name for name, _ in events]
    n_deltas = names.count("response.output_text.delta")
    assert n_deltas >= 3
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    assert [d["type"] for _, d in events] == names  # event: line and "type" agree
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    created = events[0][1]["response"]
    assert (created["id"], created["status"], created["output"], created["usage"]) == (
        "resp_0", "in_progress", [], None)
    added = events[2][1]
    assert added["output_index"] == 0
    assert added["item"] == {"id": "msg_0", "type": "message", "status": "in_progress",
                             "content": [], "role": "assistant"}
    assert events[3][1]["part"] == {"type": "output_text", "annotations": [], "text": ""}
    deltas = [d for name, d in events if name == "response.output_text.delta"]
    assert all((d["item_id"], d["output_index"], d["content_index"]) == ("msg_0", 0, 0) for d in deltas)
    reply = "echo: " + text
    assert "".join(d["delta"] for d in deltas) == reply
    assert events[-4][1]["text"] == reply
    assert events[-3][1]["part"] == {"type": "output_text", "annotations": [], "text": reply}
    assert events[-2][1]["item"]["status"] == "completed"
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["output"] == [events[-2][1]["item"]]
    (rec,) = server.log
    assert final["usage"]["input_tokens"] == rec.prompt_tokens
    assert final["usage"]["output_tokens"] == rec.completion_tokens == len(reply) // 4 + 1
    assert final["usage"]["total_tokens"] == rec.prompt_tokens + rec.completion_tokens
    assert (rec.api, rec.stream) == ("responses", True)


def test_responses_json_schema_and_max_output_tokens(server: FakeProviderServer, root: httpx.Client) -> None:
    fmt = {"format": {"type": "json_schema", "name": "label", "schema": LABEL_SCHEMA, "strict": True}}
    data = root.post("/v1/responses", json=responses_body("row 7", text=fmt)).json()
    assert data["text"] == fmt  # the format is echoed back
    parsed = orjson.loads(data["output"][0]["content"][0]["text"])
    assert parsed["label"] in ("spam", "ham") and 0 <= parsed["score"] <= 10
    # the same answer streamed
    events = sse_events(root.post("/v1/responses", json=responses_body("row 7", text=fmt, stream=True)).text)
    assert events[-1][1]["response"]["output"][0]["content"] == data["output"][0]["content"]
    # truncated by max_output_tokens: status incomplete, in plain and streamed form
    data = root.post("/v1/responses", json=responses_body("x" * 80, max_output_tokens=3)).json()
    assert data["status"] == "incomplete"
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["max_output_tokens"] == 3
    assert data["output"][0]["status"] == "incomplete"
    assert data["output"][0]["content"][0]["text"] == ("echo: " + "x" * 80)[:12]
    assert data["usage"]["output_tokens"] == 3
    events = sse_events(root.post("/v1/responses", json=responses_body(
        "x" * 80, max_output_tokens=3, stream=True)).text)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 3 == server.log[-1].completion_tokens


def test_responses_refusal_part() -> None:
    fmt = {"format": {"type": "json_schema", "name": "label", "schema": LABEL_SCHEMA, "strict": True}}
    with FakeProviderServer(Faults(p_refusal=1.0)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
        data = c.post("/responses", json=responses_body("x", text=fmt)).json()
        events = sse_events(c.post("/responses", json=responses_body("x", text=fmt, stream=True)).text)
    (part,) = data["output"][0]["content"]
    assert part["type"] == "refusal" and part["refusal"]
    names = [n for n, _ in events]
    assert "response.refusal.delta" in names and "response.output_text.delta" not in names
    assert events[3][1]["part"] == {"type": "refusal", "refusal": ""}
    assert "".join(d["delta"] for n, d in events if n == "response.refusal.delta") == part["refusal"]
    assert next(d for n, d in events if n == "response.refusal.done")["refusal"] == part["refusal"]
    assert events[-1][1]["response"]["output"][0]["content"] == [part]


def test_messages_plain(server: FakeProviderServer, root: httpx.Client) -> None:
    body = messages_body(
        [{"type": "text", "text": "hello there,"}, {"type": "text", "text": " friend"}],
        system=[{"type": "text", "text": "You are terse."}],  # 14 chars -> 4
    )
    r = root.post("/v1/messages", json=body, headers=ANTHROPIC)
    assert r.status_code == 200
    assert r.headers["request-id"] == "req_0"
    assert "x-request-id" not in r.headers
    assert "anthropic-ratelimit-requests-limit" not in r.headers
    reply = "echo: hello there, friend"
    (rec,) = server.log
    assert r.json() == {
        "id": "msg_0", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": reply}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": rec.prompt_tokens, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0, "output_tokens": rec.completion_tokens},
    }
    assert (rec.prompt_tokens, rec.completion_tokens) == (4 + 5, len(reply) // 4 + 1)
    assert (rec.api, rec.stream, rec.key) == ("messages", False, "hello there, friend")
    # a string system prompt counts the same, on the short route
    r = root.post("/messages", json=messages_body(system="You are terse."), headers=ANTHROPIC)
    assert r.json()["usage"]["input_tokens"] == 9


def test_messages_stop_sequences_and_max_tokens(server: FakeProviderServer, root: httpx.Client) -> None:
    data = root.post("/v1/messages", headers=ANTHROPIC, json=messages_body(
        "one two three", stop_sequences=["three", "two"])).json()
    assert data["content"] == [{"type": "text", "text": "echo: one "}]
    assert (data["stop_reason"], data["stop_sequence"]) == ("stop_sequence", "two")
    data = root.post("/v1/messages", headers=ANTHROPIC, json=messages_body("x" * 80, max_tokens=3)).json()
    assert data["content"] == [{"type": "text", "text": ("echo: " + "x" * 80)[:12]}]
    assert (data["stop_reason"], data["stop_sequence"]) == ("max_tokens", None)
    assert data["usage"]["output_tokens"] == 3 == server.log[-1].completion_tokens
    events = sse_events(root.post("/v1/messages", headers=ANTHROPIC, json=messages_body(
        "x" * 80, max_tokens=3, stream=True)).text)
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"] == {"output_tokens": 3}


def test_messages_stream_events_and_usage(server: FakeProviderServer, root: httpx.Client) -> None:
    text = "a question long enough to need several deltas"
    r = root.post("/v1/messages", json=messages_body(text, stream=True, system="Be terse."),
                  headers=ANTHROPIC)
    assert r.headers["content-type"].split(";")[0] == "text/event-stream"
    assert r.headers["request-id"] == "req_0"
    events = sse_events(r.text)
    names = [name for name, _ in events]
    n_deltas = names.count("content_block_delta")
    assert n_deltas >= 3
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * n_deltas, "content_block_stop", "message_delta",
                     "message_stop"]
    assert [d["type"] for _, d in events] == names
    (rec,) = server.log
    start = events[0][1]["message"]
    assert (start["id"], start["role"], start["content"], start["stop_reason"]) == (
        "msg_0", "assistant", [], None)
    assert start["usage"]["input_tokens"] == rec.prompt_tokens == 3 + len(text) // 4 + 1
    assert start["usage"]["output_tokens"] <= 2  # small at the start
    assert events[1][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == "echo: " + text
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {"type": "message_delta",
                             "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"output_tokens": rec.completion_tokens}}
    assert (rec.api, rec.stream) == ("messages", True)


def test_messages_tool_use_structured(server: FakeProviderServer, root: httpx.Client) -> None:
    data = root.post("/v1/messages", headers=ANTHROPIC, json=messages_body("row 3", **label_tool())).json()
    (block,) = data["content"]
    assert block["type"] == "tool_use" and block["name"] == "record_label"
    assert block["id"].startswith("toolu_")
    assert set(block["input"]) == {"label", "score"} and block["input"]["label"] in ("spam", "ham")
    assert data["stop_reason"] == "tool_use"
    # streamed: a tool_use block start, then input_json_delta pieces that join to the same input
    events = sse_events(root.post("/v1/messages", headers=ANTHROPIC,
                                  json=messages_body("row 3", stream=True, **label_tool())).text)
    start = events[1][1]["content_block"]
    assert (start["type"], start["name"], start["input"]) == ("tool_use", "record_label", {})
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "input_json_delta" for d in deltas) and len(deltas) >= 2
    assert orjson.loads("".join(d["partial_json"] for d in deltas)) == block["input"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert [rec.key for rec in server.log] == ["row 3", "row 3"]
    # a tool call cut by max_tokens: stop_reason max_tokens, no complete input
    data = root.post("/v1/messages", headers=ANTHROPIC,
                     json=messages_body("row 3", **label_tool(max_tokens=2))).json()
    assert data["stop_reason"] == "max_tokens"
    assert data["content"][0]["input"] == {}
    assert data["usage"]["output_tokens"] == 2
    # JSON outputs (output_config.format) answer with a text block
    data = root.post("/v1/messages", headers=ANTHROPIC, json=messages_body(
        "row 3", output_config={"format": {"type": "json_schema", "schema": LABEL_SCHEMA}})).json()
    assert data["stop_reason"] == "end_turn"
    assert orjson.loads(data["content"][0]["text"]) == block["input"]


@pytest.mark.parametrize(("fault", "check"), [
    ("schema_violation", lambda d: d["stop_reason"] == "tool_use" and "label" not in d["content"][0]["input"]),
    ("not_json", lambda d: d["stop_reason"] == "end_turn" and d["content"][0]["type"] == "text"),
    ("fenced", lambda d: d["content"][0]["text"].startswith("```json")),
    ("truncated_json", lambda d: d["stop_reason"] == "max_tokens" and d["content"][0]["input"] == {}),
    ("refusal", lambda d: d["stop_reason"] == "refusal" and d["content"] == []
     and d["stop_details"]["type"] == "refusal"),
])
def test_messages_output_faults(fault: str, check: Callable[[dict[str, Any]], bool]) -> None:
    faults = Faults(**{f"p_{fault}": 1.0})  # type: ignore[arg-type]
    with FakeProviderServer(faults) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0) as c:
        data = c.post("/v1/messages", headers=ANTHROPIC, json=messages_body("x", **label_tool())).json()
        events = sse_events(c.post("/v1/messages", headers=ANTHROPIC,
                                   json=messages_body("x", stream=True, **label_tool())).text)
    assert check(data), data
    assert events[-2][1]["delta"]["stop_reason"] == data["stop_reason"]
    assert events[-2][1]["usage"]["output_tokens"] == data["usage"]["output_tokens"]
    assert [rec.output_fault for rec in srv.log] == [fault, fault]


def test_messages_requires_version_max_tokens_and_messages(server: FakeProviderServer,
                                                           root: httpx.Client) -> None:
    r = root.post("/v1/messages", json=messages_body())
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "anthropic-version: header is required"},
        "request_id": r.headers["request-id"]}
    body = messages_body()
    del body["max_tokens"]
    r = root.post("/v1/messages", json=body, headers=ANTHROPIC)
    assert r.status_code == 400
    assert r.json()["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
    r = root.post("/v1/messages", json={"model": "m", "max_tokens": 5}, headers=ANTHROPIC)
    assert r.json()["error"]["message"] == "messages: Field required"
    r = root.post("/v1/messages", content=b"{nope", headers=ANTHROPIC)
    assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")
    r = root.get("/v1/messages")
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found_error")
    assert [rec.outcome for rec in server.log] == ["bad_request"] * 4 + ["not_found"]
    assert {rec.api for rec in server.log} == {"messages"}


# ---------------------------------------------------------------------- errors per API


@pytest.mark.parametrize(("status", "etype"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (402, "billing_error"),
    (403, "permission_error"), (404, "not_found_error"), (413, "request_too_large"),
    (429, "rate_limit_error"), (500, "api_error"), (503, "api_error"), (504, "timeout_error"),
    (529, "overloaded_error"), (422, "invalid_request_error"),
])
def test_messages_error_bodies(status: int, etype: str) -> None:
    with FakeProviderServer(Faults(status_override=status)) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0) as c:
        r = c.post("/v1/messages", headers=ANTHROPIC, json=messages_body(stream=True))
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"  # errors are JSON, streamed or not
    body = r.json()
    assert body == {"type": "error", "error": {"type": etype, "message": body["error"]["message"]},
                    "request_id": r.headers["request-id"]}
    assert body["error"]["message"]
    assert [(rec.status, rec.api, rec.stream) for rec in srv.log] == [(status, "messages", True)]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_openai_routes_error_bodies(path: str) -> None:
    body = chat("x") if "chat" in path else responses_body()
    with FakeProviderServer(Faults(p_500=1.0)) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0) as c:
        r = c.post(path, json={**body, "stream": True})
    assert r.status_code == 500
    assert r.headers["x-request-id"] == "req_0"
    assert r.json() == {"error": {"message": "The server had an error while processing your request.",
                                  "type": "server_error", "param": None, "code": "server_error"}}


@pytest.mark.parametrize(("path", "status"), [
    ("/v1/messages", 529), ("/v1/chat/completions", 503), ("/v1/responses", 503),
])
def test_overloaded(path: str, status: int) -> None:
    bodies = {"/v1/messages": messages_body(), "/v1/chat/completions": chat("x"),
              "/v1/responses": responses_body()}
    with FakeProviderServer(Faults(p_overloaded=1.0)) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        r = c.post(path, json=bodies[path])
    assert r.status_code == status
    if status == 529:
        assert r.json()["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    else:
        assert r.json()["error"]["type"] == "overloaded"
    assert [(rec.outcome, rec.status) for rec in srv.log] == [("overloaded", status)]


def test_messages_random_faults_use_anthropic_shapes() -> None:
    with FakeProviderServer(Faults(p_429=1.0, retry_after_s=2.0)) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        r = c.post("/v1/messages", json=messages_body())
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error"
        srv.faults = Faults(p_bad_body=1.0)
        r = c.post("/v1/messages", json=messages_body())
        assert r.status_code == 200
        with pytest.raises(ValueError):
            r.json()
        srv.faults = Faults(p_truncated=1.0)
        with pytest.raises(httpx.RemoteProtocolError):
            c.post("/v1/messages", json=messages_body())
        srv.faults = Faults(p_reset=1.0)
        with pytest.raises(httpx.TransportError):
            c.post("/v1/messages", json=messages_body(stream=True))
    assert [rec.outcome for rec in srv.log] == ["429", "bad_body", "truncated", "reset"]


def test_messages_rate_limit_headers() -> None:
    with FakeProviderServer(Faults(rpm_limit=2)) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        t0 = time.time()
        replies = [c.post("/v1/messages", json=messages_body()) for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 429]
    assert [r.headers["anthropic-ratelimit-requests-limit"] for r in replies] == ["2"] * 3
    assert [r.headers["anthropic-ratelimit-requests-remaining"] for r in replies] == ["1", "0", "0"]
    assert all("x-ratelimit-limit-requests" not in r.headers for r in replies)
    for r in replies:
        reset = r.headers["anthropic-ratelimit-requests-reset"]
        assert reset.endswith("Z")
        at = datetime.datetime.fromisoformat(reset.replace("Z", "+00:00")).timestamp()  # RFC 3339
        assert t0 + 58 <= at <= t0 + 62  # the window is full again a minute after the requests
    assert replies[2].json()["error"]["type"] == "rate_limit_error"
    assert replies[2].headers["retry-after"] == "60"


# ---------------------------------------------------------------------- stream faults

STREAM_REQUESTS = [
    ("/v1/chat/completions", chat("a question long enough to need several deltas", stream=True)),
    ("/v1/responses", responses_body("a question long enough to need several deltas", stream=True)),
    ("/v1/messages", messages_body("a question long enough to need several deltas", stream=True)),
]
TERMINAL = {"/v1/chat/completions": "[DONE]", "/v1/responses": "response.completed",
            "/v1/messages": "message_stop"}


def kinds(events: list[tuple[str | None, Any]]) -> list[Any]:
    """What each event is, ids left out: its name, or for Chat the chunk's choices (or "[DONE]")."""
    return [name if name is not None else data if data == "[DONE]" else data.get("choices", data)
            for name, data in events]


@pytest.mark.parametrize(("path", "body"), STREAM_REQUESTS)
def test_stream_drop(path: str, body: dict[str, Any]) -> None:
    with FakeProviderServer() as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        full = sse_events(c.post(path, json=body).text)
        srv.faults = Faults(p_stream_drop=1.0)
        r, text, error = read_stream(c, path, body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert isinstance(error, httpx.RemoteProtocolError)  # the chunked body never ended
        events = sse_events(text)
        assert kinds(events) == kinds(full)[: len(full) // 2]  # about half, then nothing
        assert TERMINAL[path] not in kinds(events)
        # not streamed: like p_truncated
        with pytest.raises(httpx.RemoteProtocolError):
            c.post(path, json={**body, "stream": False})
    ok, drop, plain = srv.log
    assert (drop.outcome, drop.status, drop.stream) == ("stream_drop", 200, True)
    assert (drop.prompt_tokens, drop.completion_tokens) == (ok.prompt_tokens, ok.completion_tokens)
    assert (plain.outcome, plain.stream) == ("stream_drop", False)


@pytest.mark.parametrize(("path", "body"), STREAM_REQUESTS)
def test_stream_error_in_band(path: str, body: dict[str, Any]) -> None:
    with FakeProviderServer() as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        full = sse_events(c.post(path, json=body).text)
        srv.faults = Faults(p_stream_error=1.0)
        r, text, error = read_stream(c, path, body)
        assert error is None  # the stream ended cleanly...
        events = sse_events(text)
        half = len(full) // 2
        assert kinds(events[:half]) == kinds(full[:half])
        tail = events[half:]
        if path == "/v1/messages":
            assert tail == [("error", {"type": "error", "error": {
                "type": "overloaded_error", "message": "Overloaded"}})]
        elif path == "/v1/responses":
            (name, err), (failed_name, failed) = tail
            assert (name, err["type"], err["sequence_number"]) == ("error", "error", half)
            assert (err["code"], err["param"]) == ("server_error", None) and err["message"]
            assert err["error"]["code"] == "server_error"  # the live API's nested form too
            assert failed_name == failed["type"] == "response.failed"
            assert failed["sequence_number"] == half + 1
            assert failed["response"]["status"] == "failed"
            assert failed["response"]["error"]["code"] == "server_error"
        else:
            (name, err), = tail
            assert name is None and err["error"]["type"] == "server_error"
        assert TERMINAL[path] not in kinds(events)
        # ...so the connection is reused; not streamed, the fault is a 500 in the API's shape
        r = c.post(path, json={**body, "stream": False})
        assert r.status_code == 500
        assert (r.json()["error"]["type"] == "api_error") == (path == "/v1/messages")
    assert [(rec.outcome, rec.status, rec.stream) for rec in srv.log] == [
        ("ok", 200, True), ("stream_error", 200, True), ("stream_error", 500, False)]


@pytest.mark.parametrize(("path", "body"), STREAM_REQUESTS)
def test_stream_bad_body_cuts_one_event(path: str, body: dict[str, Any]) -> None:
    with FakeProviderServer(Faults(p_bad_body=1.0)) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        r, text, error = read_stream(c, path, body)
    assert error is None and r.status_code == 200
    with pytest.raises(orjson.JSONDecodeError):
        sse_events(text)
    assert [rec.outcome for rec in srv.log] == ["bad_body"]


def test_stream_chunk_delay_spreads_deltas() -> None:
    faults = Faults(latency_s=0.2, stream_chunk_delay_s=0.1)
    text = "x" * 42  # "echo: " + 42 chars -> 3 deltas
    with FakeProviderServer(faults) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0, headers=ANTHROPIC) as c:
        t0 = time.perf_counter()
        arrivals: list[tuple[float, str]] = []
        with c.stream("POST", "/v1/messages", json=messages_body(text, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    arrivals.append((time.perf_counter() - t0, line.removeprefix("event: ")))
    deltas = [t for t, name in arrivals if name == "content_block_delta"]
    assert len(deltas) == 3
    assert 0.2 <= deltas[0] < 0.3  # the first token comes after the latency only
    assert deltas[1] - deltas[0] >= 0.09 and deltas[2] - deltas[1] >= 0.09
    assert arrivals[0][0] <= deltas[0] + 0.02  # message_start goes out with the first delta
    assert srv.log[0].outcome == "ok"


# ---------------------------------------------------------------------- api key


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_api_key_checked_per_api(path: str) -> None:
    secret = "sk-test-secret-1234"
    body = {"/v1/chat/completions": chat("x"), "/v1/responses": responses_body(),
            "/v1/messages": messages_body()}[path]
    anthropic = path == "/v1/messages"

    def creds(key: str | None, bearer: bool = not anthropic) -> dict[str, str]:
        if key is None:
            return dict(ANTHROPIC)
        return {**ANTHROPIC, **({"authorization": f"Bearer {key}"} if bearer else {"x-api-key": key})}

    with FakeProviderServer(api_key=secret) as srv, \
            httpx.Client(base_url=srv.anthropic_base_url, timeout=5.0) as c:
        refused = [c.post(path, json=body, headers=h) for h in (
            creds(None), creds("sk-wrong"), creds("sk-wrong", bearer=anthropic))]
        ok = c.post(path, json={**body, "stream": True}, headers=creds(secret))
        # Messages takes the key as x-api-key or as a bearer token; OpenAI only as a bearer token
        other = c.post(path, json=body, headers=creds(secret, bearer=anthropic))
    for r in refused:
        assert r.status_code == 401
        assert secret not in r.text and "sk-wrong" not in r.text
        if anthropic:
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["request_id"] == r.headers["request-id"]
        else:
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert ok.status_code == 200 and sse_events(ok.text)
    assert other.status_code == (200 if anthropic else 401)
    assert [rec.outcome for rec in srv.log] == ["unauthorized"] * 3 + [
        "ok", "ok" if anthropic else "unauthorized"]


# ---------------------------------------------------------------------- keys and log


def test_default_key_fn_all_apis() -> None:
    assert default_key_fn({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                     {"type": "text", "text": "b"}]},
        {"role": "user", "content": "later"}]}) == "ab"
    assert default_key_fn({"input": "plain"}) == "plain"
    assert default_key_fn({"input": [
        {"role": "system", "content": "s"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": "x"}, {"role": "user", "content": "re-ask"}]}) == "q"
    assert default_key_fn({"input": [{"role": "user", "content": "q"}]}) == "q"
    assert default_key_fn({"input": 3}) is None


def test_keys_stay_stable_across_reasks_on_every_api(server: FakeProviderServer, root: httpx.Client) -> None:
    reask = [{"role": "assistant", "content": "bad"}, {"role": "user", "content": "fix it"}]
    root.post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "k1"}]}, *reask]})
    root.post("/v1/responses", json=responses_body([{"role": "user", "content": "k2"}, *reask]))
    root.post("/v1/messages", headers=ANTHROPIC, json={"model": "m", "max_tokens": 9, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "k3"}]}, *reask]})
    assert [(rec.api, rec.key) for rec in server.log] == [
        ("chat", "k1"), ("responses", "k2"), ("messages", "k3")]
    assert server.requests_by_key() == {"k1": 1, "k2": 1, "k3": 1}
    assert server.ok_by_key() == {"k1": 1, "k2": 1, "k3": 1}


def test_record_defaults() -> None:
    rec = RequestRecord(0, 0.0, 0.0, "POST", "/v1/chat/completions", None, "ok", 200, 1, 2)
    assert (rec.output_fault, rec.api, rec.stream) == (None, "chat", False)


def test_new_faults_keep_a_seeds_fates() -> None:
    base = Faults(p_429=0.2, p_500=0.2, retry_after_s=None, seed=11)
    more = dataclasses.replace(base, p_overloaded=0.2, p_stream_error=0.1)
    fates = []
    for faults in (base, more):
        with FakeProviderServer(faults) as srv, \
                httpx.Client(base_url=srv.base_url, timeout=5.0) as c:
            for i in range(40):
                c.post("/chat/completions", json=chat(str(i)))
        fates.append([r.outcome for r in srv.log])
    before, after = fates
    assert {"overloaded", "stream_error"} <= set(after)
    for old, new in zip(before, after):
        assert new == old or (old == "ok" and new in ("overloaded", "stream_error"))


def test_cli_serve_api_key_and_new_faults() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchrun.testing", "serve", "--port", "0", "--api-key", "k",
         "--p-overloaded", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT,
    )
    try:
        assert proc.stdout is not None
        base_url = proc.stdout.readline().decode().strip().removeprefix("listening on ")
        root_url = base_url.removesuffix("/v1")
        with httpx.Client(base_url=root_url, timeout=5.0, headers=ANTHROPIC) as c:
            assert c.post("/v1/messages", json=messages_body()).status_code == 401
            assert c.post("/v1/messages", json=messages_body(),
                          headers={"x-api-key": "k"}).status_code == 529
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
