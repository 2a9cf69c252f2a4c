"""Pydantic models as output schemas (the ``pydantic`` extra).

A job's schema can be a model: ``[output] schema = "package.module:Model"`` in a spec, or the
class itself from Python (``submit(..., schema=Model)``, :meth:`JobSpec.with_output_schema`).
Its ``model_json_schema()`` is then the job's JSON Schema, sent with each request and checked
on every answer exactly as a schema file would be; the model's reference (``module:QualName``)
is stored with the job, so that its results come back in Python as instances of the model
(:func:`batchrun.results`), while files hold their JSON.

A reference is imported with the spec's folder (and the current folder) on ``sys.path``, as
``uvicorn app:app`` finds its app; a class given from Python is also remembered by reference
for the life of the process, so a model defined in a notebook or a function is found again.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODEL_REF = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
INSTALL = "pip install 'batchrun[pydantic]'"
_GIVEN: dict[str, type] = {}  # the classes given from Python in this process, by reference


class ModelError(ValueError):
    """Why a reference or an object is not a usable model (the caller names the key or argument)."""


def is_model_ref(text: str) -> bool:
    """Whether an ``[output] schema`` value names a model (``module:Model``) rather than a schema file."""
    return MODEL_REF.fullmatch(text) is not None


def model_ref(model: type) -> str:
    """``module:QualName`` of a model class."""
    return f"{model.__module__}:{model.__qualname__}"


def check_model(model: object) -> type:
    """``model`` if it is a Pydantic model class; ModelError saying what it is otherwise."""
    pydantic = _pydantic()
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        kind = f"the class {model.__name__}" if isinstance(model, type) else type(model).__name__
        raise ModelError(f"expected a Pydantic model class (a subclass of pydantic.BaseModel), got {kind}")
    return model


def model_schema(model: type) -> dict[str, Any]:
    """The model's JSON Schema (``model_json_schema()``); ModelError if Pydantic cannot make one."""
    try:
        schema: dict[str, Any] = model.model_json_schema()  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 (Pydantic raises several kinds for a model it cannot describe)
        raise ModelError(f"{model_ref(model)} has no JSON Schema: {exc}") from None
    return schema


def remember(model: type) -> str:
    """Note a class given from Python, so its reference finds it in this process; its reference."""
    ref = model_ref(model)
    _GIVEN[ref] = model
    return ref


def import_model(ref: str, search: Sequence[Path] = ()) -> type:
    """The model class ``module:QualName`` names: one given from Python in this process, else imported,
    with ``search`` folders (and the current folder) on ``sys.path`` meanwhile. ModelError in one line."""
    if ref in _GIVEN:
        return _GIVEN[ref]
    _pydantic()
    module_name, _, qualname = ref.partition(":")
    added = [str(folder) for folder in [*search, Path.cwd()] if str(folder) not in sys.path]
    sys.path[:0] = added
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == "pydantic":
            raise ModelError(f"pydantic is not installed: {INSTALL}") from None
        raise ModelError(f"cannot import module {module_name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (the user's module may raise anything as it loads)
        raise ModelError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    finally:
        for folder in added:
            sys.path.remove(folder)
    value: Any = module
    for part in qualname.split("."):
        if not hasattr(value, part):
            raise ModelError(f"module {module_name!r} has no {qualname!r}")
        value = getattr(value, part)
    return check_model(value)


def instance(model: type, value: Any) -> Any:
    """``value`` (a validated answer) as an instance of ``model``; ModelError with Pydantic's reason if it is not one."""
    pydantic = _pydantic()
    try:
        return model.model_validate(value)  # type: ignore[attr-defined]
    except pydantic.ValidationError as exc:
        raise ModelError(str(exc).replace("\n", "; ")) from None


def as_json(value: Any) -> Any:
    """A model instance as its JSON value (``model_dump(mode="json")``); anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) and not isinstance(value, type) else value


def _pydantic() -> Any:
    try:
        import pydantic
    except ImportError:
        raise ModelError(f"pydantic is not installed: {INSTALL}") from None
    return pydantic
