"""The provider registry: every kind is one entry, and the rest of batchrun reads its facts from there."""

from __future__ import annotations

import dataclasses

import click
import pytest

from batchrun import provider_registry
from batchrun.cache import cache_scope
from batchrun.cli import provider_option
from batchrun.errors import SpecError
from batchrun.export import FORMATS, TABLE_FORMATS
from batchrun.provider_registry import (
    BATCH_FORMATS,
    DEFAULT_KIND,
    ENTRIES,
    KINDS,
    MAX_TOKENS_PARAMS,
    ProviderEntry,
    kinds_of_format,
    provider_entry,
)
from batchrun.providers import provider_for
from batchrun.providers.base import PreparedRequest
from batchrun.providers.batch_formats import RESULTS_LINES
from batchrun.spec import JobSpec, Overrides, parse_spec, spec_for_batch_input

EXPECTED = "expected one of openai, openai-responses, anthropic"


def spec_of(kind: str, **provider: object) -> JobSpec:
    return parse_spec(
        {"provider": {"kind": kind, "base_url": "http://127.0.0.1:9/v1", "model": "m", **provider},
         "request": {"template": "{text}", "max_tokens": 50}},
        where="test.toml",
    )


@pytest.mark.parametrize("entry", ENTRIES, ids=KINDS)
def test_every_registered_kind_builds_its_provider(entry: ProviderEntry) -> None:
    provider = provider_for(spec_of(entry.kind), api_key=None)
    assert provider.kind == entry.kind
    assert isinstance(provider, entry.load())


def test_the_spec_and_the_cli_accept_exactly_the_registered_kinds() -> None:
    assert KINDS == tuple(e.kind for e in ENTRIES) and len(set(KINDS)) == len(KINDS) and DEFAULT_KIND in KINDS
    for kind in KINDS:
        assert spec_of(kind).provider.kind == kind
        assert spec_for_batch_input(Overrides(base_url="http://h", provider_kind=kind)).provider.kind == kind
    assert parse_spec({}, where="t.toml").provider.kind == DEFAULT_KIND
    assert spec_for_batch_input(Overrides(base_url="http://h")).provider.kind == DEFAULT_KIND

    @provider_option
    def command(provider_kind: str | None) -> None: ...

    choice = next(p for p in click.command()(command).params if p.name == "provider_kind").type
    assert isinstance(choice, click.Choice) and tuple(choice.choices) == KINDS


def test_an_unknown_kind_is_refused_with_the_same_messages() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"provider": {"kind": "gemini"}}, where="t.toml")
    assert info.value.message == f"t.toml: [provider] kind = 'gemini': {EXPECTED}"
    with pytest.raises(SpecError) as info:
        spec_for_batch_input(Overrides(base_url="http://h", provider_kind="gemini"))
    assert info.value.message == f"--provider 'gemini': {EXPECTED}"
    stored = spec_of("openai")  # a stored spec read back with a kind this version does not know
    unknown = dataclasses.replace(stored, provider=dataclasses.replace(stored.provider, kind="gemini"))
    with pytest.raises(SpecError) as info:
        provider_for(unknown, api_key=None)
    assert info.value.message == "provider kind 'gemini' is not supported"


@pytest.mark.parametrize("entry", ENTRIES, ids=KINDS)
def test_the_default_key_variable_comes_from_the_entry(entry: ProviderEntry, monkeypatch: pytest.MonkeyPatch) -> None:
    assert spec_of(entry.kind).provider.api_key_env == entry.api_key_env
    assert spec_of(entry.kind, api_key_env="MY_KEY").provider.api_key_env == "MY_KEY"
    moved = dataclasses.replace(entry, api_key_env="ELSEWHERE_KEY")
    monkeypatch.setitem(provider_registry._BY_KIND, entry.kind, moved)
    assert spec_of(entry.kind).provider.api_key_env == "ELSEWHERE_KEY"


def test_the_cache_scope_holds_the_settings_the_entry_names(monkeypatch: pytest.MonkeyPatch) -> None:
    anthropic = spec_of("anthropic", anthropic_version="2024-01-01").provider
    assert provider_entry("anthropic").cache_scope == (("anthropic-version", "anthropic_version"),)
    assert cache_scope(anthropic) == "anthropic anthropic-version=2024-01-01"
    assert cache_scope(spec_of("openai", anthropic_version="2024-01-01").provider) == "openai"
    chat = spec_of("openai", model="gpt-x").provider
    widened = dataclasses.replace(provider_entry("openai"), cache_scope=(("model", "model"),))
    monkeypatch.setitem(provider_registry._BY_KIND, "openai", widened)
    assert cache_scope(chat) == "openai model=gpt-x"


def test_each_kind_exports_in_its_entrys_batch_format() -> None:
    assert FORMATS == ("results", *BATCH_FORMATS, *TABLE_FORMATS)
    assert set(RESULTS_LINES) == set(BATCH_FORMATS)  # every format a provider names has a line builder
    for entry in ENTRIES:
        assert entry.kind in kinds_of_format(entry.batch_format)
    assert kinds_of_format("openai-batch") == ("openai", "openai-responses")
    assert kinds_of_format("anthropic-batch") == ("anthropic",)


@pytest.mark.parametrize("entry", ENTRIES, ids=KINDS)
def test_the_answer_limit_is_read_from_the_entrys_parameters(entry: ProviderEntry) -> None:
    provider = provider_for(spec_of(entry.kind), api_key=None)
    for name in entry.max_tokens_params:
        body = b'{"model": "m", "%s": 7}' % name.encode()
        assert provider.estimate_tokens(PreparedRequest("http://h/v1", {}, body)).answer == 7
    assert set(entry.max_tokens_params) <= set(MAX_TOKENS_PARAMS)
    assert set(MAX_TOKENS_PARAMS) == {"max_tokens", "max_completion_tokens", "max_output_tokens"}
