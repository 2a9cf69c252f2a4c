"""The response cache's request key: what it covers and what it must never see."""

from __future__ import annotations

import orjson

from batchrun.cache import cache_scope, request_key
from batchrun.providers import provider_for
from batchrun.providers.base import PreparedRequest
from batchrun.spec import JobSpec, parse_spec

URL = "http://127.0.0.1:9/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def key(body: object = BODY, *, url: str = URL, scope: str = "openai", headers: dict[str, str] | None = None) -> str:
    return request_key(scope, PreparedRequest(url, headers or {}, orjson.dumps(body)))


def spec_of(kind: str, **provider: object) -> JobSpec:
    return parse_spec(
        {
            "provider": {"kind": kind, "base_url": "http://127.0.0.1:9/v1", "model": "m", **provider},
            "request": {"template": "{text}", "max_tokens": 50},
        },
        where="test.toml",
    )


def test_headers_never_count_and_the_key_never_holds_them() -> None:
    one = key(headers={"authorization": "Bearer sk-one-1111111111"})
    two = key(headers={"authorization": "Bearer sk-two-2222222222", "x-api-key": "sk-ant-3333"})
    assert one == two == key()
    assert len(one) == 64 and int(one, 16) >= 0


def test_provider_prepared_requests_with_different_keys_share_a_key() -> None:
    spec = spec_of("openai")
    a = provider_for(spec, api_key="sk-aaaaaaaaaaaaaaaa").prepare(None, orjson.dumps(BODY).decode())
    b = provider_for(spec, api_key="sk-bbbbbbbbbbbbbbbb").prepare(None, orjson.dumps(BODY).decode())
    assert a.headers != b.headers
    assert request_key("openai", a) == request_key("openai", b)


def test_key_order_and_whitespace_do_not_count() -> None:
    reordered = {"max_tokens": 5, "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert key(reordered) == key()
    spaced = PreparedRequest(URL, {}, b'{ "model" : "m", "max_tokens": 5,\n "messages": [{"role":"user","content":"hi"}]}')
    assert request_key("openai", spaced) == key()


def test_streaming_does_not_count() -> None:
    assert key({**BODY, "stream": True, "stream_options": {"include_usage": True}}) == key()
    plain = provider_for(spec_of("openai"), api_key=None)
    chunked = provider_for(
        parse_spec(
            {
                "provider": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"},
                "request": {"template": "{text}", "max_tokens": 50},
                "run": {"stream": True},
            },
            where="test.toml",
        ),
        api_key=None,
    )
    body = orjson.dumps(BODY).decode()
    assert chunked.prepare(None, body).stream and not plain.prepare(None, body).stream
    assert request_key("openai", chunked.prepare(None, body)) == request_key("openai", plain.prepare(None, body))


def test_what_is_asked_and_where_counts() -> None:
    base = key()
    assert key({**BODY, "model": "m2"}) != base
    assert key({**BODY, "max_tokens": 6}) != base
    assert key({**BODY, "temperature": 0}) != base
    assert key({**BODY, "messages": [{"role": "user", "content": "hi!"}]}) != base
    assert key(url="http://127.0.0.1:10/v1/chat/completions") != base
    assert key(scope="openai-responses") != base
    older = spec_of("anthropic", anthropic_version="2023-06-01").provider
    assert cache_scope(older) == "anthropic anthropic-version=2023-06-01"  # as keys stored before the registry
    assert cache_scope(older) != cache_scope(spec_of("anthropic", anthropic_version="2024-01-01").provider)
    # The Anthropic version only matters to Anthropic.
    assert cache_scope(spec_of("openai", anthropic_version="2024-01-01").provider) == "openai"


def test_the_schema_is_part_of_the_request() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
    plain = provider_for(spec_of("openai"), api_key=None)
    structured = provider_for(
        parse_spec(
            {
                "provider": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"},
                "request": {"template": "{text}", "max_tokens": 50},
                "output": {"schema": schema},
            },
            where="test.toml",
        ),
        api_key=None,
    )
    body = orjson.dumps(BODY).decode()
    assert request_key("openai", plain.prepare(None, body)) != request_key("openai", structured.prepare(None, body))
