from __future__ import annotations

import pytest

from batchrun.errors import SpecError
from batchrun.pricing import Price, price_for
from batchrun.spec import parse_spec


def test_known_models_and_dated_names() -> None:
    assert price_for("gpt-4o-mini") == Price(0.15, 0.60, 0.075)
    assert price_for("gpt-4o-mini-2024-07-18") == Price(0.15, 0.60, 0.075)  # not gpt-4o's price
    assert price_for("gpt-4o-2024-08-06") == Price(2.50, 10.00, 1.25)
    assert price_for("my-local-model") is None
    assert price_for(None) is None


def test_cost_bills_cached_input_at_its_rate() -> None:
    price = Price(input=2.0, output=8.0, cached_input=0.5)
    assert price.cost(1_000_000, 0) == pytest.approx(2.0)
    assert price.cost(1_000_000, 500_000, cached_tokens=400_000) == pytest.approx(0.6 * 2.0 + 0.4 * 0.5 + 4.0)
    assert Price(1.0, 1.0).cost(100, 0, cached_tokens=100) == pytest.approx(100 / 1e6)


def test_spec_pricing_overrides_the_list_price() -> None:
    base = {"provider": {"base_url": "http://127.0.0.1:1", "model": "gpt-4o-mini"}}
    assert parse_spec(base, where="t").price() == Price(0.15, 0.60, 0.075)
    custom = parse_spec({**base, "pricing": {"output_per_million": 1.0}}, where="t").price()
    assert custom == Price(0.15, 1.0, 0.075)
    unknown = parse_spec({"provider": {"base_url": "http://127.0.0.1:1", "model": "x"}, "pricing": {"input_per_million": 3}}, where="t")
    assert unknown.price() == Price(3.0, 0.0, None)
    with pytest.raises(SpecError, match=r"\[pricing\] input_per_million = -1: expected a price >= 0"):
        parse_spec({**base, "pricing": {"input_per_million": -1}}, where="t")
