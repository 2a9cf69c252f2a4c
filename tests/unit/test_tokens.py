"""Prompt tokens: counted with tiktoken for OpenAI models when its table is in, else the byte heuristic.

tiktoken fetches its real tables (o200k_base, cl100k_base) over the network, which this
machine does not have; these tests give it a table of their own through tiktoken's public
``Encoding`` API — one token per UTF-8 byte — so the counts are easy to check by hand.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import orjson
import pytest

from batchrun import tokens
from batchrun.providers import provider_for
from batchrun.spec import parse_spec
from batchrun.tokens import TokenCounter

tiktoken = pytest.importorskip("tiktoken")

ONE_TOKEN_PER_BYTE = tiktoken.Encoding(
    name="one_token_per_byte", pat_str=r"[\s\S]", mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={}
)


def openai_model(model: str) -> str | None:
    return "o200k_base" if model.startswith("gpt-") else None


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> TokenCounter:
    counter = TokenCounter(load=lambda name: ONE_TOKEN_PER_BYTE, encoding_name=openai_model)
    monkeypatch.setattr(tokens, "COUNTER", counter)
    return counter


def provider(kind: str) -> object:
    spec = parse_spec({"provider": {"kind": kind, "base_url": "http://127.0.0.1:9/v1"}}, where="test.toml")
    return provider_for(spec, api_key="sk-test-0123456789")


def prepared(kind: str, body: dict[str, object]) -> tuple[object, object]:
    p = provider(kind)
    return p, p.prepare(None, orjson.dumps(body).decode())  # type: ignore[attr-defined]


def test_a_chat_prompt_is_counted_in_the_models_encoding(counter: TokenCounter) -> None:
    assert counter.wait_for("gpt-4o", timeout=5)
    body = {"model": "gpt-4o", "max_tokens": 50,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "héllo"}]}]}
    p, request = prepared("openai", body)
    estimate = p.estimate_tokens(request)  # type: ignore[attr-defined]
    # The texts and roles (8 + 6 and 6 + 4 bytes), 3 per message around them, 3 to prime the reply.
    assert (estimate.prompt, estimate.answer, estimate.counted) == (8 + 6 + 6 + 4 + 2 * 3 + 3, 50, True)
    named = {**body, "messages": [{"role": "user", "name": "ann", "content": "hi"}]}
    p, request = prepared("openai", named)
    assert p.estimate_tokens(request).prompt == 2 + 4 + 3 + 3 + 1 + 3  # a name: its text and 1 more


def test_a_responses_prompt_is_counted_too(counter: TokenCounter) -> None:
    assert counter.wait_for("gpt-4.1", timeout=5)
    p, request = prepared("openai-responses", {"model": "gpt-4.1", "instructions": "be brief", "input": "hello",
                                               "max_output_tokens": 20})
    estimate = p.estimate_tokens(request)  # type: ignore[attr-defined]
    # The instructions count as one message and the input as another.
    assert (estimate.prompt, estimate.answer, estimate.counted) == (8 + 5 + 2 * 3 + 3, 20, True)


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("openai", {"model": "llama-3", "messages": [{"role": "user", "content": "hello"}]}),  # no table for it
        ("openai", {"model": "gpt-4o", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}),  # an image is not text
        ("anthropic", {"model": "gpt-4o", "max_tokens": 10, "messages": [{"role": "user", "content": "hello"}]}),
        ("openai-responses", {"model": "gpt-4o", "input": [  # a tool's output item: not a message
            {"type": "function_call_output", "call_id": "c1", "output": "x" * 5000}]}),
        ("openai", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi", "audio": {"id": "a1"}}]}),
    ],
)
def test_what_cannot_be_counted_is_estimated_from_its_size(counter: TokenCounter, kind: str, body: dict[str, object]) -> None:
    counter.wait_for("gpt-4o", timeout=5)
    p, request = prepared(kind, body)
    estimate = p.estimate_tokens(request)  # type: ignore[attr-defined]
    assert estimate.counted is False
    assert estimate.prompt == len(request.content) // 4  # type: ignore[attr-defined]


def test_a_slow_table_never_makes_a_request_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow_load(name: str) -> object:
        release.wait(5)
        return ONE_TOKEN_PER_BYTE

    counter = TokenCounter(load=slow_load, encoding_name=openai_model)
    monkeypatch.setattr(tokens, "COUNTER", counter)
    p, request = prepared("openai", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}]})
    started = time.monotonic()
    assert p.estimate_tokens(request).counted is False  # type: ignore[attr-defined]  # the load has only begun
    assert time.monotonic() - started < 0.5
    release.set()
    assert counter.wait_for("gpt-4o", timeout=5)
    assert p.estimate_tokens(request).counted is True  # type: ignore[attr-defined]


def test_a_table_that_cannot_be_fetched_leaves_the_estimate_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def offline(name: str) -> object:
        raise ConnectionError(f"cannot reach the {name} table")

    counter = TokenCounter(load=offline, encoding_name=openai_model)
    monkeypatch.setattr(tokens, "COUNTER", counter)
    p, request = prepared("openai", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}]})
    with caplog.at_level(logging.WARNING, logger="batchrun.tokens"):
        assert counter.wait_for("gpt-4o", timeout=5) is False
        for _ in range(3):
            assert p.estimate_tokens(request).counted is False  # type: ignore[attr-defined]
    warnings = [r.getMessage() for r in caplog.records if r.name == "batchrun.tokens"]
    assert len(warnings) == 1 and "o200k_base" in warnings[0] and "request size" in warnings[0]


def test_batchrun_tiktoken_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHRUN_TIKTOKEN", "0")
    assert tokens._tiktoken_encoding_name("gpt-4o") is None
    monkeypatch.setenv("BATCHRUN_TIKTOKEN", "1")
    assert tokens._tiktoken_encoding_name("gpt-4o") == "o200k_base"  # tiktoken's own model table, no network
    assert tokens._tiktoken_encoding_name("llama-3") is None


def test_a_dry_run_counts_with_tiktoken_and_says_so(
    counter: TokenCounter, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchrun.cli import _show_dry_run
    from batchrun.jobs import dry_run
    from batchrun.spec import Overrides, spec_for_batch_input

    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"".join(orjson.dumps({
        "custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "max_tokens": 10, "messages": [{"role": "user", "content": "hi" * (i + 1)}]},
    }) + b"\n" for i in range(3)))
    report = dry_run(spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1")), path)
    assert report.prompt_counted == 3
    # The texts' and roles' bytes, 3 per message, 3 per reply.
    assert report.prompt_tokens == (2 + 4 + 6) + 3 * (4 + 3 + 3)
    _show_dry_run(report, as_json=False)
    assert "  tokens    42 prompt (counted with tiktoken), up to 30 output (max_tokens)" in capsys.readouterr().out


def test_a_table_that_never_comes_is_waited_for_once(monkeypatch: pytest.MonkeyPatch) -> None:
    never = threading.Event()
    counter = TokenCounter(load=lambda name: never.wait(), encoding_name=openai_model)  # a fetch that hangs
    started = time.monotonic()
    assert counter.wait_for("gpt-4o", timeout=0.3) is False
    assert counter.wait_for("gpt-4o-mini", timeout=0.3) is False  # the same table: no second wait
    assert time.monotonic() - started < 0.55
    never.set()
