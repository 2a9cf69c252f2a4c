"""A 2xx that carries no answer is never a success (issue 14, case 4).

No ``choices`` (or no message in them), or no ``output`` list in a Responses
object, is a broken body: retryable ``bad_response``, as Anthropic treats a
Message without ``content``. An answer the provider's content filter withheld
is a permanent ``content_filter`` failure. Answers that really are answers —
tool calls, a refusal — stay answers.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from batchrun.errors import PermanentError, RetryableError
from batchrun.providers import provider_for
from batchrun.providers.openai import ChatStreamAssembler, OpenAIProvider
from batchrun.providers.openai_responses import OpenAIResponsesProvider
from batchrun.spec import parse_spec

USAGE = {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}


def provider(kind: str = "openai") -> Any:
    spec = parse_spec(
        {"provider": {"kind": kind, "base_url": "http://127.0.0.1:9/v1", "model": "m"},
         "request": {"template": "{text}", "max_tokens": 50}},
        where="test.toml",
    )
    made = provider_for(spec, api_key="sk-test-0123456789")
    assert isinstance(made, OpenAIResponsesProvider if kind == "openai-responses" else OpenAIProvider)
    return made


def parse(body: dict[str, Any], kind: str = "openai") -> Any:
    return provider(kind).parse(200, httpx.Headers(), orjson.dumps(body), latency_ms=1.0)


def completion(*choices: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": list(choices), "usage": USAGE}


def choice(finish_reason: str | None = "stop", **message: Any) -> dict[str, Any]:
    return {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}


@pytest.mark.parametrize(
    "body",
    [
        {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "usage": USAGE},  # no choices at all
        completion(),  # an empty list
        completion({"index": 0, "finish_reason": "stop"}),  # a choice without a message
        completion({"index": 0, "message": None, "finish_reason": "stop"}),
        completion("not a choice"),
        {**completion(), "choices": None},
    ],
    ids=["no-choices", "empty-choices", "no-message", "null-message", "choice-not-object", "null-choices"],
)
def test_chat_2xx_without_a_message_is_a_retryable_bad_response(body: dict[str, Any]) -> None:
    with pytest.raises(RetryableError) as caught:
        parse(body)
    assert caught.value.error_class == "bad_response"
    assert caught.value.status_code == 200
    assert "no answer" in caught.value.message and caught.value.body  # the body is kept for the ledger


@pytest.mark.parametrize("content", [None, ""])
def test_chat_content_filtered_without_content_is_a_permanent_content_filter_failure(content: str | None) -> None:
    with pytest.raises(PermanentError) as caught:
        parse(completion(choice("content_filter", content=content)))
    assert caught.value.error_class == "content_filter"
    assert "content filter" in caught.value.message
    assert caught.value.status_code == 200 and caught.value.body


def test_chat_content_filter_names_the_categories_the_provider_flagged() -> None:
    flagged = choice("content_filter", content=None)
    flagged["content_filter_results"] = {
        "hate": {"filtered": False, "severity": "safe"},
        "violence": {"filtered": True, "severity": "high"},
    }
    with pytest.raises(PermanentError, match=r"violence \(high\)") as caught:
        parse(completion(flagged))
    assert "hate" not in caught.value.message


def test_chat_answers_without_content_stay_answers() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool = parse(completion(choice("tool_calls", content=None, tool_calls=[call])))
    assert tool.finish_reason == "tool_calls"
    refused = parse(completion(choice("stop", content=None, refusal="I can't help with that.")))
    assert refused.refusal == "I can't help with that." and refused.output is None
    # Text the filter let through before it stopped the answer is the provider's answer: kept.
    partial = parse(completion(choice("content_filter", content="Once upon a")))
    assert partial.output == "Once upon a" and partial.finish_reason == "content_filter"
    empty = parse(completion(choice("stop", content="")))
    assert empty.output == ""


def stream(*chunks: dict[str, Any]) -> bytes:
    assembler = ChatStreamAssembler()
    for chunk in chunks:
        assembler.feed("", orjson.dumps(chunk).decode())
    assembler.feed("", "[DONE]")
    return assembler.body()


def test_streamed_chat_content_filtered_before_any_text_is_a_content_filter_failure() -> None:
    body = stream(
        {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "content_filter"}]},
        {"id": "c1", "choices": [], "usage": USAGE},
    )
    with pytest.raises(PermanentError) as caught:
        provider().parse(200, httpx.Headers(), body, latency_ms=1.0)
    assert caught.value.error_class == "content_filter"


def test_streamed_chat_without_any_choice_is_a_bad_response() -> None:
    with pytest.raises(RetryableError) as caught:
        stream({"id": "c1", "model": "m", "choices": [], "usage": USAGE})
    assert caught.value.error_class == "bad_response"


def test_streamed_tool_call_stays_an_answer() -> None:
    body = stream(
        {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    )
    assert provider().parse(200, httpx.Headers(), body, latency_ms=1.0).finish_reason == "tool_calls"


def response(status: str = "completed", **fields: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": status, "model": "m",
            "usage": {"input_tokens": 9, "output_tokens": 0}, **fields}


@pytest.mark.parametrize("output", ["missing", None, "text"], ids=["no-output", "null-output", "output-not-list"])
def test_responses_2xx_without_an_output_list_is_a_bad_response(output: Any) -> None:
    body = response() if output == "missing" else response(output=output)
    with pytest.raises(RetryableError) as caught:
        parse(body, "openai-responses")
    assert caught.value.error_class == "bad_response" and caught.value.status_code == 200


def test_responses_content_filtered_without_text_is_a_content_filter_failure() -> None:
    body = response("incomplete", incomplete_details={"reason": "content_filter"}, output=[])
    with pytest.raises(PermanentError) as caught:
        parse(body, "openai-responses")
    assert caught.value.error_class == "content_filter"


def test_responses_answers_without_text_stay_answers() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"}
    assert parse(response(output=[call]), "openai-responses").finish_reason == "stop"
    refusal = {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}
    assert parse(response(output=[refusal]), "openai-responses").refusal == "No."


@pytest.mark.parametrize("finish_reason", ["stop", None])
def test_chat_null_content_with_nothing_else_is_a_retryable_bad_response(finish_reason: str | None) -> None:
    with pytest.raises(RetryableError) as caught:
        parse(completion(choice(finish_reason, content=None)))
    assert caught.value.error_class == "bad_response"


def test_chat_null_content_with_a_tool_call_stays_an_answer() -> None:
    call = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    reply = parse(completion(choice("tool_calls", content=None, tool_calls=call)))
    assert reply.output is None and reply.finish_reason == "tool_calls"


@pytest.mark.parametrize("content", [None, ""])
def test_chat_limit_spent_before_any_text_is_a_permanent_truncation(content: str | None) -> None:
    """A reasoning model can spend max_completion_tokens thinking: "" (or null) with finish_reason
    "length" is no answer, and asking again with the same limit is paid for and ends the same way."""
    with pytest.raises(PermanentError) as caught:
        parse(completion(choice("length", content=content)))
    assert caught.value.error_class == "truncated" and "--max-tokens" in caught.value.message


def responses(status: str, output: list[Any], **extra: Any) -> dict[str, Any]:
    usage = {"input_tokens": 9, "output_tokens": 0, "total_tokens": 9}
    return {"id": "resp_1", "object": "response", "status": status, "model": "m", "output": output, "usage": usage,
            **extra}


@pytest.mark.parametrize(
    "body",
    [
        responses("completed", []),
        responses("completed", [{"type": "reasoning", "id": "rs_1", "summary": []}]),
        responses("in_progress", []),
        responses("queued", []),
    ],
    ids=["completed-empty", "only-reasoning", "in-progress", "queued"],
)
def test_responses_without_message_or_tool_call_is_a_retryable_bad_response(body: dict[str, Any]) -> None:
    with pytest.raises(RetryableError) as caught:
        parse(body, "openai-responses")
    assert caught.value.error_class == "bad_response"


def test_responses_limit_spent_on_reasoning_is_a_permanent_truncation() -> None:
    body = responses("incomplete", [{"type": "reasoning", "id": "rs_1", "summary": []}],
                     incomplete_details={"reason": "max_output_tokens"})
    with pytest.raises(PermanentError) as caught:
        parse(body, "openai-responses")
    assert caught.value.error_class == "truncated"


def test_responses_function_call_stays_an_answer() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"}
    reply = parse(responses("completed", [call]), "openai-responses")
    assert reply.output == "" and reply.finish_reason == "stop"
