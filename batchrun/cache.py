"""The response cache: a request already answered in any job of the ledger is reused at no cost.

An item's key is the SHA-256 of

- the API it is sent to: the provider kind, plus the settings its registry
  entry names as deciding the answer's shape (``anthropic-version``, say),
- the full request URL (so the base URL counts),
- the canonical JSON (keys sorted, no whitespace) of the body its *first*
  attempt sends, exactly as :meth:`Provider.prepare` builds it: model, messages,
  ``max_tokens``, temperature, the job's structured-output request (schema)
  included.

Left out on purpose:

- every header, so the API key never influences or enters the key (two runs
  with different keys share answers);
- ``stream`` and ``stream_options``: a streamed answer is stored as the body
  the same request would have had without streaming, so streaming on or off
  asks the same question; ``service_tier`` likewise (flex or not, the same question);
- re-asks: an item's answer is filed under its first request even when it
  took a re-ask to get a valid one, because that request is what the next job
  will send first.

Only ``succeeded`` items are ever reused; failed and invalid answers never are.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import httpx
import orjson

from batchrun.errors import OutputInvalidError, ProviderError
from batchrun.provider_registry import provider_entry

if TYPE_CHECKING:
    from batchrun.ledger.store import CachedAnswer
    from batchrun.providers.base import PreparedRequest, Provider
    from batchrun.spec import ProviderSpec
    from batchrun.validate import OutputValidator

KEY_LENGTH = 64  # hex SHA-256, the width of items.request_hash
DELIVERY_FIELDS = ("stream", "stream_options", "service_tier")  # how the answer travels, not what is asked


def cache_scope(provider: ProviderSpec) -> str:
    """The part of the key that names the API: the kind, plus ``label=value`` for each setting
    its registry entry puts in the scope (an unset one is left out)."""
    parts = [provider.kind]
    for label, setting in provider_entry(provider.kind).cache_scope:
        value = getattr(provider, setting)
        if value:
            parts.append(f"{label}={value}")
    return " ".join(parts)


def request_key(scope: str, request: PreparedRequest) -> str:
    """The cache key of a prepared request (see the module docstring); headers never count.

    ValueError if the body is not JSON.
    """
    body = orjson.loads(request.content)
    if isinstance(body, dict):
        for name in DELIVERY_FIELDS:
            body.pop(name, None)
    digest = hashlib.sha256(scope.encode())
    digest.update(b"\n")
    digest.update(request.url.encode())
    digest.update(b"\n")
    digest.update(orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
    return digest.hexdigest()


def reusable(answer: CachedAnswer, validator: OutputValidator | None, provider: Provider) -> tuple[bool, str | None]:
    """Whether a stored answer can finish an item of this job, and the parsed JSON it finishes it with.

    A structured job checks the answer with its own validator (and parses it afresh);
    a job without a schema takes any answer with text, or a body its provider reads as
    an answer (a tool call: filed before the provider told those apart).
    """
    if validator is not None:
        try:
            return True, orjson.dumps(validator.check(answer.output).parsed).decode()
        except OutputInvalidError:
            return False, None
    if answer.output is not None:
        return True, answer.parsed
    if answer.response is None:
        return False, None
    try:
        provider.parse(answer.status_code or 200, httpx.Headers(), answer.response.encode(), latency_ms=0.0)
    except ProviderError:
        return False, None
    return True, answer.parsed
