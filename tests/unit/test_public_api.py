"""``from batchrun import ...``: a sorted ``__all__`` whose names all resolve, and whose exceptions are
exactly the tree drawn in errors.py's docstring, parent for parent."""

from __future__ import annotations

import re

import pytest

import batchrun
from batchrun import errors


def drawn_tree() -> dict[str, str | None]:
    """Each exception class of the drawing in errors.py's docstring, with its parent (None for the root)."""
    drawing = errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    path: list[str] = []
    for line in drawing.splitlines():
        found = re.match(r"^(?P<branch>[ │├└─]*)(?P<name>[A-Z]\w*Error)\b", line)
        if not found:
            continue
        depth = (len(found["branch"]) - 4) // 4
        del path[depth:]
        parents[found["name"]] = path[-1] if path else None
        path.append(found["name"])
    return parents


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert batchrun.__all__ == sorted(batchrun.__all__)
    assert len(set(batchrun.__all__)) == len(batchrun.__all__)
    for name in batchrun.__all__:
        assert getattr(batchrun, name) is not None, name
    assert set(batchrun.__all__) <= set(dir(batchrun))


def test_a_library_user_finds_what_a_job_needs() -> None:
    for name in ("Ledger", "load_spec", "JobSpec", "Overrides", "submit", "submit_async", "resume", "resume_async",
                 "export_job", "job_status", "list_jobs", "SubmitResult", "ItemState", "StopReason", "ExitCode"):
        assert name in batchrun.__all__, name
    from batchrun.submission import submit

    assert batchrun.submit is submit


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        batchrun.nothing_here  # noqa: B018


def test_the_drawn_exception_tree_is_the_exported_one() -> None:
    tree = drawn_tree()
    assert tree["BatchrunError"] is None and tree["LockLostError"] == "JobLockedError"  # the drawing was read
    defined = {
        name: cls for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    }
    exported = {name for name in batchrun.__all__ if isinstance(getattr(batchrun, name), type)
                and issubclass(getattr(batchrun, name), BaseException)}
    assert set(tree) == set(defined) == exported
    for name, cls in defined.items():
        parent = tree[name]
        assert (cls.__mro__[1].__name__ if parent is not None else None) == parent, name
