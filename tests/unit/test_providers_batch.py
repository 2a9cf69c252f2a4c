"""The providers' batch API shapes without a network: batch objects, results lines, request lines,
and the service tier of online requests (batchrun/providers/openai_batch.py, anthropic_batch.py)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from batchrun.cache import cache_scope, request_key
from batchrun.errors import PermanentError, RetryableError, SpecError
from batchrun.providers import batch_api_for, provider_for
from batchrun.providers import anthropic_batch, openai_batch
from batchrun.spec import FLEX_TIMEOUT, parse_spec

from .test_providers import spec_of


def test_an_openai_batch_object_in_batch_modes_words() -> None:
    batch = openai_batch.batch_of({
        "id": "batch_1", "object": "batch", "status": "completed", "created_at": 1700000000,
        "in_progress_at": 1700000010, "completed_at": 1700000100, "expires_at": 1700086400,
        "input_file_id": "file-in", "output_file_id": "file-out", "error_file_id": "",
        "request_counts": {"total": 3, "completed": 2, "failed": 1},
        "metadata": {"batchrun_shard": "7-abc", "batchrun_job": "7"},
    })
    assert (batch.ended, batch.refused, batch.total, batch.token) == (True, False, 3, "7-abc")
    assert (batch.created_at, batch.ended_at, batch.error_file_id) == (1700000000.0, 1700000100.0, None)
    failed = openai_batch.batch_of({
        "id": "batch_2", "status": "failed", "created_at": 1, "failed_at": 2,
        "errors": {"object": "list", "data": [{"code": "token_limit_exceeded", "message": "too many", "line": None},
                                              {"code": "invalid_request", "message": "bad url", "line": 4}]},
    })
    assert failed.refused and failed.ended and [(e.code, e.line) for e in failed.errors] == [
        ("token_limit_exceeded", None), ("invalid_request", 4)]
    assert not openai_batch.batch_of({"id": "b", "status": "in_progress"}).ended


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ({"custom_id": "a", "response": {"status_code": 200, "request_id": "r1", "body": {"x": 1}}, "error": None},
         ("a", 200, b'{"x":1}', "r1", None)),
        # A 4xx inside a line is a failure even with error null.
        ({"custom_id": "b", "response": {"status_code": 400, "body": {"error": {"message": "no"}}}, "error": None},
         ("b", 400, b'{"error":{"message":"no"}}', None, None)),
        ({"custom_id": "c", "response": None, "error": {"code": "batch_expired", "message": "expired"}},
         ("c", None, None, None, "expired")),
        ({"custom_id": "d", "response": None, "error": {"code": "batch_cancelled", "message": "cancelled"}},
         ("d", None, None, None, "cancelled")),
    ],
)
def test_openai_results_lines(line: dict[str, object], expected: tuple[object, ...]) -> None:
    got = openai_batch.result_line(orjson.dumps(line))
    assert got is not None
    assert (got.custom_id, got.status_code, got.body, got.request_id, got.unworked) == expected


def test_an_openai_line_error_without_a_response_is_a_server_error() -> None:
    got = openai_batch.result_line(b'{"custom_id": "e", "response": null, "error": {"code": "x", "message": "m"}}')
    assert got is not None and got.status_code == 500 and got.unworked is None
    assert openai_batch.result_line(b"not json") is None and openai_batch.result_line(b'{"no": "id"}') is None


def test_an_anthropic_batch_object_and_its_results() -> None:
    batch = anthropic_batch.batch_of({
        "id": "msgbatch_1", "type": "message_batch", "processing_status": "ended",
        "request_counts": {"processing": 0, "succeeded": 2, "errored": 1, "canceled": 0, "expired": 1},
        "created_at": "2026-12-01T10:00:00Z", "ended_at": "2026-12-01T10:30:00.5+00:00",
        "expires_at": "2026-12-02T10:00:00Z",
    })
    assert batch.ended and batch.total == 4
    assert batch.ended_at is not None and batch.created_at is not None
    assert batch.ended_at - batch.created_at == pytest.approx(1800.5)
    ok = anthropic_batch.result_line(orjson.dumps(
        {"custom_id": "a", "result": {"type": "succeeded", "message": {"id": "msg_1", "content": []}}}))
    assert ok is not None and (ok.status_code, ok.request_id) == (200, "msg_1")
    bad = anthropic_batch.result_line(orjson.dumps({"custom_id": "b", "result": {
        "type": "errored", "error": {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}}}))
    assert bad is not None and bad.status_code == 400 and orjson.loads(bad.body or b"")["error"]["message"] == "no"
    busy = anthropic_batch.result_line(orjson.dumps({"custom_id": "c", "result": {
        "type": "errored", "error": {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}}}))
    assert busy is not None and busy.status_code == 529
    for kind, unworked in (("expired", "expired"), ("canceled", "cancelled")):
        line = anthropic_batch.result_line(orjson.dumps({"custom_id": "d", "result": {"type": kind}}))
        assert line is not None and line.unworked == unworked


def test_an_errored_line_is_classified_as_the_online_error_would_be() -> None:
    spec = spec_of("anthropic")
    provider = provider_for(spec, api_key="k")  # type: ignore[arg-type]
    for error_type, expected in (("invalid_request_error", PermanentError), ("overloaded_error", RetryableError),
                                 ("api_error", RetryableError)):
        line = anthropic_batch.result_line(orjson.dumps({"custom_id": "x", "result": {
            "type": "errored", "error": {"type": "error", "error": {"type": error_type, "message": "m"}}}}))
        assert line is not None
        with pytest.raises(expected):
            provider.parse(line.status_code or 500, httpx.Headers(), line.body or b"", latency_ms=0.0)


def test_request_lines_carry_the_prepared_body() -> None:
    spec = spec_of("openai", output={"schema": {"type": "object", "properties": {"a": {"type": "string"}},
                                                 "required": ["a"], "additionalProperties": False}})
    provider = provider_for(spec, api_key="k")  # type: ignore[arg-type]
    api = batch_api_for(spec, provider)  # type: ignore[arg-type]
    request = provider.prepare(None, orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}).decode())
    line = orjson.loads(api.line("id-1", api.endpoint_of(None), request))
    assert line["custom_id"] == "id-1" and line["method"] == "POST" and line["url"] == "/v1/chat/completions"
    assert line["body"]["model"] == "m" and line["body"]["response_format"]["type"] == "json_schema"
    assert api.accepts_custom_id("any string at all: OpenAI takes it")
    claude = batch_api_for(spec_of("anthropic"), provider_for(spec_of("anthropic"), api_key="k"))  # type: ignore[arg-type]
    # Anthropic batches carry no metadata: their lines always name the shard, never the item's own id.
    assert not claude.accepts_custom_id("row-17_b")
    assert claude.file_format.head == b'{"requests":[' and claude.endpoint_of("/v1/messages") is None


def test_the_flex_service_tier_goes_on_online_requests_only() -> None:
    online = spec_of("openai", run={"service_tier": "flex"})
    assert online.run.timeout == FLEX_TIMEOUT  # type: ignore[attr-defined]
    request = provider_for(online, api_key="k").prepare(None, '{"messages": []}')  # type: ignore[arg-type]
    assert orjson.loads(request.content)["service_tier"] == "flex"
    batch = spec_of("openai", run={"service_tier": "flex", "mode": "batch", "timeout": 60})
    assert batch.run.timeout == 60  # type: ignore[attr-defined]
    assert "service_tier" not in orjson.loads(
        provider_for(batch, api_key="k").prepare(None, '{"messages": []}').content  # type: ignore[arg-type]
    )
    # The tier is how an answer is served, not what is asked: the response cache shares answers.
    plain = provider_for(spec_of("openai"), api_key="k").prepare(None, '{"messages": []}')  # type: ignore[arg-type]
    scope = cache_scope(online.provider)  # type: ignore[attr-defined]
    assert request_key(scope, request) == request_key(scope, plain)
    with pytest.raises(SpecError, match="service_tier is OpenAI's"):
        provider_for(spec_of("anthropic", run={"service_tier": "flex"}), api_key="k")  # type: ignore[arg-type]


def test_batch_settings_are_read_and_checked() -> None:
    spec = parse_spec({"provider": {"base_url": "http://h/v1", "model": "m"}, "run": {"mode": "batch"},
                       "batch": {"deadline": "6h", "poll_interval": 5, "max_requests": 1000, "keep_files": True}},
                      where="t.toml")
    assert (spec.run.mode, spec.batch.deadline, spec.batch.poll_interval, spec.batch.max_requests,
            spec.batch.keep_files) == ("batch", 21600.0, 5.0, 1000, True)
    plain = parse_spec({"provider": {"base_url": "http://h/v1", "model": "m"}}, where="t.toml")
    assert spec.identity_hash() == plain.identity_hash()  # how a job is worked is not what it asks
    with pytest.raises(SpecError, match="mode = 'bulk'"):
        parse_spec({"provider": {"base_url": "http://h/v1"}, "run": {"mode": "bulk"}}, where="t.toml")
    with pytest.raises(SpecError, match="deadline = 'soon'"):
        parse_spec({"provider": {"base_url": "http://h/v1"}, "batch": {"deadline": "soon"}}, where="t.toml")
    with pytest.raises(SpecError, match="unknown key 'size'"):
        parse_spec({"provider": {"base_url": "http://h/v1"}, "batch": {"size": 3}}, where="t.toml")


def test_the_batch_price_is_half_unless_the_spec_says_otherwise() -> None:
    spec = parse_spec({"provider": {"base_url": "http://h/v1", "model": "gpt-4o-mini"}}, where="t.toml")
    price = spec.batch_price()
    assert price is not None and (price.input, price.output, price.cached_input) == (0.075, 0.30, 0.0375)
    priced = parse_spec({"provider": {"base_url": "http://h/v1", "model": "gpt-4o-mini"},
                         "pricing": {"batch_input_per_million": 0.1}}, where="t.toml")
    assert priced.batch_price() is not None and priced.batch_price().input == 0.1  # type: ignore[union-attr]
    unknown = parse_spec({"provider": {"base_url": "http://h/v1", "model": "mystery"}}, where="t.toml")
    assert unknown.batch_price() is None


def test_a_stored_spec_without_batch_settings_still_opens() -> None:
    spec = parse_spec({"provider": {"base_url": "http://h/v1", "model": "m"}}, where="t.toml")
    stored = spec.to_dict()
    stored.pop("batch")
    stored["run"].pop("mode")
    old = type(spec).from_dict(stored)
    assert old.run.mode == "online" and old.batch == spec.batch and old.identity_hash() == spec.identity_hash()


def test_a_create_timeout_is_the_setting_else_the_providers_default() -> None:
    spec = parse_spec({"provider": {"base_url": "http://h/v1", "model": "m"}, "batch": {"create_timeout": "2m"}},
                      where="t.toml")
    assert spec.batch.create_timeout == 120.0
    assert parse_spec({"provider": {"base_url": "http://h/v1"}}, where="t.toml").batch.create_timeout == 0.0
    with pytest.raises(SpecError, match="create_timeout"):
        parse_spec({"provider": {"base_url": "http://h/v1"}, "batch": {"create_timeout": -1}}, where="t.toml")
    openai = batch_api_for(spec_of("openai"), provider_for(spec_of("openai"), api_key="k"))  # type: ignore[arg-type]
    anthropic = batch_api_for(spec_of("anthropic"), provider_for(spec_of("anthropic"), api_key="k"))  # type: ignore[arg-type]
    assert openai.create_timeout(100_000_000) == 60.0  # the file is uploaded already
    assert anthropic.create_timeout(0) == 60.0 and anthropic.create_timeout(256_000_000) == 60.0 + 8 * 256
