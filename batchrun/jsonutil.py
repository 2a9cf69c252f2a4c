"""JSON helpers shared by the providers and export, free of the HTTP stack.

``status``, ``export`` and ``report`` must not import httpx or aiohttp: they
start in a fraction of the time a run does.
"""

from __future__ import annotations

from typing import Any

import orjson


def json_or_none(content: bytes | str) -> Any:
    """The decoded JSON value, or None if ``content`` is not JSON."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
