"""Pydantic models as output schemas (batchrun/schemas.py): ``[output] schema = "module:Model"`` in a spec,
a class from Python, and the one-line errors naming the key when the model cannot be had."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchrun.errors import SpecError
from batchrun.schemas import is_model_ref
from batchrun.spec import JobSpec, load_spec, parse_spec

MODULE = '''
import pydantic

class Ticket(pydantic.BaseModel):
    category: str
    urgent: bool

class Outer:
    class Inner(pydantic.BaseModel):
        n: int

not_a_model = 3
'''


def spec_with(tmp_path: Path, schema: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'[provider]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
                    f'[request]\ntemplate = "{{text}}"\n[output]\nschema = "{schema}"\n')
    return path


@pytest.fixture
def models(tmp_path: Path) -> Iterator[Path]:
    """A module of models beside the spec, under a name no other test imports."""
    name = f"models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    yield tmp_path / name
    sys.modules.pop(name, None)


def test_a_reference_is_told_from_a_file_name() -> None:
    assert is_model_ref("models:Ticket") and is_model_ref("pkg.mod:Outer.Inner")
    assert not is_model_ref("triage.schema.json") and not is_model_ref("schemas/x.json") and not is_model_ref("a:b:c")


def test_a_spec_naming_a_model_beside_it_gets_its_json_schema(models: Path, tmp_path: Path) -> None:
    spec = load_spec(spec_with(tmp_path, f"{models.name}:Ticket"))
    ticket = sys.modules[models.name].Ticket
    assert spec.output.schema == ticket.model_json_schema()
    assert spec.output.schema_model == f"{models.name}:Ticket" and spec.output.schema_file is None
    assert str(tmp_path) not in sys.path  # the spec's folder was on the path for the import only
    inner = load_spec(spec_with(tmp_path, f"{models.name}:Outer.Inner"))
    assert inner.output.schema is not None and inner.output.schema["properties"] == {"n": {"title": "N", "type": "integer"}}


def test_the_same_schema_from_a_model_or_from_python_is_the_same_job(models: Path, tmp_path: Path) -> None:
    from_spec = load_spec(spec_with(tmp_path, f"{models.name}:Ticket"))
    plain = parse_spec({"provider": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
                        "request": {"template": "{text}"}}, where="test")
    given = plain.with_output_schema(sys.modules[models.name].Ticket)
    assert given.identity_hash() == from_spec.identity_hash()
    inline = plain.with_output_schema(sys.modules[models.name].Ticket.model_json_schema())
    assert inline.identity_hash() == from_spec.identity_hash() and inline.output.schema_model is None
    assert JobSpec.from_dict(given.to_dict()).output.schema_model == given.output.schema_model


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("no_such_module_xyz:Ticket", "cannot import module 'no_such_module_xyz': No module named 'no_such_module_xyz'"),
        ("{mod}:Nope", "module '{mod}' has no 'Nope'"),
        ("{mod}:not_a_model", "expected a Pydantic model class (a subclass of pydantic.BaseModel), got int"),
        ("{mod}:pydantic.BaseModel", "pydantic.main:BaseModel has no JSON Schema: model_json_schema() must be "
                                     "called on a subclass of BaseModel, not BaseModel itself."),
    ],
)
def test_a_model_that_cannot_be_had_is_one_line_naming_the_key(
    models: Path, tmp_path: Path, ref: str, problem: str
) -> None:
    ref = ref.format(mod=models.name)
    path = spec_with(tmp_path, ref)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.message == f"{path}: [output] schema = {ref!r}: {problem.format(mod=models.name)}"


def test_a_module_that_fails_to_import_is_named_with_its_error(tmp_path: Path) -> None:
    (tmp_path / "broken_models_mod.py").write_text("raise RuntimeError('boom')\n")
    path = spec_with(tmp_path, "broken_models_mod:Ticket")
    with pytest.raises(SpecError, match=r"importing module 'broken_models_mod' failed: RuntimeError: boom$"):
        load_spec(path)


def test_without_pydantic_the_error_says_which_extra_to_install(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pydantic", None)  # import pydantic now raises ImportError
    path = spec_with(tmp_path, f"{models.name}:Ticket")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.message == (
        f"{path}: [output] schema = '{models.name}:Ticket': pydantic is not installed: pip install 'batchrun[pydantic]'"
    )
    assert "\n" not in info.value.message


def test_with_output_schema_refuses_what_is_not_a_model_or_a_schema() -> None:
    plain = parse_spec({"provider": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}, where="test")

    class NotAModel:
        pass

    with pytest.raises(SpecError, match=r"^schema: expected a Pydantic model class .*, got the class NotAModel$"):
        plain.with_output_schema(NotAModel)
    with pytest.raises(SpecError, match=r"^schema: not a valid JSON Schema"):
        plain.with_output_schema({"type": "strin"})
