"""The same job on each API, plain and streamed, through the real command line.

The server speaks OpenAI Chat, OpenAI Responses and Anthropic Messages with
injected 429s, 5xx, 529s, resets, dropped streams and in-band error events;
each run must finish every record with usage totals equal to what the server
reported, TTFT recorded when streamed, every error in its class, and the API
key nowhere in the output, the logs or the ledger.
"""

from __future__ import annotations

import collections
import http.server
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import batchrun_cmd, cli_env

KEY = "sk-proj-Zq8v-live-looking-key-7731"
N = 300
SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "integer"}},
          "required": ["label", "score"], "additionalProperties": False}

SPEC = """
[provider]
kind = "{kind}"
base_url = "{base_url}"
model = "m"
api_key_env = "TEST_PROVIDER_KEY"
[request]
system = "Answer briefly."
template = "Say {{text}}"
max_tokens = 400
[run]
concurrency = 16
max_attempts = 8
stream = {stream}
outage_seconds = 60
"""


def run(tmp_path: Path, *args: str, key: str = KEY, timeout: float = 180) -> tuple[int, str, str]:
    import subprocess

    env = cli_env(tmp_path)
    env["TEST_PROVIDER_KEY"] = env["ANTHROPIC_API_KEY"] = key
    proc = subprocess.run(batchrun_cmd("-vv", *args), capture_output=True, text=True, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def records(tmp_path: Path, n: int = N) -> Path:
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": f"hello {i}"}) + b"\n" for i in range(n)))
    return path


def no_key_in(*paths: Path, texts: tuple[str, ...] = ()) -> None:
    for text in texts:
        assert KEY not in text
    for path in paths:
        for candidate in [path, *path.parent.glob(path.name + "-*")]:  # SQLite -wal/-shm too
            if candidate.exists():
                assert KEY.encode() not in candidate.read_bytes(), f"the API key is in {candidate}"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["openai", "openai-responses", "anthropic"])
def test_same_job_on_every_api(tmp_path: Path, kind: str, stream: bool) -> None:
    faults = Faults(seed=11, p_429=0.03, retry_after_s=0.05, p_500=0.03, p_overloaded=0.03, p_reset=0.02,
                    p_stream_drop=0.03 if stream else 0.0, p_stream_error=0.02 if stream else 0.0,
                    stream_chunk_delay_s=0.001 if stream else 0.0)
    with FakeProviderServer(faults, api_key=KEY) as server:
        spec = tmp_path / "job.toml"
        spec.write_text(SPEC.format(kind=kind, base_url=server.base_url, stream=str(stream).lower()))
        db, out = tmp_path / "ledger.db", tmp_path / "out.jsonl"
        code, stdout, stderr = run(tmp_path, "submit", str(spec), "--input", str(records(tmp_path)),
                                   "--db", str(db), "--output", str(out), "--quiet")
        assert code == 0, stderr[-3000:]
        log = server.log

    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert len(lines) == N and {x["status"] for x in lines} == {"succeeded"}
    assert all(x["output"] == f"echo: Say hello {x['custom_id'][1:]}" for x in lines)

    # usage: the ledger's totals are exactly what the server reported in the answers it completed
    answered = [r for r in log if r.outcome == "ok"]
    assert len(answered) == N
    assert {r.api for r in log} == {"chat" if kind == "openai" else "responses" if kind == "openai-responses" else "messages"}
    assert all(r.stream is stream for r in log)
    with sqlite3.connect(db) as conn:
        totals = conn.execute("select sum(input_tokens), sum(output_tokens), count(ttft_ms), count(*) "
                              "from attempts where error_class is null").fetchone()
        classes = collections.Counter(dict(conn.execute(
            "select error_class, count(*) from attempts where error_class is not null group by error_class").fetchall()))
    assert totals[:2] == (sum(r.prompt_tokens for r in answered), sum(r.completion_tokens for r in answered))
    assert totals[3] == N
    assert totals[2] == (N if stream else 0)  # TTFT on every streamed answer, none on plain ones

    # every injected fault shows up in its class (counts: the server's own log)
    outcomes = collections.Counter(r.outcome for r in log)
    assert outcomes["overloaded"] > 0 and outcomes["reset"] > 0 and outcomes["429"] > 0
    assert classes["rate_limited"] == outcomes["429"]
    assert classes["connection"] == outcomes["reset"]
    in_band = outcomes["stream_error"]  # an error event inside a 200 stream
    if kind == "anthropic":  # 529 overloaded_error, in the body and in the stream
        assert classes["overloaded"] == outcomes["overloaded"] + in_band
        assert classes["server_error"] == outcomes["500"]
    else:  # 503 and the OpenAI server_error events
        assert classes["server_error"] == outcomes["500"] + outcomes["overloaded"] + in_band
    if stream:
        assert classes["stream_broken"] == outcomes["stream_drop"] > 0 and in_band > 0
    assert sum(classes.values()) == len(log) - N  # nothing else went wrong, nothing unclassified
    no_key_in(db, out, texts=(stdout, stderr))


class _EchoingHandler(http.server.BaseHTTPRequestHandler):
    """A careless server that echoes the key it was sent back in its 401 body and a header."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        sent = self.headers.get("authorization", "") or self.headers.get("x-api-key", "")
        body = orjson.dumps({"error": {"message": f"Incorrect API key provided: {sent}", "type": "invalid_request_error"}})
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("x-debug-key", sent)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def echoing_server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EchoingHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_key_echoed_by_the_server_is_masked_everywhere(tmp_path: Path, echoing_server: str, kind: str) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(kind=kind, base_url=echoing_server, stream="false"))
    code, stdout, stderr = run(tmp_path, "check", str(spec), "--input", str(records(tmp_path, 3)))
    assert code == 3, stderr
    assert "[REDACTED]" in stdout and "Incorrect API key provided" in stdout
    check_json = run(tmp_path, "check", str(spec), "--input", str(records(tmp_path, 3)), "--json")

    db, out = tmp_path / "ledger.db", tmp_path / "out.jsonl"
    code, sub_out, sub_err = run(tmp_path, "submit", str(spec), "--input", str(records(tmp_path, 3)), "--db", str(db),
                                 "--output", str(out))
    assert code == 3, sub_err
    export = run(tmp_path, "export", "1", "--db", str(db), "--output", str(tmp_path / "x.jsonl"), "--format",
                 "anthropic-batch" if kind == "anthropic" else "openai-batch")
    assert export[0] == 0, export[2]
    no_key_in(db, tmp_path / "x.jsonl", texts=(stdout, stderr, *check_json[1:], sub_out, sub_err))


def test_check_reports_a_streamed_structured_answer(tmp_path: Path) -> None:
    with FakeProviderServer(Faults(seed=1, latency_s=0.05, stream_chunk_delay_s=0.005), api_key=KEY) as server:
        spec = tmp_path / "job.toml"
        (tmp_path / "schema.json").write_bytes(orjson.dumps(SCHEMA))
        spec.write_text(SPEC.format(kind="anthropic", base_url=server.base_url, stream="true")
                        + '[output]\nschema = "schema.json"\n')
        code, stdout, stderr = run(tmp_path, "check", str(spec), "--input", str(records(tmp_path, 5)), "--line", "4",
                                   "--json")
        assert code == 0, stdout + stderr
        result = orjson.loads(stdout)
        [seen] = server.log
    assert result["status_code"] == 200 and result["schema"] == "valid" and result["stream"] is True
    assert result["custom_id"] == "r3" and set(result["parsed"]) == {"label", "score"}
    assert 50 <= result["ttft_ms"] <= result["latency_ms"]
    assert (result["input_tokens"], result["output_tokens"]) == (seen.prompt_tokens, seen.completion_tokens)
    assert seen.api == "messages" and seen.stream
    no_key_in(texts=(stdout, stderr))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("kind", ["openai", "openai-responses", "anthropic"])
def test_structured_output_is_validated_and_re_asked_on_every_api(tmp_path: Path, kind: str, stream: bool) -> None:
    """Each API's structured-output request (response_format, text.format, a forced tool) feeds
    the same validation: spoiled answers are re-asked and end valid; refusals end invalid_output."""
    faults = Faults(seed=4, p_schema_violation=0.15, p_fenced=0.1, p_refusal=0.05, output_faults_on_reask=False)
    n = 80
    with FakeProviderServer(faults, api_key=KEY) as server:
        (tmp_path / "schema.json").write_bytes(orjson.dumps(SCHEMA))
        spec = tmp_path / "job.toml"
        spec.write_text(SPEC.format(kind=kind, base_url=server.base_url, stream=str(stream).lower())
                        + '[output]\nschema = "schema.json"\nvalidation_retries = 2\n')
        out = tmp_path / "out.jsonl"
        code, _, stderr = run(tmp_path, "submit", str(spec), "--input", str(records(tmp_path, n)),
                              "--db", str(tmp_path / "l.db"), "--output", str(out), "--quiet")
        log = server.log
    lines = {x["custom_id"]: x for x in map(orjson.loads, out.read_bytes().splitlines())}
    faulted = collections.Counter(r.output_fault for r in log if r.outcome == "ok")
    refused = {r.key for r in log if r.output_fault == "refusal"}
    assert faulted["schema_violation"] > 0 and faulted["refusal"] > 0
    assert code == 1, stderr[-2000:]  # the refusals
    for custom_id, line in lines.items():
        if f"Say hello {custom_id[1:]}" in refused:
            assert line["status"] == "invalid_output" and line["error"]["class"] == "refusal"
        else:
            assert line["status"] == "succeeded", line
            assert set(line["output"]) == {"label", "score"}
    # every schema violation cost exactly one re-ask (re-asks are answered well here)
    assert len(log) == n + faulted["schema_violation"]  # fenced answers are read as they are, refusals end


@pytest.mark.slow
def test_anthropic_batch_lines_without_a_spec_and_the_anthropic_batch_export(tmp_path: Path) -> None:
    lines = [{"custom_id": f"c{i}", "params": {"model": "claude-x", "max_tokens": 100, "system": "Be brief.",
                                              "messages": [{"role": "user", "content": f"Say hello {i}"}]}}
             for i in range(20)]
    lines.append({"custom_id": "bad", "params": {"model": "claude-x", "messages": [{"role": "user", "content": "x"}]}})
    lines.append({"custom_id": "openai-form", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}})
    path = tmp_path / "claude.jsonl"
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    with FakeProviderServer(Faults(seed=3, p_overloaded=0.1), api_key=KEY) as server:
        db, out = tmp_path / "l.db", tmp_path / "out.jsonl"
        code, stdout, stderr = run(tmp_path, "submit", "--input", str(path), "--provider", "anthropic",
                                   "--base-url", server.anthropic_base_url, "--db", str(db), "--output", str(out),
                                   "--format", "anthropic-batch", "--quiet")
        log = server.log
    assert code == 1, stderr  # two rejected lines
    assert "positive integer 'max_tokens'" in stderr and "convert_openai_input = true" in stderr
    results = {x["custom_id"]: x["result"] for x in map(orjson.loads, out.read_bytes().splitlines())}
    assert results["c7"]["type"] == "succeeded"
    message = results["c7"]["message"]
    assert message["type"] == "message" and message["content"][0]["text"] == "echo: Say hello 7"
    assert results["bad"]["type"] == "errored" and results["bad"]["error"]["type"] == "error"
    assert {r.api for r in log} == {"messages"} and sum(r.outcome == "ok" for r in log) == 20
    # the same lines through a spec that converts OpenAI Batch lines as well
    with FakeProviderServer(Faults(seed=3), api_key=KEY) as server:
        spec = tmp_path / "convert.toml"
        spec.write_text(f'[provider]\nkind = "anthropic"\nbase_url = "{server.anthropic_base_url}"\n'
                        'convert_openai_input = true\n[request]\nmax_tokens = 64\n')
        code, _, stderr = run(tmp_path, "submit", str(spec), "--input", str(path), "--db", str(db), "--quiet",
                              "--output", str(tmp_path / "conv.jsonl"))
        converted = [r for r in server.log if r.key == "x"]
    assert code == 1, stderr  # only the line without max_tokens is rejected now
    assert len(converted) == 1 and converted[0].api == "messages" and converted[0].outcome == "ok"


def test_check_without_a_spec_sends_one_batch_line(tmp_path: Path) -> None:
    path = tmp_path / "claude.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"custom_id": f"c{i}", "params": {
        "model": "claude-x", "max_tokens": 50, "messages": [{"role": "user", "content": f"Say hello {i}"}]}}) + b"\n"
        for i in range(3)))
    with FakeProviderServer(Faults(seed=1), api_key=KEY) as server:
        code, stdout, stderr = run(tmp_path, "check", "--input", str(path), "--line", "2", "--provider", "anthropic",
                                   "--base-url", server.anthropic_base_url, "--json")
        [seen] = server.log
    assert code == 0, stdout + stderr
    result = orjson.loads(stdout)
    assert result["custom_id"] == "c1" and result["output"] == "echo: Say hello 1" and result["schema"] == "none"
    assert seen.api == "messages" and result["request_id"] and result["url"].endswith("/v1/messages")
    code, _, stderr = run(tmp_path, "check", "--input", str(path))  # no spec, no --base-url
    assert code == 2 and "--base-url is required" in stderr
