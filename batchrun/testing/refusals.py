"""Client errors the fake server answers as a real provider would: a model that does not exist
(404), a parameter it does not know (400, the same for every request that carries it), and an
item-specific 400 (a prompt over the context window, its size in the message).

Deterministic, and checked after the API's own validation, before the random faults:
``FakeProviderServer(refusals=Refusals(models=frozenset({"m"})))``.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class Refusals:
    """What the server refuses; each ``None`` refuses nothing."""

    models: frozenset[str] | None = None  # the models that exist: any other is a 404 model_not_found
    unknown_param: str | None = None  # a body with this top-level key gets a 400 naming it
    # A body whose text contains this ("": every body) gets a 400 with its own token count: the
    # item-specific refusal, a different message for each request.
    over_context: str | None = None
    over_context_count: int | None = None  # the token count every such 400 names (the same message for all)

    def refuse(self, body: Mapping[str, Any]) -> tuple[int, str] | None:
        """(status, message) for a refused request, else None."""
        model = body.get("model")
        if self.models is not None and model not in self.models:
            return 404, f"The model `{model}` does not exist or you do not have access to it."
        if self.unknown_param is not None and self.unknown_param in body:
            return 400, f"Unrecognized request argument supplied: {self.unknown_param}"
        if self.over_context is not None:
            text = orjson.dumps(body).decode()
            if self.over_context in text:
                tokens = self.over_context_count or 129 + zlib.crc32(text.encode()) % 100_000
                return 400, (f"This model's maximum context length is 128 tokens. However, your messages "
                             f"resulted in {tokens} tokens. Please reduce the length of the messages.")
        return None
