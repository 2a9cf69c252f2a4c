"""The context guard (batchrun.context): the known windows, the fit check, and the providers'
"prompt too long" 400s as ``context_length`` failures that are the item's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from batchrun import tokens
from batchrun.context import CONTEXT_LENGTH, _answer_counts, known_window
from batchrun.errors import PermanentError, SpecError
from batchrun.health import Refusals
from batchrun.ingest import RequestBuilder, check_input
from batchrun.providers import provider_for
from batchrun.spec import JobSpec, parse_spec


@pytest.fixture(autouse=True)
def _no_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHRUN_TIKTOKEN", "0")  # the byte estimate: figures that do not depend on the network


def spec_of(kind: str = "openai", model: str = "gpt-4o", **request: Any) -> JobSpec:
    data = {"provider": {"kind": kind, "base_url": "http://127.0.0.1:9/v1", "model": model},
            "request": {"template": "{text}", "max_tokens": 1024, **request}}
    return parse_spec(data, where="test.toml")


def builder(spec: JobSpec) -> RequestBuilder:
    return RequestBuilder(spec, provider_for(spec, api_key="sk-test-0123456789", read_key=False))


@pytest.mark.parametrize(("model", "window"), [
    ("gpt-4o", 128_000), ("gpt-4o-2024-08-06", 128_000), ("gpt-4o-mini", 128_000),
    ("gpt-4.1", 1_047_576), ("gpt-4.1-mini-2025-04-14", 1_047_576), ("gpt-4", 8_192), ("gpt-4-turbo", 128_000),
    ("o1-mini", 128_000), ("o3", 200_000), ("o4-mini", 200_000), ("gpt-5-mini", 400_000),
    ("gpt-5-chat-latest", 128_000), ("openai/gpt-4o", 128_000),
    ("claude-3-5-sonnet-20241022", 200_000), ("claude-sonnet-4-5", 200_000), ("claude-opus-4-6", 1_000_000),
    ("llama3", None), ("m", None), ("", None),
])
def test_known_windows_match_the_longest_prefix(model: str, window: int | None) -> None:
    assert known_window(model) == window


def lines(tmp_path: Path, *words: int) -> Path:
    """One record per count: a text of that many 5-byte words (at least one token each by bytes/5)."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": "word " * n}) + b"\n" for i, n in enumerate(words)))
    return path


def test_a_prompt_over_the_window_is_rejected_with_its_size_and_the_window(tmp_path: Path) -> None:
    stats = check_input(lines(tmp_path, 10, 160_000, 10), builder(spec_of()))
    assert (stats.accepted, stats.rejected) == (2, 1)
    assert stats.causes == {CONTEXT_LENGTH: 1}
    line, reason = stats.rejections[0]
    assert line == 2
    assert reason.startswith("prompt ~160,0")  # 800,000 bytes of text / 5 (LEAST_BYTES_PER_TOKEN)
    assert "+ max_tokens 1,024 exceeds the context window of gpt-4o (128,000 tokens;" in reason


def test_max_tokens_counts_against_the_window(tmp_path: Path) -> None:
    # ~12,500 prompt tokens: fits in 16,000 with 1,024 for the answer, not with 8,000
    path = lines(tmp_path, 10_000)
    assert check_input(path, builder(spec_of(max_input_tokens=16_000))).rejected == 0
    tight = check_input(path, builder(spec_of(max_input_tokens=16_000, max_tokens=8_000)))
    assert tight.rejected == 1
    assert "+ max_tokens 8,000 exceeds the context window of 16,000 tokens ([request] max_input_tokens)" in \
        tight.rejections[0][1]


def test_an_unknown_model_has_no_guard_unless_the_spec_sets_a_window(tmp_path: Path) -> None:
    path = lines(tmp_path, 180_000)  # ~180,000 tokens at the least
    assert check_input(path, builder(spec_of(model="my-local-model"))).rejected == 0
    assert check_input(path, builder(spec_of(model="my-local-model", max_input_tokens=100_000))).rejected == 1
    assert check_input(path, builder(spec_of(max_input_tokens=0))).rejected == 0  # 0: no guard, even for gpt-4o


def test_anthropic_models_and_batch_form_lines_are_guarded_by_their_own_model(tmp_path: Path) -> None:
    assert check_input(lines(tmp_path, 190_000), builder(spec_of("anthropic", "claude-sonnet-4-5", max_tokens=16_000))).rejected == 1
    path = tmp_path / "batch.jsonl"
    big = {"model": "gpt-4o-mini", "max_tokens": 100, "messages": [{"role": "user", "content": "word " * 160_000}]}
    small = {**big, "messages": [{"role": "user", "content": "hi"}]}
    path.write_bytes(b"".join(
        orjson.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + b"\n"
        for cid, body in (("big", big), ("small", small))
    ))
    spec = parse_spec({"provider": {"base_url": "http://127.0.0.1:9/v1"}}, where="test.toml")
    stats = check_input(path, builder(spec))
    assert (stats.accepted, stats.rejected) == (1, 1)
    assert "max_tokens 100 exceeds the context window of gpt-4o-mini" in stats.rejections[0][1]


def test_max_input_tokens_must_not_be_negative() -> None:
    with pytest.raises(SpecError, match=r"max_input_tokens = -1: expected a positive integer"):
        spec_of(max_input_tokens=-1)


def test_the_window_is_part_of_the_jobs_identity() -> None:
    assert spec_of(max_input_tokens=1000).identity_hash() != spec_of().identity_hash()
    stored = spec_of(max_input_tokens=1000).to_dict()
    assert JobSpec.from_dict(stored).request.max_input_tokens == 1000


# ---------------------------------------------------------------- the provider says so


def refused(kind: str, body: dict[str, Any]) -> PermanentError:
    provider = provider_for(spec_of(kind, model="m"), api_key="sk-test-0123456789", read_key=False)
    with pytest.raises(PermanentError) as caught:
        provider.parse(400, httpx.Headers(), orjson.dumps(body), latency_ms=1.0)
    return caught.value


OPENAI_TOO_LONG = {"error": {"message": "This model's maximum context length is 128000 tokens. However, your "
                             "messages resulted in 210000 tokens.", "type": "invalid_request_error",
                             "param": "messages", "code": "context_length_exceeded"}}
ANTHROPIC_TOO_LONG = {"type": "error", "error": {"type": "invalid_request_error",
                                                 "message": "prompt is too long: 210000 tokens > 200000 maximum"}}


@pytest.mark.parametrize(("kind", "body"), [
    ("openai", OPENAI_TOO_LONG),
    ("openai", {"error": {"message": "Input too large.", "type": "invalid_request_error",
                          "code": "context_length_exceeded"}}),
    ("openai-responses", OPENAI_TOO_LONG),
    ("anthropic", ANTHROPIC_TOO_LONG),
])
def test_a_providers_prompt_too_long_is_a_context_length_failure_of_the_item(kind: str, body: dict[str, Any]) -> None:
    error = refused(kind, body)
    assert error.error_class == CONTEXT_LENGTH
    refusals: Refusals[int] = Refusals(items=1)
    assert not refusals.hold(1, error)  # the item's own: never held as "every request is refused"
    assert refusals.verdict() is None


def test_other_400s_stay_client_errors() -> None:
    error = refused("openai", {"error": {"message": "Unrecognized request argument supplied: bogus",
                                         "type": "invalid_request_error", "code": None}})
    assert error.error_class == "client_error"


class WordEncoding:
    """A stand-in tiktoken encoding (the real tables come over the network): one token a word."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * len(text.split())


def test_near_the_limit_the_prompt_is_counted_with_tiktoken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "COUNTER", tokens.TokenCounter(load=lambda name: WordEncoding(),
                                                               encoding_name=lambda model: "words"))
    # 600,000 bytes (~150,000 by bytes/4, over 128,000) but 120,000 words: counted, it fits
    stats = check_input(lines(tmp_path, 120_000, 130_000), builder(spec_of()))
    assert (stats.accepted, stats.rejected) == (1, 1)
    assert stats.rejections[0][0] == 2
    assert stats.rejections[0][1].startswith("prompt 130,0")
    assert " tokens (tiktoken) + max_tokens 1,024 exceeds the context window of gpt-4o" in stats.rejections[0][1]


def test_a_size_alone_rejects_only_what_cannot_fit_at_five_bytes_a_token(tmp_path: Path) -> None:
    # 600,000 bytes: ~150,000 tokens by bytes/4, yet as few as ~120,000 (tiktoken counts "word " * n
    # as n tokens): without a count it may fit gpt-4o's 128,000, so it is sent, not rejected for good
    assert check_input(lines(tmp_path, 120_000), builder(spec_of())).rejected == 0


def test_base64_images_do_not_count_by_their_size(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    image = "data:image/png;base64," + "A" * 900_000  # ~1k tokens to the provider, 225k by bytes/4
    body = {"model": "gpt-4o", "max_tokens": 300, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": image}}]}]}
    path.write_bytes(orjson.dumps({"custom_id": "img", "method": "POST", "url": "/v1/chat/completions", "body": body}) + b"\n")
    spec = parse_spec({"provider": {"base_url": "http://127.0.0.1:9/v1"}}, where="test.toml")
    assert check_input(path, builder(spec)).rejected == 0


def test_old_claude_3_answers_do_not_count_against_the_window_and_gpt_4_previews_have_128k() -> None:
    assert _answer_counts("claude-3-5-sonnet-20241022") is False and _answer_counts("claude-3-haiku-20240307") is False
    assert _answer_counts("claude-3-7-sonnet-latest") is True and _answer_counts("claude-sonnet-4-5") is True
    assert _answer_counts("gpt-4o") is True
    assert known_window("gpt-4-0125-preview") == known_window("gpt-4-1106-preview") == 128_000
    assert known_window("gpt-4-0613") == 8_192
