"""The fake model: what it reads from a request and what it answers, before an API shapes it.

Answers are deterministic: ``"echo: " + the last user message``, or, for a structured request,
an instance of the schema derived from the request's key (:func:`default_key_fn`), spoiled as a
content fault says. Token counts are ``len(text) // 4 + 1`` per message (system / instructions
included) and per answer, cut to the request's max tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import orjson

REFUSAL = "I can't help with that request."
NOT_JSON = "I am not able to answer in JSON, but the ticket looks urgent."


def default_key_fn(body: dict[str, Any]) -> str | None:
    """Text of the first user message, else None.

    Chat and Messages: the first ``messages`` entry with role "user" (a string, or its text
    blocks joined); Responses: ``input`` when a string, else the first user message of the
    ``input`` list. The first, so a re-ask (which appends an assistant turn and a follow-up)
    counts against the same record.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        return _first_user_text(messages)
    inp = body.get("input")
    if isinstance(inp, str):
        return inp
    if isinstance(inp, list):
        return _first_user_text(inp)
    return None


def messages_key(body: dict[str, Any]) -> str | None:
    """:func:`default_key_fn` for Chat and Messages: the first user message's text."""
    messages = body.get("messages")
    return _first_user_text(messages) if isinstance(messages, list) else None


def _first_user_text(messages: list[Any]) -> str | None:
    for msg in messages:
        if isinstance(msg, dict) and msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = [
                    p["text"] for p in content
                    if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                    and isinstance(p.get("text"), str)
                ]
                return "".join(texts) if texts else None
            return None
    return None


def content_text(content: object) -> str:
    """Text of a message content: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def last_user_text(messages: object) -> str:
    """Text of the last user message (what a plain answer echoes), else ""."""
    if isinstance(messages, list):
        for msg in reversed(messages):
            if isinstance(msg, dict) and msg.get("role") == "user":
                return content_text(msg.get("content"))
    return ""


def has_assistant_turn(messages: object) -> bool:
    """Whether the conversation has an assistant turn: the request is a re-ask."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages
    )


def messages_tokens(messages: object) -> int:
    """Prompt tokens of a message list: ``len(text) // 4 + 1`` per message."""
    if not isinstance(messages, list):
        return 0
    return sum(
        len(content_text(m.get("content"))) // 4 + 1 for m in messages if isinstance(m, dict)
    )


def model_name(body: dict[str, Any]) -> str:
    """The model the request names, else "fake-model"."""
    model = body.get("model")
    return model if isinstance(model, str) else "fake-model"


@dataclass(slots=True)
class Answer:
    """What the fake model says, before an API gives it its shape."""

    text: str  # the answer text; for a tool call, the JSON text of its input; "" for a refusal
    tokens: int  # completion tokens reported
    truncated: bool  # stopped by the max tokens limit (or a truncated_json fault)
    refusal: str | None = None  # the model refused: this explanation instead of an answer
    tool: str | None = None  # Messages: the tool called with ``text`` as its input
    stop_sequence: str | None = None  # Messages: the stop sequence that ended ``text``


def cut(text: str, max_tokens: object, truncated: bool = False) -> Answer:
    """``text`` as an answer, cut to ``max_tokens`` (4 characters a token) when it is over."""
    tokens = len(text) // 4 + 1
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens < tokens:
        limit = max(max_tokens, 0)
        return Answer(text[: limit * 4], limit, True)
    return Answer(text, tokens, truncated)


def structured_answer(
    schema: dict[str, Any], key: str | None, fault: str | None, max_tokens: object
) -> Answer:
    """An instance of ``schema`` derived from ``key`` as JSON text, spoiled as ``fault`` says."""
    if fault == "refusal":
        return Answer("", len(REFUSAL) // 4 + 1, False, refusal=REFUSAL)
    instance = schema_instance(schema, key or "")
    if fault == "schema_violation":
        instance = violate(schema, instance)
    text = orjson.dumps(instance).decode()
    truncated = False
    if fault == "fenced":
        text = f"```json\n{text}\n```"
    elif fault == "prose":
        text = f"Sure, here is the result:\n{text}\nLet me know if you need anything else."
    elif fault == "truncated_json":
        text, truncated = text[: max(1, len(text) // 2)], True
    elif fault == "not_json":
        text = NOT_JSON
    return cut(text, max_tokens, truncated)


def json_schema_format(fmt: Any) -> dict[str, Any] | None:
    """The schema of a ``{"type": "json_schema", "schema": {...}}`` output format (Responses, Messages)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if isinstance(schema, dict):
            return schema
    return None


def schema_instance(schema: Any, key: str, depth: int = 0) -> Any:
    """A value that matches ``schema``, chosen deterministically from ``key``."""
    if not isinstance(schema, dict) or depth > 20:
        return None
    pick = zlib.crc32(key.encode()) + depth
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][pick % len(schema["enum"])]
    for combo in ("anyOf", "oneOf"):
        if combo in schema and schema[combo]:
            return schema_instance(schema[combo][0], key, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {name: schema_instance(sub, key, depth + 1) for name, sub in props.items()}
    if kind == "array":
        count = max(1, int(schema.get("minItems", 1)))
        return [schema_instance(schema.get("items", {}), key, depth + 1) for _ in range(count)]
    if kind == "string":
        text = f"echo: {key}"
        if "maxLength" in schema:
            text = text[: int(schema["maxLength"])]
        return text.ljust(int(schema.get("minLength", 0)), "x")
    if kind in ("integer", "number"):
        low, high = schema.get("minimum", 0), schema.get("maximum", 1_000_000)
        return int(low + pick % (int(high - low) + 1))
    if kind == "boolean":
        return pick % 2 == 0
    return None


def violate(schema: Any, instance: Any) -> Any:
    """``instance`` broken: a required key dropped, else a value of the wrong type."""
    if isinstance(instance, dict) and isinstance(schema, dict) and schema.get("required"):
        broken = dict(instance)
        broken.pop(schema["required"][0], None)
        return broken
    return {"unexpected": True} if not isinstance(instance, dict) else 12345

