"""The provider registry: one entry per ``[provider] kind``, with everything the rest of
batchrun may know about it.

A provider is one module in ``batchrun/providers/`` (its class: request shape, auth,
reply parsing, streaming) plus one entry here. Nothing else names a kind: the spec,
the CLI, export, the budget and the response cache ask this table.

This module is plain data, below the spec (which reads it) and so outside
``providers/`` (whose modules read the spec). It imports no provider code and not
the HTTP stack, so commands that only read the ledger start fast; a provider's
class is imported when one is built (:meth:`ProviderEntry.load`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchrun.errors import SpecError

DEFAULT_KIND = "openai"  # a spec without [provider] kind, and --provider's default
DEFAULT_ANTHROPIC_VERSION = "2023-06-01"  # [provider] anthropic_version: the anthropic-version header sent


@dataclass(frozen=True)
class ProviderEntry:
    """What one kind of provider is, as the rest of batchrun sees it."""

    kind: str  # [provider] kind, --provider
    provider: str  # "module:Class" of its Provider, called as Class(spec, api_key)
    api_key_env: str  # where the key is read from unless [provider] api_key_env names another variable
    # Its batch API's line shape: input lines without a SPEC, and export --format
    # (the results lines are built in batchrun/providers/batch_formats.py).
    batch_format: str
    max_tokens_params: tuple[str, ...]  # body fields that cap the answer's tokens, in the order they are read
    # (label, [provider] setting) pairs whose values enter the response-cache key besides the kind:
    # settings that change the answer's shape for the same request body.
    cache_scope: tuple[tuple[str, str], ...] = ()
    converts_openai_input: bool = False  # [provider] convert_openai_input applies to it
    batch_api: str = ""  # "module:Class" of its batch API (batch mode), built as Class(provider, ...); "": none
    batch_results_days: float = 0.0  # how long the provider keeps an ended batch's results

    def load(self) -> Callable[..., Any]:
        """The provider's class (its module is imported now)."""
        return _load(self.provider)

    def load_batch_api(self) -> Callable[..., Any]:
        """The batch API's class; SpecError if the kind has none."""
        if not self.batch_api:
            raise SpecError(f"provider kind {self.kind!r} has no batch API: use [run] mode = \"online\"")
        return _load(self.batch_api)


def _load(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    factory: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return factory


ENTRIES: tuple[ProviderEntry, ...] = (
    ProviderEntry(  # Chat Completions (and compatible servers)
        kind="openai",
        provider="batchrun.providers.openai:OpenAIProvider",
        api_key_env="OPENAI_API_KEY",
        batch_format="openai-batch",
        max_tokens_params=("max_completion_tokens", "max_tokens"),
        batch_api="batchrun.providers.openai_batch:OpenAIBatchApi",
        batch_results_days=30.0,  # batch files expire after 30 days
    ),
    ProviderEntry(  # Responses
        kind="openai-responses",
        provider="batchrun.providers.openai_responses:OpenAIResponsesProvider",
        api_key_env="OPENAI_API_KEY",
        batch_format="openai-batch",
        max_tokens_params=("max_output_tokens",),
        batch_api="batchrun.providers.openai_batch:OpenAIBatchApi",
        batch_results_days=30.0,
    ),
    ProviderEntry(  # Messages
        kind="anthropic",
        provider="batchrun.providers.anthropic:AnthropicProvider",
        api_key_env="ANTHROPIC_API_KEY",
        batch_format="anthropic-batch",
        max_tokens_params=("max_tokens",),
        cache_scope=(("anthropic-version", "anthropic_version"),),
        converts_openai_input=True,
        batch_api="batchrun.providers.anthropic_batch:AnthropicBatchApi",
        batch_results_days=29.0,  # results are kept 29 days after creation
    ),
)

KINDS = tuple(entry.kind for entry in ENTRIES)
BATCH_FORMATS = tuple(dict.fromkeys(entry.batch_format for entry in ENTRIES))
# Every body field that caps an answer's tokens, in any API.
MAX_TOKENS_PARAMS = tuple(dict.fromkeys(name for entry in ENTRIES for name in entry.max_tokens_params))
_BY_KIND = {entry.kind: entry for entry in ENTRIES}


def provider_entry(kind: str) -> ProviderEntry:
    """The entry of ``kind``; SpecError if no provider of that kind is registered."""
    try:
        return _BY_KIND[kind]
    except KeyError:
        raise SpecError(f"provider kind {kind!r} is not supported") from None


def kinds_of_format(batch_format: str) -> tuple[str, ...]:
    """The kinds whose batch API uses the line shape ``batch_format``."""
    return tuple(entry.kind for entry in ENTRIES if entry.batch_format == batch_format)
