"""What requests cost: per-million-token prices by model, overridable in the spec."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Price:
    """USD per million tokens."""

    input: float
    output: float
    cached_input: float | None = None

    def scaled(self, factor: float) -> Price:
        """Every rate times ``factor`` (the batch discount)."""
        return Price(
            self.input * factor, self.output * factor,
            None if self.cached_input is None else self.cached_input * factor,
        )

    def cost(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        """USD for one attempt; cached input tokens are billed at the cached rate when there is one."""
        cached = min(cached_tokens, input_tokens) if self.cached_input is not None else 0
        rate_cached = self.cached_input if self.cached_input is not None else self.input
        return ((input_tokens - cached) * self.input + cached * rate_cached + output_tokens * self.output) / 1e6


# List prices as the providers published them (standard tier, USD per 1M tokens). Prices
# change: a spec's [pricing] table wins, and a model missing here is costed at 0 until given one.
KNOWN_PRICES: dict[str, Price] = {
    "gpt-4o-mini": Price(0.15, 0.60, 0.075),
    "gpt-4o": Price(2.50, 10.00, 1.25),
    "gpt-4.1": Price(2.00, 8.00, 0.50),
    "gpt-4.1-mini": Price(0.40, 1.60, 0.10),
    "gpt-4.1-nano": Price(0.10, 0.40, 0.025),
    "o3-mini": Price(1.10, 4.40, 0.55),
    "o4-mini": Price(1.10, 4.40, 0.275),
    "claude-3-5-haiku": Price(0.80, 4.00, 0.08),
    "claude-3-7-sonnet": Price(3.00, 15.00, 0.30),
    "claude-sonnet-4": Price(3.00, 15.00, 0.30),
    "claude-opus-4": Price(15.00, 75.00, 1.50),
}


def price_for(model: str | None, override: Price | None = None) -> Price | None:
    """The spec's price if it set one, else the known list price of ``model`` (dated suffixes match)."""
    if override is not None:
        return override
    if not model:
        return None
    if model in KNOWN_PRICES:
        return KNOWN_PRICES[model]
    # "gpt-4o-mini-2024-07-18" -> "gpt-4o-mini": the longest known name the model starts with.
    matches = [name for name in KNOWN_PRICES if model.startswith(name + "-")]
    return KNOWN_PRICES[max(matches, key=len)] if matches else None
