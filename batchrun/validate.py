"""Structured output: raw model text -> parsed JSON checked against the job's schema.

Pure functions and one compiled validator per job; no I/O. What models really
return is handled — a bare JSON value, one fenced code block, one JSON object
wrapped in prose — and anything ambiguous (two objects, two fenced blocks) is
invalid, never guessed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from batchrun.errors import OutputInvalidError

_FENCE = re.compile(r"```[ \t]*(?:json|JSON|jsonc)?[ \t]*\r?\n(.*?)```", re.DOTALL)
_DECODER = json.JSONDecoder()
MAX_ERRORS = 20

# Keywords OpenAI's strict structured outputs reject (its "supported schemas" subset).
_STRICT_UNSUPPORTED = frozenset(
    {
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "patternProperties",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "uniqueItems",
    }
)


@dataclass(frozen=True)
class Verdict:
    """A valid answer: the parsed value."""

    parsed: Any


def check_schema(schema: Any) -> None:
    """Raise ValueError naming the place if ``schema`` is not a valid draft 2020-12 JSON Schema."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"expected a JSON Schema object, got {type(schema).__name__}")
    import jsonschema  # only jobs with a schema pay for it (~25 ms of start-up)

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = exc.json_path.replace("$", "schema", 1)
        raise ValueError(f"{where}: {exc.message}") from None


def strict_problem(schema: Mapping[str, Any]) -> str | None:
    """Why OpenAI strict mode cannot take this schema, or None if it can."""
    if schema.get("type") != "object":
        return "the root must be an object (type = \"object\")"

    def walk(node: Any, path: str) -> str | None:
        if isinstance(node, dict):
            for key in node:
                if key in _STRICT_UNSUPPORTED:
                    return f"{path}: keyword {key!r} is not supported in strict mode"
            if node.get("type") == "object" or "properties" in node:
                props = node.get("properties", {})
                if node.get("additionalProperties") is not False:
                    return f"{path}: objects need additionalProperties = false"
                if set(node.get("required", [])) != set(props):
                    return f"{path}: every property must be listed in required"
            for key, value in node.items():
                if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                    for name, sub in value.items():
                        found = walk(sub, f"{path}.{key}.{name}")
                        if found:
                            return found
                elif isinstance(value, (dict, list)) and key not in ("enum", "const", "default", "examples", "required"):
                    found = walk(value, f"{path}.{key}")
                    if found:
                        return found
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                found = walk(sub, f"{path}[{i}]")
                if found:
                    return found
        return None

    return walk(schema, "schema")


def extract_json(text: str) -> Any:
    """The one JSON value in a model's answer; OutputInvalidError(``not_json``) otherwise."""
    stripped = text.strip()
    if not stripped:
        raise OutputInvalidError("the answer is empty", error_class="not_json", raw=text)
    try:
        return orjson.loads(stripped)
    except orjson.JSONDecodeError:
        pass
    fences = _FENCE.findall(stripped)
    if len(fences) > 1:
        raise OutputInvalidError(
            f"the answer has {len(fences)} code blocks; expected exactly one JSON value", error_class="not_json", raw=text
        )
    if len(fences) == 1:
        try:
            return orjson.loads(fences[0].strip())
        except orjson.JSONDecodeError as exc:
            raise OutputInvalidError(
                f"the code block is not valid JSON: {exc}", error_class="not_json", raw=text
            ) from None
    objects = _objects_in_prose(stripped)
    if len(objects) == 1:
        return objects[0]
    if len(objects) > 1:
        raise OutputInvalidError(
            f"the answer holds {len(objects)} JSON objects; expected exactly one", error_class="not_json", raw=text
        )
    raise OutputInvalidError("the answer holds no JSON value", error_class="not_json", raw=text)


def _objects_in_prose(text: str) -> list[Any]:
    """Top-level JSON objects embedded in text (nested ones are part of their parent)."""
    found: list[Any] = []
    pos = text.find("{")
    while pos != -1:
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            pos = text.find("{", pos + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        pos = text.find("{", end)
    return found


class OutputValidator:
    """A job's schema, compiled once; checks each answer."""

    def __init__(self, schema: Mapping[str, Any] | bool) -> None:
        from jsonschema import Draft202012Validator  # only jobs with a schema pay for it

        self.schema = schema
        self._validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)

    def check(self, text: str | None, *, finish_reason: str | None = None, refusal: str | None = None) -> Verdict:
        """Parse and validate one answer; raise OutputInvalidError with its class and JSON paths."""
        if refusal or finish_reason == "content_filter":
            reason = refusal or "the provider's content filter stopped the answer"
            raise OutputInvalidError(f"refused: {reason}", error_class="refusal", raw=text)
        if finish_reason == "length":
            raise OutputInvalidError(
                "the answer was cut off at the token limit (finish_reason = length)", error_class="truncated", raw=text
            )
        if text is None:
            raise OutputInvalidError("the answer has no text content", error_class="not_json", raw=text)
        parsed = extract_json(text)
        return Verdict(self.validate(parsed, raw=text))

    def validate(self, parsed: Any, *, raw: str | None = None) -> Any:
        errors = sorted(self._validator.iter_errors(parsed), key=lambda e: (list(e.absolute_path), e.message))
        if not errors:
            return parsed
        listed = [{"path": e.json_path, "message": e.message} for e in errors[:MAX_ERRORS]]
        summary = "; ".join(f"{e['path']}: {e['message']}" for e in listed[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise OutputInvalidError(
            f"does not match the schema: {summary}{more}", error_class="schema_invalid", raw=raw, errors=listed
        )


def feedback(error: OutputInvalidError) -> str:
    """The follow-up message of a re-ask: what was wrong and what to send instead."""
    if error.error_class == "truncated":
        return (
            "Your previous answer was cut off at the token limit. Reply again with only the JSON value, "
            "complete and more concise."
        )
    lines = [f"Your previous answer is not valid: {error.message}."]
    if error.errors:
        lines.append("Schema violations (JSON path: problem):")
        lines += [f"- {e['path']}: {e['message']}" for e in error.errors]
    lines.append("Reply again with only a JSON value that matches the schema, with no other text.")
    return "\n".join(lines)
