"""Providers: one module per API; nothing outside this package knows their shapes."""

from __future__ import annotations

import os

from batchrun.errors import SpecError
from batchrun.providers.base import PreparedRequest, Provider, Reply, make_client, send
from batchrun.spec import JobSpec


def provider_for(spec: JobSpec, *, api_key: str | None = None, read_key: bool = True) -> Provider:
    """The provider a spec names. The API key comes only from the variable the spec names."""
    if read_key and api_key is None:
        api_key = os.environ.get(spec.provider.api_key_env) or None
    if not spec.provider.base_url:
        raise SpecError("[provider] base_url is not set (give it in the spec or with --base-url)")
    if spec.provider.kind == "openai":
        from batchrun.providers.openai import OpenAIProvider

        return OpenAIProvider(spec, api_key)
    raise SpecError(f"provider kind {spec.provider.kind!r} is not supported")


__all__ = ["PreparedRequest", "Provider", "Reply", "make_client", "provider_for", "send"]
