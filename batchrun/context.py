"""The context guard: a prompt that cannot fit in its model's context window is never sent.

A request fits when its estimated prompt plus the answer it asks room for
(``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens`` of the body;
nothing when it sets none) is at most the window. The window is
``[request] max_input_tokens`` when the spec sets it (``0``: no guard), else the
known window of the model (:data:`KNOWN_WINDOWS`, matched by the longest
prefix), else there is no guard (an unknown model, a local server's).

Ingest reads hundreds of thousands of lines a second, so the byte estimate
(``BYTES_PER_TOKEN`` bytes of request JSON a token) lets a prompt through alone
while it is at most half the room. A prompt near the limit is counted as
:mod:`batchrun.tokens` counts for the rate limiter: tiktoken's count for OpenAI
models when it is installed and has the table (``TokenCounter.wait_for`` loads it
once, waiting at most ``tokens.TABLE_WAIT_SECONDS``); without a count it is
rejected only when it cannot fit even at ``LEAST_BYTES_PER_TOKEN``.

A prompt over the window is a ``rejected`` item (error class ``context_length``)
with its size and the window in the reason. When only the provider can tell (an
unknown model, an estimate under the limit), its refusal is a ``failed`` item of
the same class: permanent, the item's own (never a job-wide refusal).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchrun import tokens
from batchrun.errors import PermanentError, ProviderError

if TYPE_CHECKING:
    from batchrun.providers.base import Provider

CONTEXT_LENGTH = "context_length"  # the error class of a prompt too long for its model
ANSWER_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# How providers say a prompt is over the window, in a 400: OpenAI's code and message, Anthropic's
# invalid_request_error messages ("prompt is too long: 210000 tokens > 200000 maximum", "input
# length and `max_tokens` exceed context limit: ...").
CONTEXT_LENGTH_CODE = "context_length_exceeded"
CONTEXT_LENGTH_PHRASES = ("maximum context length", "prompt is too long", "exceed context limit", CONTEXT_LENGTH_CODE)

# Context windows (prompt + answer, tokens) of the models batchrun knows, from the providers'
# model pages (2026-12). Matched by prefix, longest first, so dated snapshots
# ("gpt-4o-2024-08-06", "claude-sonnet-4-5-20250929") take their family's window.
KNOWN_WINDOWS: dict[str, int] = {
    # OpenAI
    "gpt-3.5-turbo": 16_385,
    "gpt-4": 8_192,
    "gpt-4-32k": 32_768,
    "gpt-4-turbo": 128_000,
    "gpt-4-1106": 128_000,  # the gpt-4 previews have gpt-4-turbo's window
    "gpt-4-0125": 128_000,
    "gpt-4-vision": 128_000,
    "gpt-4o": 128_000,
    "gpt-4o-mini": 128_000,
    "gpt-4.1": 1_047_576,  # gpt-4.1, -mini, -nano
    "gpt-4.5": 128_000,
    "gpt-5": 400_000,  # gpt-5, -mini, -nano, gpt-5.1 ...: 272k in + 128k out
    "gpt-5-chat": 128_000,
    "gpt-5.1-chat": 128_000,
    "o1": 200_000,
    "o1-mini": 128_000,
    "o1-preview": 128_000,
    "o3": 200_000,
    "o3-mini": 200_000,
    "o4-mini": 200_000,
    # Anthropic: 200k, and 1M from the 4.6 generation on
    "claude": 200_000,
    "claude-2.0": 100_000,
    "claude-instant": 100_000,
    "claude-opus-4-6": 1_000_000,
    "claude-opus-4-7": 1_000_000,
    "claude-opus-4-8": 1_000_000,
    "claude-opus-5": 1_000_000,
    "claude-sonnet-4-6": 1_000_000,
    "claude-sonnet-5": 1_000_000,
}
# Bytes of request JSON a token takes at the most (runs of one character, plain ASCII words):
# without tiktoken's count, a prompt is rejected only when it is too long even at this rate.
LEAST_BYTES_PER_TOKEN = 5
_BY_LENGTH = sorted(KNOWN_WINDOWS.items(), key=lambda kv: len(kv[0]), reverse=True)


def known_window(model: str | None) -> int | None:
    """The context window of ``model`` by its longest known prefix; None for a model not in the table."""
    if not model:
        return None
    name = _model_name(model)
    for prefix, window in _BY_LENGTH:
        if name.startswith(prefix):
            return window
    return None


@dataclass(frozen=True)
class Fit:
    """What the guard found for one request that does not fit."""

    prompt: int
    counted: bool  # with tiktoken, not from the request's size
    answer: int
    window: int
    model: str | None
    from_spec: bool  # the window is [request] max_input_tokens, not the table's

    @property
    def reason(self) -> str:
        size = f"{self.prompt:,} tokens (tiktoken)" if self.counted else f"~{self.prompt:,} tokens"
        answer = f" + max_tokens {self.answer:,}" if self.answer else ""
        if self.from_spec:
            where = f"the context window of {self.window:,} tokens ([request] max_input_tokens)"
        else:
            where = (f"the context window of {self.model} ({self.window:,} tokens; "
                     "set [request] max_input_tokens to change it)")
        return f"prompt {size}{answer} exceeds {where}"


class ContextGuard:
    """The fit check of one job's requests (see the module docstring)."""

    def __init__(self, provider: Provider, *, model: str | None, max_input_tokens: int | None) -> None:
        self.provider = provider
        self.model = model  # the spec's model, which every body carries; None: each body's own
        self.max_input_tokens = max_input_tokens
        self._rules: dict[str | None, tuple[int | None, bool]] = {}

    def window(self, model: str | None) -> int | None:
        """The window requests for ``model`` must fit in; None: no guard."""
        return self._rule(model)[0]

    def _rule(self, model: str | None) -> tuple[int | None, bool]:
        """``model``'s window and whether its answer counts against it, looked up once per model
        (not per line: ingest's hot path)."""
        if model not in self._rules:
            window = (self.max_input_tokens or None) if self.max_input_tokens is not None else known_window(model)
            self._rules[model] = (window, _answer_counts(model))
        return self._rules[model]

    def misfit(self, url: str | None, body: Mapping[str, Any], size: int, text: str) -> Fit | None:
        """None if a request fits (or there is no guard); else why not.

        ``body`` is the request body, ``text`` its JSON and ``size`` the JSON's length in bytes.
        """
        model = self.model or body.get("model")
        model = model if isinstance(model, str) else None
        window, answer_counts = self._rule(model)
        if window is None:
            return None
        estimate = size // tokens.BYTES_PER_TOKEN
        answer = answer_limit(body) if answer_counts else 0
        if 2 * estimate + answer <= window:  # far from the limit: tiktoken would not change the answer
            return None
        if model is not None:
            tokens.COUNTER.wait_for(model, timeout=tokens.TABLE_WAIT_SECONDS)
        counted = self.provider.estimate_tokens(self.provider.prepare(url, text))
        prompt = counted.prompt
        if not counted.counted:
            # Only a size to go by: a rejection is for good, so reject only what cannot fit at even
            # LEAST_BYTES_PER_TOKEN bytes a token, and without the base64 of images and documents (a
            # picture costs ~1k tokens whatever its size). The rest goes; a provider's "too long"
            # 400 (unbilled) is a context_length failure of that item.
            prompt = max(0, size - _inline_data_bytes(body)) // LEAST_BYTES_PER_TOKEN
        if prompt + answer <= window:
            return None
        return Fit(prompt, counted.counted, answer, window, model, self.max_input_tokens is not None)


def _answer_counts(model: str | None) -> bool:
    """Whether the answer's ``max_tokens`` counts against the window: Claude 3 models before 3.7
    shorten the answer to fit instead of refusing the request."""
    name = _model_name(model or "")
    return not (name.startswith("claude-3-") and not name.startswith("claude-3-7"))


def _model_name(model: str) -> str:
    """A model's own name, as the tables spell it: "openai/GPT-4o" (a gateway's) is "gpt-4o"."""
    return model.rsplit("/", 1)[-1].lower()


def _inline_data_bytes(body: object) -> int:
    """Bytes of base64 payloads (``data:`` URLs, ``"data"`` fields) in a request body."""
    if isinstance(body, Mapping):
        return sum(len(v) if k == "data" and isinstance(v, str) else _inline_data_bytes(v) for k, v in body.items())
    if isinstance(body, list):
        return sum(_inline_data_bytes(v) for v in body)
    if isinstance(body, str) and body.startswith("data:"):
        return len(body)
    return 0


def answer_limit(body: Mapping[str, Any]) -> int:
    """The answer tokens a request body asks room for; 0 when it sets no limit."""
    for key in ANSWER_LIMIT_KEYS:
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def classified(error: ProviderError, code: object = None) -> ProviderError:
    """``error`` with the class ``context_length`` when it is a provider's "prompt too long" 400
    (``code``: the error object's code, when it has one): permanent, and the item's own."""
    if isinstance(error, PermanentError) and error.status_code in (400, 413) and (
        code == CONTEXT_LENGTH_CODE or any(p in error.message.lower() for p in CONTEXT_LENGTH_PHRASES)
    ):
        error.error_class = CONTEXT_LENGTH  # type: ignore[misc]
    return error
