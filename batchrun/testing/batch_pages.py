"""Cursor pagination of the batch APIs' lists: ``data``, ``first_id``, ``last_id``, ``has_more``,
a page after an id (OpenAI ``after``, Anthropic ``after_id``) or before one (Anthropic
``before_id``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class Page(Generic[T]):
    """One page of a list, and whether more lie beyond it in the direction asked."""

    ids: list[str]
    items: list[T]
    has_more: bool

    def render(self, to_api: Callable[[T], dict[str, Any]]) -> dict[str, Any]:
        return {"data": [to_api(x) for x in self.items],
                "first_id": self.ids[0] if self.ids else None,
                "last_id": self.ids[-1] if self.ids else None, "has_more": self.has_more}


def cursor_page(ids: list[str], items: list[T], limit: int, after: str | None = None,
                before: str | None = None) -> Page[T]:
    """The ``limit`` items right after the one ``after`` names (or right before ``before``),
    else the first ``limit``; a cursor naming no item gives an empty page."""
    if after is not None or before is not None:
        try:
            at = ids.index(after if after is not None else before)  # type: ignore[arg-type]
        except ValueError:
            return Page([], [], False)
        if after is None:
            start = max(at - limit, 0)
            return Page(ids[start:at], items[start:at], start > 0)
        start = at + 1
    else:
        start = 0
    stop = start + limit
    return Page(ids[start:stop], items[start:stop], stop < len(ids))
