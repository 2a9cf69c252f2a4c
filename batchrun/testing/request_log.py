"""What the fake server logs: one :class:`RequestRecord` per request it answered (online) and per
line of a provider batch it answered (batch mode)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    """One request as seen by the server, appended just before its answer goes out (a hang:
    when the client leaves); or one answered line of a provider batch, appended when the batch
    answered it (``api`` ``"batch:chat"``, ``"batch:responses"`` or ``"batch:messages"``).

    ``prompt_tokens`` / ``completion_tokens`` are the usage the answer reported (for a stream,
    what its usage event reports, even when a fault cut the stream before it).
    """

    seq: int
    received_at: float
    finished_at: float
    method: str
    path: str
    key: str | None
    outcome: str
    status: int | None
    prompt_tokens: int
    completion_tokens: int
    output_fault: str | None = None  # which content fault a structured answer carried
    api: str = "chat"  # "chat" | "responses" | "messages" | "batch:<one of them>": whose shape answered
    stream: bool = False  # the request asked for a stream
    batch_id: str | None = None  # a batch line: the provider batch that held it
    custom_id: str | None = None  # a batch line: its custom_id

    @property
    def billed(self) -> bool:
        """Whether a provider would charge for this answer: a 200 (online or inside a batch)."""
        return self.status == 200


RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))


def new_record(*values: Any) -> RequestRecord:
    """``RequestRecord(*values)``, built without the frozen dataclass's per-field
    ``object.__setattr__``: that was a tenth of the plain path's CPU per request.

    Every field up to ``stream`` must be given; the batch fields after it may be left out (an
    online request): they then read as their defaults, and the log file's JSON line (orjson
    writes a dataclass's ``__dict__``) is the one it was before batch lines existed."""
    rec: RequestRecord = object.__new__(RequestRecord)
    rec.__dict__.update(zip(RECORD_FIELDS, values))
    return rec
