"""Provider shapes without a network: request building, reply parsing, stream assembly, conversion."""

from __future__ import annotations

import datetime
import time

import httpx
import orjson
import pytest

from batchrun.errors import AuthError, PermanentError, RateLimitedError, RetryableError, SpecError
from batchrun.providers import provider_for
from batchrun.providers.anthropic import AnthropicProvider, MessageStreamAssembler, openai_to_anthropic
from batchrun.providers.openai import ChatStreamAssembler
from batchrun.providers.openai_responses import OpenAIResponsesProvider, ResponsesStreamAssembler
from batchrun.spec import parse_spec

SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"],
          "additionalProperties": False}


def spec_of(kind: str, **sections: dict[str, object]) -> object:
    data: dict[str, object] = {"provider": {"kind": kind, "base_url": "http://127.0.0.1:9/v1", "model": "m"}}
    data["request"] = {"template": "{text}", "max_tokens": 50, **sections.pop("request", {})}
    data.update(sections)
    return parse_spec(data, where="test.toml")


def anthropic(**sections: dict[str, object]) -> AnthropicProvider:
    provider = provider_for(spec_of("anthropic", **sections), api_key="sk-ant-test-0123456789")  # type: ignore[arg-type]
    assert isinstance(provider, AnthropicProvider)
    return provider


# ---------------------------------------------------------------- Anthropic requests


def test_anthropic_request_has_its_headers_system_field_and_forced_tool() -> None:
    provider = anthropic(output={"schema": SCHEMA, "name": "verdict"})
    body = provider.render_body([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert body == {"model": "m", "max_tokens": 50, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    request = provider.prepare(None, orjson.dumps(body).decode(), followups=[("{}", "fix it")])
    assert request.url == "http://127.0.0.1:9/v1/messages"
    assert request.headers["x-api-key"] == "sk-ant-test-0123456789"
    assert request.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in request.headers
    sent = orjson.loads(request.content)
    assert sent["tool_choice"] == {"type": "tool", "name": "verdict"}
    assert sent["tools"][0]["input_schema"] == SCHEMA
    assert sent["messages"][-2:] == [{"role": "assistant", "content": "{}"}, {"role": "user", "content": "fix it"}]
    assert "sk-ant" not in repr(request)


def test_anthropic_spec_needs_max_tokens_and_an_object_schema() -> None:
    with pytest.raises(SpecError, match="max_tokens is required"):
        provider_for(parse_spec({"provider": {"kind": "anthropic", "base_url": "http://h", "model": "m"},
                                 "request": {"template": "{x}"}}, where="t.toml"))
    with pytest.raises(SpecError, match="JSON object schema"):
        anthropic(output={"schema": {"type": "array", "items": {"type": "string"}}})


def test_spec_checks_stream_and_conversion_flags() -> None:
    assert spec_of("openai", run={"stream": True}).run.stream is True  # type: ignore[attr-defined]
    with pytest.raises(SpecError, match=r"\[run\] stream = 'yes': expected true or false"):
        spec_of("openai", run={"stream": "yes"})
    with pytest.raises(SpecError, match="convert_openai_input only applies"):
        parse_spec({"provider": {"kind": "openai", "base_url": "http://h", "convert_openai_input": True}}, where="t")


# ---------------------------------------------------------------- Anthropic replies


def headers(**values: str) -> httpx.Headers:
    return httpx.Headers({k.replace("_", "-"): v for k, v in values.items()})


def test_anthropic_tool_answer_and_usage_with_cache_reads() -> None:
    provider = anthropic(output={"schema": SCHEMA, "name": "verdict"})
    message = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [{"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "toolu_1", "name": "verdict", "input": {"label": "ok"}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 5},
    }
    reset = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)).isoformat()
    reply = provider.parse(200, headers(request_id="req_9", anthropic_ratelimit_requests_remaining="0",
                                        anthropic_ratelimit_requests_reset=reset),
                           orjson.dumps(message), latency_ms=1.0)
    assert orjson.loads(reply.output or "") == {"label": "ok"}
    assert (reply.input_tokens, reply.cached_tokens, reply.output_tokens) == (105, 90, 7)
    assert reply.finish_reason == "stop" and reply.request_id == "req_9" and reply.model == "claude-x"
    assert reply.limits is not None and reply.limits.remaining_requests == 0
    assert 25 < (reply.limits.reset_requests_s or 0) <= 30


def test_anthropic_stop_reasons_map_to_truncation_and_refusal() -> None:
    provider = anthropic()
    def reply_for(stop: str) -> object:
        body = {"content": [{"type": "text", "text": "partial"}], "stop_reason": stop,
                "usage": {"input_tokens": 1, "output_tokens": 1}}
        return provider.parse(200, headers(), orjson.dumps(body), latency_ms=1.0)
    assert reply_for("max_tokens").finish_reason == "length"  # type: ignore[attr-defined]
    refused = reply_for("refusal")
    assert refused.refusal == "partial"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("status", "error_type", "cls", "error_class"),
    [
        (529, "overloaded_error", RetryableError, "overloaded"),
        (500, "api_error", RetryableError, "server_error"),
        (429, "rate_limit_error", RateLimitedError, "rate_limited"),
        (401, "authentication_error", AuthError, None),
        (400, "invalid_request_error", PermanentError, None),
    ],
)
def test_anthropic_error_bodies_are_classified(status: int, error_type: str, cls: type, error_class: str | None) -> None:
    body = {"type": "error", "error": {"type": error_type, "message": "nope"}, "request_id": "req_1"}
    with pytest.raises(cls) as caught:
        anthropic().parse(status, headers(retry_after="3"), orjson.dumps(body), latency_ms=1.0)
    assert f"{error_type}: nope" in caught.value.message
    if error_class is not None:
        assert caught.value.error_class == error_class
    if cls is RateLimitedError:
        assert caught.value.retry_after == 3.0  # type: ignore[attr-defined]


def anthropic_events(*, stop: bool = True) -> list[tuple[str, dict[str, object]]]:
    events: list[tuple[str, dict[str, object]]] = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
            "stop_reason": None, "usage": {"input_tokens": 25, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "tool_use", "id": "toolu_1", "name": "output", "input": {}}}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "input_json_delta", "partial_json": '{"lab'}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "input_json_delta", "partial_json": 'el": "ok"}'}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"output_tokens": 12}}),
    ]
    if stop:
        events.append(("message_stop", {"type": "message_stop"}))
    return events


def test_anthropic_stream_is_rebuilt_into_the_message() -> None:
    assembler = MessageStreamAssembler()
    carried = [assembler.feed(name, orjson.dumps(data).decode()) for name, data in anthropic_events()]
    assert carried.count(True) == 2
    reply = anthropic(output={"schema": SCHEMA}).parse(200, headers(), assembler.body(), latency_ms=1.0)
    assert orjson.loads(reply.output or "") == {"label": "ok"}
    assert (reply.input_tokens, reply.output_tokens) == (25, 12)


def test_anthropic_stream_without_message_stop_or_with_an_error_event_is_retryable() -> None:
    assembler = MessageStreamAssembler()
    for name, data in anthropic_events(stop=False):
        assembler.feed(name, orjson.dumps(data).decode())
    with pytest.raises(RetryableError) as caught:
        assembler.body()
    assert caught.value.error_class == "stream_broken"
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with pytest.raises(RetryableError) as caught:
        MessageStreamAssembler().feed("error", orjson.dumps(error).decode())
    assert caught.value.error_class == "overloaded" and caught.value.status_code == 529


# ---------------------------------------------------------------- conversion


def test_openai_body_converts_to_anthropic() -> None:
    body = {
        "model": "gpt-4o", "max_completion_tokens": 99, "stop": "END", "temperature": 0.2, "user": "u7",
        "n": 1, "stream": False, "presence_penalty": 0,
        "messages": [{"role": "system", "content": "S1"}, {"role": "developer", "content": [{"type": "text", "text": "S2"}]},
                     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}},
    }
    params = openai_to_anthropic(body, default_max_tokens=None)
    assert params["system"] == "S1\n\nS2"
    assert params["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert (params["max_tokens"], params["stop_sequences"], params["temperature"]) == (99, ["END"], 0.2)
    assert params["metadata"] == {"user_id": "u7"}
    assert params["tool_choice"] == {"type": "tool", "name": "v"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "no max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "logit_bias": {"1": 2}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "temperature": 1.5}, "0..1"),
        ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, "role 'tool'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "max_tokens": 5},
         "only text"),
    ],
)
def test_openai_bodies_that_cannot_convert_say_why(body: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        openai_to_anthropic(body, default_max_tokens=None)


def test_anthropic_batch_lines_are_checked() -> None:
    provider = anthropic()
    url, params = provider.check_batch_line(
        {"custom_id": "a", "params": {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}})
    assert url is None and params["max_tokens"] == 5
    with pytest.raises(ValueError, match="positive integer 'max_tokens'"):
        provider.check_batch_line({"custom_id": "a", "params": {"messages": [{"role": "user", "content": "x"}]}})
    with pytest.raises(ValueError, match="convert_openai_input = true"):
        provider.check_batch_line({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}})
    openai = provider_for(spec_of("openai"), api_key=None)
    with pytest.raises(ValueError, match='kind = "anthropic"'):
        openai.check_batch_line({"custom_id": "a", "params": {}})


# ---------------------------------------------------------------- Responses and Chat streams


def responses() -> OpenAIResponsesProvider:
    provider = provider_for(spec_of("openai-responses", output={"schema": SCHEMA}), api_key="sk-test-0123456789")
    assert isinstance(provider, OpenAIResponsesProvider)
    return provider


def test_responses_request_uses_input_instructions_and_text_format() -> None:
    provider = responses()
    body = provider.render_body([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    request = provider.prepare(None, orjson.dumps(body).decode(), max_tokens=7, followups=[("{}", "again")])
    sent = orjson.loads(request.content)
    assert request.url == "http://127.0.0.1:9/v1/responses"
    assert sent["instructions"] == "S" and sent["max_output_tokens"] == 7
    assert sent["input"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{}"},
                             {"role": "user", "content": "again"}]
    assert sent["text"]["format"]["type"] == "json_schema" and sent["text"]["format"]["schema"] == SCHEMA


def response_object(status: str = "completed", text: str = '{"label": "ok"}') -> dict[str, object]:
    return {
        "id": "resp_1", "object": "response", "status": status, "model": "gpt-x",
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": status,
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 10}, "output_tokens": 6,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 36},
    }


def test_responses_reply_and_incomplete_answer() -> None:
    provider = responses()
    reply = provider.parse(200, headers(x_request_id="r1"), orjson.dumps(response_object()), latency_ms=1.0)
    assert (reply.output, reply.finish_reason, reply.input_tokens, reply.cached_tokens, reply.output_tokens) == (
        '{"label": "ok"}', "stop", 30, 10, 6)
    cut = provider.parse(200, headers(), orjson.dumps(response_object("incomplete", '{"lab')), latency_ms=1.0)
    assert cut.finish_reason == "length"


def test_responses_stream_ends_with_its_terminal_event_or_is_broken() -> None:
    assembler = ResponsesStreamAssembler()
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {**response_object(), "status": "in_progress"}},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": '{"label"'},
        {"type": "response.output_text.delta", "sequence_number": 2, "delta": ': "ok"}'},
    ]
    assert [assembler.feed(str(e["type"]), orjson.dumps(e).decode()) for e in events] == [False, True, True]
    with pytest.raises(RetryableError, match="stream ended early"):
        assembler.body()
    done = {"type": "response.completed", "sequence_number": 3, "response": response_object()}
    assembler.feed("response.completed", orjson.dumps(done).decode())
    assert orjson.loads(assembler.body())["usage"]["output_tokens"] == 6
    failed = {"type": "response.failed", "response": {"status": "failed",
                                                       "error": {"code": "rate_limit_exceeded", "message": "slow down"}}}
    with pytest.raises(RateLimitedError):
        ResponsesStreamAssembler().feed("response.failed", orjson.dumps(failed).decode())


def test_chat_stream_chunks_become_one_completion() -> None:
    assembler = ChatStreamAssembler()
    chunks = [
        {"id": "c1", "model": "gpt-x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "hel"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    ]
    assert [assembler.feed("", orjson.dumps(c).decode()) for c in chunks] == [False, True, True, False]
    assembler.feed("", "[DONE]")
    body = orjson.loads(assembler.body())
    assert body["choices"][0]["message"]["content"] == "hello" and body["usage"]["completion_tokens"] == 2
    broken = ChatStreamAssembler()
    broken.feed("", orjson.dumps(chunks[1]).decode())
    with pytest.raises(RetryableError, match="stream ended early"):
        broken.body()
    with pytest.raises(RateLimitedError):
        ChatStreamAssembler().feed("", orjson.dumps({"error": {"message": "x", "code": "rate_limit_exceeded"}}).decode())


# ---------------------------------------------------------------- reset times, the request sent


def test_seconds_until_reset_reads_rfc3339() -> None:
    from batchrun.providers.anthropic import _seconds_until

    soon = datetime.datetime.fromtimestamp(time.time() + 10, datetime.UTC).isoformat().replace("+00:00", "Z")
    assert 8 < (_seconds_until(soon) or 0) <= 10
    assert _seconds_until("not a time") is None
