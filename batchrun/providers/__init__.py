"""Providers: one module per API; nothing outside this package knows their shapes.

Each API has its module (:mod:`.openai`, :mod:`.openai_responses`, :mod:`.anthropic`)
and an entry in :mod:`batchrun.provider_registry`, which lists the kinds. :mod:`.base`
holds the :class:`Provider` protocol and the request/reply types, :mod:`.http` sends
requests, :mod:`.batch_formats` builds the batch APIs' results lines. Importing this
package does not load the HTTP stack.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.errors import SpecError
from batchrun.provider_registry import provider_entry
from batchrun.providers.base import PreparedRequest, Provider, Reply
from batchrun.redact import register_secret

if TYPE_CHECKING:
    import httpx

    from batchrun.providers.batches import BatchApi
    from batchrun.spec import JobSpec


def provider_for(spec: JobSpec, *, api_key: str | None = None, read_key: bool = True) -> Provider:
    """The provider a spec names. The API key comes only from the variable the spec names,
    and is registered for redaction the moment it is read."""
    if read_key and api_key is None:
        if spec.provider.api_key_file:
            api_key = _read_key_file(spec.provider.api_key_file)
        else:
            api_key = os.environ.get(spec.provider.api_key_env) or None
    register_secret(api_key)
    if not spec.provider.base_url:
        raise SpecError("[provider] base_url is not set (give it in the spec or with --base-url)")
    provider: Provider = provider_entry(spec.provider.kind).load()(spec, api_key)
    return provider


def _key_text(path: str) -> str:
    """A key file's content, stripped; a byte order mark (Windows editors write one) is not the key's."""
    return Path(path).read_text(encoding="utf-8-sig").strip()


def _read_key_file(path: str) -> str | None:
    """The stripped content of ``[provider] api_key_file`` (None: missing, unreadable or empty)."""
    try:
        key = _key_text(path)
    except (OSError, UnicodeDecodeError):
        return None
    register_secret(key or None)
    return key or None


def _key_file_problem(path: str) -> str | None:
    try:
        key = _key_text(path)
    except FileNotFoundError:
        return "does not exist"
    except IsADirectoryError:
        return "is a directory"
    except PermissionError:
        return "cannot be read (permission denied)"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read ({exc.__class__.__name__})"
    if not key:
        return "is empty"
    if not (key.isascii() and key.isprintable()):  # a header value: one line of printable ASCII
        return "does not hold one line of printable ASCII (a key is one line)"
    return None


def _looks_like_a_key(path: str) -> bool:
    """An ``api_key_file`` whose name is a pasted key, not a file's (it must not be printed)."""
    name = Path(path).name
    return name.startswith(("sk-", "sk_")) and len(name) > 20


def missing_api_key(spec: JobSpec, *, job_id: int | None = None) -> SpecError | None:
    """SpecError naming the key variable the spec reads and the environment lacks, or the
    ``api_key_file`` that is missing, unreadable or empty (None: the key is there, or
    ``api_key_env = ""`` says the server needs no key). Asked before anything is sent."""
    if spec.provider.api_key_file:
        problem = _key_file_problem(spec.provider.api_key_file)
        if problem is None:
            return None
        whose = f" that job {job_id} reads" if job_id is not None else ""
        if problem == "does not exist" and _looks_like_a_key(spec.provider.api_key_file):
            return SpecError(
                f"[provider] api_key_file{whose} holds what looks like a key, not a file's path; nothing was "
                "sent: write the key into a file and give its path (the value is not printed)"
            )
        return SpecError(
            f"the API key file {spec.provider.api_key_file}{whose} {problem}; nothing was sent: "
            "write the key into it (one line) and run the same command again"
        )
    name = spec.provider.api_key_env
    if not name or os.environ.get(name):
        return None
    if job_id is None:
        fix = (f'export {name}=..., or set api_key_env = "" under [provider] in '
               f"{spec.path or 'the spec'} for a server that needs no key")
        return SpecError(f"the API key variable {name} is not set; nothing was sent: {fix}")
    return SpecError(
        f"the API key variable {name} that job {job_id} reads is not set; nothing was sent: export {name}=... "
        "(any value for a server that needs no key) and run the same command again"
    )


def batch_api_for(
    spec: JobSpec, provider: Provider, *, transport: httpx.AsyncBaseTransport | None = None,
    retry_seconds: float = 300.0,
) -> BatchApi:
    """The batch API of the spec's kind, over its online ``provider`` (same base URL and key)."""
    import httpx

    timeout = httpx.Timeout(spec.run.timeout, connect=spec.run.connect_timeout)
    api: BatchApi = provider_entry(spec.provider.kind).load_batch_api()(
        provider, timeout=timeout, retry_seconds=retry_seconds, transport=transport
    )
    return api


__all__ = ["PreparedRequest", "Provider", "Reply", "batch_api_for", "missing_api_key", "provider_for"]
