from __future__ import annotations

import pytest

from batchrun.errors import OutputInvalidError
from batchrun.validate import OutputValidator, check_schema, extract_json, feedback, strict_problem

SCHEMA = {
    "type": "object",
    "properties": {
        "priority": {"enum": ["low", "high"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "tier": {"type": "integer"}},
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["priority", "customer", "tags"],
    "additionalProperties": False,
}
GOOD = {"priority": "high", "customer": {"name": "Ann", "tier": 2}, "tags": ["billing"]}


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1}',
        '  {"a": 1}\n',
        '```json\n{"a": 1}\n```',
        '```\n{"a": 1}\n```',
        'Here you go:\n```json\n{"a": 1}\n```\nAnything else?',
        'Sure! The answer is {"a": 1}. Hope that helps.',
        'Result: {"a": {"nested": [1, 2, {"deep": true}]}} done',
    ],
)
def test_extract_json_accepts_what_models_return(text: str) -> None:
    value = extract_json(text)
    assert isinstance(value, dict) and "a" in value


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("no json here", "no JSON value"),
        ('{"a": 1} and also {"b": 2}', "2 JSON objects"),
        ('```json\n{"a": 1}\n```\n```json\n{"b": 2}\n```', "2 code blocks"),
        ('```json\n{"a": 1\n```', "code block is not valid JSON"),
        ('{"a": 1', "no JSON value"),
    ],
)
def test_extract_json_refuses_ambiguity(text: str, fragment: str) -> None:
    with pytest.raises(OutputInvalidError) as info:
        extract_json(text)
    assert info.value.error_class == "not_json"
    assert fragment in info.value.message
    assert info.value.raw == text


def test_validator_reports_json_paths() -> None:
    validator = OutputValidator(SCHEMA)
    assert validator.check('{"priority": "high", "customer": {"name": "Ann", "tier": 2}, "tags": ["billing"]}').parsed == GOOD
    with pytest.raises(OutputInvalidError) as info:
        validator.check('{"priority": "urgent", "customer": {"name": "Ann", "tier": "gold"}, "tags": [1]}')
    err = info.value
    assert err.error_class == "schema_invalid"
    assert [e["path"] for e in err.errors] == ["$.customer.tier", "$.priority", "$.tags[0]"]
    assert "'urgent' is not one of ['low', 'high']" in err.message


@pytest.mark.parametrize(
    ("kwargs", "error_class"),
    [
        ({"finish_reason": "length"}, "truncated"),
        ({"refusal": "I can't"}, "refusal"),
        ({"finish_reason": "content_filter"}, "refusal"),
    ],
)
def test_truncated_and_refused_are_their_own_classes(kwargs: dict[str, str], error_class: str) -> None:
    with pytest.raises(OutputInvalidError) as info:
        OutputValidator(SCHEMA).check('{"priority": "hi', **kwargs)
    assert info.value.error_class == error_class
    assert info.value.raw == '{"priority": "hi'


def test_check_schema_points_at_the_problem() -> None:
    check_schema(SCHEMA)
    with pytest.raises(ValueError, match=r"schema.properties.a.type"):
        check_schema({"type": "object", "properties": {"a": {"type": "strin"}}})
    with pytest.raises(ValueError, match="expected a JSON Schema object"):
        check_schema(["not", "a", "schema"])


def test_strict_problem() -> None:
    assert strict_problem(SCHEMA) is None
    loose = {**SCHEMA, "additionalProperties": True}
    assert "additionalProperties" in (strict_problem(loose) or "")
    partial = {**SCHEMA, "required": ["priority"]}
    assert "required" in (strict_problem(partial) or "")
    assert "root must be an object" in (strict_problem({"type": "array"}) or "")
    nested = {**SCHEMA, "properties": {**SCHEMA["properties"], "tags": {"type": "array", "uniqueItems": True}}}
    assert "uniqueItems" in (strict_problem(nested) or "")


def test_feedback_lists_paths() -> None:
    with pytest.raises(OutputInvalidError) as info:
        OutputValidator(SCHEMA).check('{"priority": "urgent", "customer": {"name": "A", "tier": 1}, "tags": []}')
    text = feedback(info.value)
    assert "- $.priority: 'urgent' is not one of ['low', 'high']" in text
    truncated = OutputInvalidError("cut", error_class="truncated")
    assert "cut off at the token limit" in feedback(truncated)
