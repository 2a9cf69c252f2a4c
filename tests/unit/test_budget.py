"""SpendBudget on its own: reserve, settle, wait in line, stop; the settle rule; spec checks."""

from __future__ import annotations

import asyncio
import math

import pytest

from batchrun.budget import SpendBudget, budget_price, settled_cost, worst_case_rate
from batchrun.errors import BudgetExceededError, RateLimitedError, RetryableError, SpecError
from batchrun.pricing import Price
from batchrun.providers import Reply
from batchrun.spec import Overrides, parse_spec

# $1 per token at the worst-case rate: amounts below read as token counts.
PRICE = Price(input=250_000.0, output=1_000_000.0, cached_input=100_000.0)


def reply(input_tokens: int | None, output_tokens: int | None) -> Reply:
    return Reply(200, "{}", "ok", "stop", input_tokens, output_tokens, None)


def test_worst_case_prices_every_token_at_the_highest_rate() -> None:
    assert worst_case_rate(Price(2.0, 8.0, 0.5)) == 8.0
    assert worst_case_rate(Price(3.0, 1.0, 4.0)) == 4.0  # an odd cached rate above the others still bounds
    assert SpendBudget(10.0, Price(2.0, 8.0)).worst_case(1000) == pytest.approx(0.008)


def test_settle_rule() -> None:
    held = 5.0
    assert settled_cost(held, reply(10, 20), 0.7, None) == 0.7  # usage known: the real cost
    assert settled_cost(held, reply(None, None), 0.0, None) == held  # billed, usage unknown: worst case
    assert settled_cost(held, None, None, RetryableError("HTTP 500", status_code=500)) == 0.0
    assert settled_cost(held, None, None, RateLimitedError("HTTP 429", status_code=429)) == 0.0
    assert settled_cost(held, None, None, RetryableError("timed out", error_class="timeout")) == held
    assert settled_cost(held, None, None, RetryableError("reset", error_class="connection")) == held
    broken = RetryableError("cut short", status_code=200, error_class="truncated_body")
    assert settled_cost(held, None, None, broken) == held  # a 2xx whose body broke was produced and billed


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_reserve_settle_and_stop_at_the_cap() -> None:
    async def go() -> None:
        budget = SpendBudget(10.0, PRICE, spent_usd=2.0)
        a = await budget.reserve(5)
        assert a == 5.0 and budget.reserved == 5.0 and budget.remaining == pytest.approx(3.0)
        budget.settle(a, 1.5)
        assert budget.spent == 3.5 and budget.reserved == 0.0
        b = await budget.reserve(6)
        assert b is not None
        budget.release(b)
        assert budget.spent == 3.5
        with pytest.raises(BudgetExceededError, match=r"budget of \$10.00 reached: \$3.50 spent.*up to \$7.00"):
            await budget.reserve(7)  # 3.5 + 7 > 10 even with nothing in flight
        assert budget.reserved == 0.0

    run(go())


def test_a_request_that_fits_once_others_settle_waits_for_them() -> None:
    async def go() -> None:
        budget = SpendBudget(10.0, PRICE)
        first = await budget.reserve(6)
        assert first is not None
        waiting = asyncio.create_task(budget.reserve(6))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 6 + 6 > 10 while the first is in flight
        budget.settle(first, 1.0)  # the first cost far less than its worst case
        assert await asyncio.wait_for(waiting, 1) == 6.0
        assert budget.spent == 1.0 and budget.reserved == 6.0

    run(go())


def test_waiters_are_served_in_order_and_stop_wakes_them() -> None:
    async def go() -> None:
        budget = SpendBudget(10.0, PRICE)
        first = await budget.reserve(8)
        assert first is not None
        big = asyncio.create_task(budget.reserve(7))
        await asyncio.sleep(0)
        small = asyncio.create_task(budget.reserve(1))
        await asyncio.sleep(0.01)
        # The small one would fit now (8 + 1 <= 10) but waits behind the big one.
        assert not big.done() and not small.done()
        budget.settle(first, 1.0)  # spent 1: the big one (7) fits, then the small one (1)
        assert await asyncio.wait_for(big, 1) == 7.0
        assert await asyncio.wait_for(small, 1) == 1.0
        third = asyncio.create_task(budget.reserve(1))
        await asyncio.sleep(0.01)
        assert not third.done()  # 1 + 8 + 1 is exactly the budget; admission keeps a rounding margin
        budget.stop()
        assert await asyncio.wait_for(third, 1) is None
        assert await budget.reserve(0) is None  # stopping: nothing more is held

    run(go())


def test_a_waiter_that_can_never_fit_raises_when_woken() -> None:
    async def go() -> None:
        budget = SpendBudget(10.0, PRICE)
        first = await budget.reserve(6)
        assert first is not None
        waiting = asyncio.create_task(budget.reserve(6))
        await asyncio.sleep(0.01)
        budget.settle(first, 6.0)  # the first really cost its worst case: 6 + 6 > 10 for good
        with pytest.raises(BudgetExceededError):
            await asyncio.wait_for(waiting, 1)

    run(go())


BASE = {"provider": {"base_url": "http://127.0.0.1:9/v1", "model": "gpt-4o-mini"}}


def test_budget_in_the_spec_and_on_the_command_line() -> None:
    spec = parse_spec({**BASE, "run": {"budget_usd": 12.5}}, where="job.toml")
    assert spec.run.budget_usd == 12.5
    assert budget_price(spec) == Price(0.15, 0.60, 0.075)
    assert spec.with_overrides(Overrides(budget_usd=40)).run.budget_usd == 40
    assert parse_spec(BASE, where="job.toml").run.budget_usd == 0.0  # no budget
    assert budget_price(parse_spec(BASE, where="job.toml")) is None
    assert "budget_usd" not in str(spec.identity_hash())  # [run] does not change what is sent
    assert spec.identity_hash() == parse_spec(BASE, where="job.toml").identity_hash()


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan])
def test_budget_must_be_a_positive_finite_total(value: float) -> None:
    with pytest.raises(SpecError, match=r"job.toml: \[run\] budget_usd = .*expected (a total in USD > 0|a finite number)"):
        parse_spec({**BASE, "run": {"budget_usd": value}}, where="job.toml")
    with pytest.raises(SpecError, match=r"--budget-usd = .*: expected a total in USD > 0"):
        parse_spec(BASE, where="job.toml").with_overrides(Overrides(budget_usd=value))


def test_budget_without_a_price_is_a_spec_error() -> None:
    unknown = {"provider": {"base_url": "http://127.0.0.1:9/v1", "model": "my-local-model"}, "run": {"budget_usd": 5}}
    with pytest.raises(SpecError, match=r"model 'my-local-model' has no built-in list price: add a \[pricing\] table"):
        budget_price(parse_spec(unknown, where="job.toml"))
    priced = parse_spec({**unknown, "pricing": {"input_per_million": 1, "output_per_million": 2}}, where="job.toml")
    assert budget_price(priced) == Price(1.0, 2.0, None)
    free = parse_spec({**unknown, "pricing": {"input_per_million": 0, "output_per_million": 0}}, where="job.toml")
    with pytest.raises(SpecError, match="makes every token free"):
        budget_price(free)
    no_model = parse_spec({"provider": {"base_url": "http://127.0.0.1:9/v1"}, "run": {"budget_usd": 5}}, where="cli")
    with pytest.raises(SpecError, match="names no model.*or pass --model"):
        budget_price(no_model)


def test_usd_shows_enough_digits_for_the_figures_to_add_up() -> None:
    from batchrun.budget import usd

    assert usd(1234.5) == "$1,234.50"
    assert usd(0.5) == "$0.5000"
    assert usd(0.00191) == "$0.001910"
