"""End to end: a 200 that carries no answer fails its item instead of succeeding with ``output: null``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest

from .conftest import run_cli

USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def answer_for(prompt: str) -> dict[str, Any]:
    """A chat.completion body chosen by the prompt: the shapes issue 14 (case 4) found."""
    base: dict[str, Any] = {"id": "chatcmpl-x", "object": "chat.completion", "model": "m", "usage": USAGE}
    if prompt == "filtered":
        return {**base, "choices": [{"index": 0, "finish_reason": "content_filter",
                                     "message": {"role": "assistant", "content": None}}]}
    if prompt == "no-choices":
        return base
    return {**base, "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": f"echo: {prompt}"}}]}


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        data = orjson.dumps(answer_for(body["messages"][-1]["content"]))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


@pytest.fixture
def base_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_empty_or_filtered_200_fails_its_item(tmp_path: Path, base_url: str) -> None:
    src, db, out = tmp_path / "in.jsonl", tmp_path / "ledger.db", tmp_path / "out.jsonl"
    prompts = ["one", "filtered", "no-choices", "two"]
    src.write_bytes(b"".join(
        orjson.dumps({"custom_id": p, "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": [{"role": "user", "content": p}]}}) + b"\n"
        for p in prompts
    ))
    done = run_cli(tmp_path, "submit", "--input", str(src), "--base-url", base_url, "--db", str(db),
                   "--output", str(out), "--max-attempts", "1", "--quiet")
    assert done.returncode == 1, done.stderr  # finished; some items failed
    assert "Traceback" not in done.stderr
    lines = {line["custom_id"]: line for line in map(orjson.loads, out.read_bytes().splitlines())}
    assert [lines[p]["status"] for p in prompts] == ["succeeded", "failed", "failed", "succeeded"]
    assert lines["filtered"]["error"]["class"] == "content_filter"
    assert "content filter" in lines["filtered"]["error"]["message"]
    assert lines["no-choices"]["error"]["class"] == "bad_response"
    assert lines["one"]["output"] == "echo: one"
