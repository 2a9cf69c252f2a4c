"""What the tests of the fake server's batch APIs share: request lines, clients, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson

from batchrun.testing import BatchFaults, FakeProviderServer, Faults

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
OPENAI_ENDED = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str | None = None, *, model: str = "m",
              url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    """One OpenAI batch input line for Chat Completions."""
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": content or custom_id}],
                     **body}}


def messages_request(custom_id: str, content: str | None = None, **params: Any) -> dict[str, Any]:
    """One Anthropic Message Batches request."""
    return {"custom_id": custom_id, "params": {
        "model": "claude-test", "max_tokens": 64,
        "messages": [{"role": "user", "content": content or custom_id}], **params}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def upload(client: httpx.Client, data: bytes, filename: str = "input.jsonl") -> str:
    """Upload a batch input file; returns its id."""
    reply = client.post("/files", files={"file": (filename, data)}, data={"purpose": "batch"})
    assert reply.status_code == 200, reply.text
    file_id: str = reply.json()["id"]
    return file_id


def create_batch(client: httpx.Client, lines: list[dict[str, Any]],
                 endpoint: str = "/v1/chat/completions", **extra: Any) -> dict[str, Any]:
    """Upload ``lines`` and create an OpenAI batch of them; returns the batch object."""
    reply = client.post("/batches", json={"input_file_id": upload(client, jsonl(lines)),
                                          "endpoint": endpoint, "completion_window": "24h", **extra})
    assert reply.status_code == 200, reply.text
    batch: dict[str, Any] = reply.json()
    return batch


def wait_until(get: Callable[[], dict[str, Any]], done: Callable[[dict[str, Any]], bool],
               timeout: float = 20.0) -> dict[str, Any]:
    """Poll ``get`` until ``done`` says so; returns the last object seen."""
    deadline = time.monotonic() + timeout
    while True:
        obj = get()
        if done(obj) or time.monotonic() > deadline:
            return obj
        time.sleep(0.02)


def wait_openai(client: httpx.Client, batch_id: str, statuses: tuple[str, ...] = OPENAI_ENDED,
                timeout: float = 20.0) -> dict[str, Any]:
    batch = wait_until(lambda: client.get(f"/batches/{batch_id}").json(),
                       lambda b: b["status"] in statuses, timeout)
    assert batch["status"] in statuses, batch
    return batch


def wait_anthropic(client: httpx.Client, batch_id: str, timeout: float = 20.0) -> dict[str, Any]:
    batch = wait_until(lambda: client.get(f"/v1/messages/batches/{batch_id}").json(),
                       lambda b: b["processing_status"] == "ended", timeout)
    assert batch["processing_status"] == "ended", batch
    return batch


def content(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    """The lines of an OpenAI file ([] for no file)."""
    if not file_id:
        return []
    reply = client.get(f"/files/{file_id}/content")
    assert reply.status_code == 200, reply.text
    return parse_jsonl(reply.content)


@contextmanager
def serving(batch: BatchFaults | None = None, faults: Faults | None = None,
            **kwargs: Any) -> Iterator[tuple[FakeProviderServer, httpx.Client, httpx.Client]]:
    """A fake server and two clients: OpenAI (base .../v1) and Anthropic (root, version header)."""
    with FakeProviderServer(faults, batch_faults=batch or BatchFaults(turnaround_s=0.5),
                            **kwargs) as server, \
            httpx.Client(base_url=server.base_url, timeout=10.0) as openai, \
            httpx.Client(base_url=server.anthropic_base_url, timeout=10.0,
                         headers=ANTHROPIC_HEADERS) as anthropic:
        yield server, openai, anthropic
