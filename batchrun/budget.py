"""Spend budgets: a job's total cap in USD that holds with many requests in flight.

Every request reserves its worst case before it is sent and settles to what it
really cost once the answer is in, so requests in flight can never spend more
than is left together:

- **worst case** = the provider's token estimate of the request (prompt
  estimate + its answer limit, ``max_tokens``) priced at the job's highest
  per-million rate (input, output or cached input). Pricing the prompt at the
  output rate is what makes this an upper bound although the prompt side is an
  estimate (~4 bytes of request JSON per token).
- **settled** to the cost from ``usage`` when the answer has one; to 0 for an
  error answer (a 4xx/5xx status: providers do not bill those); and kept at the
  worst case when the fate is unknown — a timeout, a dropped connection, a 2xx
  with a broken body or without ``usage`` — because the provider may have
  billed it.

A request is sent only if ``spent + reserved + its worst case <= budget``. If
it does not fit but would once the requests in flight settle, it waits for
them; if it cannot fit even then (``spent + worst case > budget``), the run
stops: :class:`~batchrun.errors.BudgetExceededError`, exit 4, the rest stays
pending for ``resume --budget-usd MORE``.

"Spent" starts from the ledger (the sum of the job's attempts' ``cost_usd``).
What the worst-case rule kept for unknown fates lives only in the run that
sent them: a later run starts again from the ledger's figure.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from batchrun.errors import BudgetExceededError, ProviderError, SpecError
from batchrun.pricing import Price
from batchrun.provider_registry import MAX_TOKENS_PARAMS
from batchrun.spec import JobSpec

if TYPE_CHECKING:  # status and report import this module: keep the HTTP stack (and asyncio, ~30 ms) out of their start-up
    import asyncio

    from batchrun.providers import Reply

# Admission keeps this share of the budget unused, so float rounding (our running total
# against the ledger's SUM, added in another order) can never tip a total over the cap.
ROUNDING_MARGIN = 1e-9


def usd(amount: float) -> str:
    """Dollars for messages: cents from a dollar up, then four decimals, six below a cent (so figures add up)."""
    if abs(amount) >= 1:
        return f"${amount:,.2f}"
    return f"${amount:.4f}" if abs(amount) >= 0.01 else f"${amount:.6f}"


def worst_case_rate(price: Price) -> float:
    """USD per million tokens that bounds any token of a request: the highest of the job's rates."""
    return max(price.input, price.output, price.cached_input or 0.0)


def budget_price(spec: JobSpec) -> Price | None:
    """The job's price if it has a budget; SpecError (exit 2, before anything is sent) if that price is unknown."""
    if spec.run.budget_usd <= 0:
        return None
    price = spec.price()
    if price is None:
        model = spec.provider.model
        what = f"model {model!r} has no built-in list price" if model else "the job names no model (each input line does)"
        raise SpecError(
            f"{spec.path or 'spec'}: a budget needs a price, and {what}: add a [pricing] table "
            "(input_per_million, output_per_million) to the spec"
            + ("" if model else ", or pass --model")
        )
    if worst_case_rate(price) <= 0:
        raise SpecError(
            f"{spec.path or 'spec'}: a budget needs a price, and [pricing] makes every token free: "
            "set input_per_million and output_per_million"
        )
    return price


def unbounded_answers(spec: JobSpec) -> bool:
    """True when a template job's requests set no answer limit, so no worst case is a real bound."""
    extra = spec.request.extra
    return (
        spec.has_template
        and spec.request.max_tokens is None
        and not any(key in extra for key in MAX_TOKENS_PARAMS)
    )


def settled_cost(reserved: float, reply: Reply | None, cost: float | None, error: ProviderError | None) -> float:
    """What one sent request counts against the budget once its fate is known (see the module docstring)."""
    if reply is not None:
        if reply.input_tokens is None and reply.output_tokens is None:
            return reserved  # answered (and billed) without usage: keep the worst case
        return cost or 0.0
    if error is not None and error.status_code is not None and not 200 <= error.status_code < 300:
        return 0.0  # an error answer is not billed
    return reserved  # timeout, dropped connection, broken 2xx body: it may have been billed


def budget_status(spec: JobSpec, spent_usd: float) -> dict[str, Any] | None:
    """The ``budget`` object of ``status --json`` (None when the job has no budget)."""
    limit = spec.run.budget_usd
    if limit <= 0:
        return None
    return {
        "limit_usd": limit,
        "spent_usd": round(spent_usd, 6),
        "remaining_usd": round(max(0.0, limit - spent_usd), 6),
    }


class SpendBudget:
    """The budget of one run: reserve a request's worst case before sending, settle it after.

    Used from one event loop (no locks: nothing awaits between a check and its
    update). Requests that do not fit yet wait in line (first come, first served)
    for the requests in flight to settle.
    """

    def __init__(self, limit_usd: float, price: Price, *, spent_usd: float = 0.0) -> None:
        self.limit = limit_usd
        self.rate = worst_case_rate(price)  # USD per million tokens
        self.spent = spent_usd
        self.reserved = 0.0
        self._open = 0  # reservations not settled yet
        self._usable = limit_usd * (1.0 - ROUNDING_MARGIN)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._stopped = False

    @property
    def remaining(self) -> float:
        return max(0.0, self.limit - self.spent - self.reserved)

    def worst_case(self, tokens: int) -> float:
        """USD a request estimated at ``tokens`` (prompt + answer limit) may cost at most."""
        return tokens * self.rate / 1e6

    async def reserve(self, tokens: int) -> float | None:
        """Hold the worst case of a request of ``tokens``; returns the USD held, None if the run is stopping.

        Waits while requests in flight hold what it needs; raises
        BudgetExceededError when it cannot fit even once they have settled.
        """
        amount = self.worst_case(tokens)
        queued = False
        while True:
            if self._stopped:
                return None
            if self.spent + amount > self._usable:
                raise BudgetExceededError(
                    f"budget of {usd(self.limit)} reached: {usd(self.spent)} spent, and the next request may "
                    f"cost up to {usd(amount)} ({tokens} tokens — prompt estimate + max_tokens — at "
                    f"${self.rate:g} per million); requests in flight finish, the rest stay pending"
                )
            # Someone already waiting goes first: a big request is not overtaken forever by small ones.
            if (queued or not self._waiters) and self.spent + self.reserved + amount <= self._usable:
                self.reserved += amount
                self._open += 1
                self._wake()  # the next in line may fit as well
                return amount
            import asyncio  # here: status imports this module for budget_status, and starts without asyncio

            waiter = asyncio.get_running_loop().create_future()
            if queued:
                self._waiters.appendleft(waiter)  # keep its place at the head of the line
            else:
                self._waiters.append(waiter)
            queued = True
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                else:
                    self._wake()  # it was woken: pass the wake-up on
                raise

    def settle(self, held: float, cost: float) -> None:
        """A request that held ``held`` USD cost ``cost`` (see :func:`settled_cost`)."""
        self._open -= 1
        # Float sums drift: with nothing in flight nothing is reserved, exactly.
        self.reserved = self.reserved - held if self._open > 0 else 0.0
        self.spent += cost
        self._wake()

    def release(self, held: float) -> None:
        """A reservation whose request was never sent."""
        self.settle(held, 0.0)

    def stop(self) -> None:
        """The run is stopping: every waiter (and every later reserve) gets None."""
        self._stopped = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
