"""Providers: one module per API; nothing outside this package knows their shapes.

Each API has its module (:mod:`.openai`, :mod:`.openai_responses`, :mod:`.anthropic`)
and an entry in :mod:`batchrun.provider_registry`, which lists the kinds. :mod:`.base`
holds the :class:`Provider` protocol and the request/reply types, :mod:`.http` sends
requests, :mod:`.batch_formats` builds the batch APIs' results lines. Importing this
package does not load the HTTP stack.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from batchrun.errors import SpecError
from batchrun.provider_registry import provider_entry
from batchrun.providers.base import PreparedRequest, Provider, Reply
from batchrun.redact import register_secret

if TYPE_CHECKING:
    from batchrun.spec import JobSpec


def provider_for(spec: JobSpec, *, api_key: str | None = None, read_key: bool = True) -> Provider:
    """The provider a spec names. The API key comes only from the variable the spec names,
    and is registered for redaction the moment it is read."""
    if read_key and api_key is None:
        api_key = os.environ.get(spec.provider.api_key_env) or None
    register_secret(api_key)
    if not spec.provider.base_url:
        raise SpecError("[provider] base_url is not set (give it in the spec or with --base-url)")
    provider: Provider = provider_entry(spec.provider.kind).load()(spec, api_key)
    return provider


__all__ = ["PreparedRequest", "Provider", "Reply", "provider_for"]
