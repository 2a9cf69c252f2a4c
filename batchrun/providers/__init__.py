"""Providers: one module per API; nothing outside this package knows their shapes.

==================  ==========================================  ============================
kind                API                                         module
==================  ==========================================  ============================
openai              Chat Completions (and compatible servers)   :mod:`.openai`
openai-responses    Responses                                   :mod:`.openai_responses`
anthropic           Messages                                    :mod:`.anthropic`
==================  ==========================================  ============================
"""

from __future__ import annotations

import os

from batchrun.errors import SpecError
from batchrun.providers.base import PreparedRequest, Provider, Reply
from batchrun.redact import register_secret
from batchrun.spec import JobSpec


def provider_for(spec: JobSpec, *, api_key: str | None = None, read_key: bool = True) -> Provider:
    """The provider a spec names. The API key comes only from the variable the spec names,
    and is registered for redaction the moment it is read."""
    if read_key and api_key is None:
        api_key = os.environ.get(spec.provider.api_key_env) or None
    register_secret(api_key)
    if not spec.provider.base_url:
        raise SpecError("[provider] base_url is not set (give it in the spec or with --base-url)")
    kind = spec.provider.kind
    if kind == "openai":
        from batchrun.providers.openai import OpenAIProvider

        return OpenAIProvider(spec, api_key)
    if kind == "openai-responses":
        from batchrun.providers.openai_responses import OpenAIResponsesProvider

        return OpenAIResponsesProvider(spec, api_key)
    if kind == "anthropic":
        from batchrun.providers.anthropic import AnthropicProvider

        return AnthropicProvider(spec, api_key)
    raise SpecError(f"provider kind {kind!r} is not supported")


__all__ = ["PreparedRequest", "Provider", "Reply", "provider_for"]
