"""Spend budgets against the real fault-injecting server: no overshoot at concurrency 64, resume with more."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun.errors import SpecError
from batchrun.jobs import RunSummary, prepare_job, run_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.scheduler import RunOptions
from batchrun.spec import JobSpec, Overrides, parse_spec
from batchrun.testing import FakeProviderServer, Faults, RequestRecord
from batchrun.states import ExitCode, ItemState

FAST = RunOptions(backoff_initial=0.01, backoff_max=0.05, flush_interval=0.05)
IN, OUT = 1000.0, 2000.0  # USD per million tokens: large, so one request costs cents and sums read easily
MAX_TOKENS = 60


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=1)) as srv:
        yield srv


def job_spec(server: FakeProviderServer, **run: Any) -> JobSpec:
    return parse_spec(
        {
            "provider": {"base_url": server.base_url, "model": "m"},
            "request": {"template": "{text}", "max_tokens": MAX_TOKENS},
            "pricing": {"input_per_million": IN, "output_per_million": OUT},
            "run": run,
        },
        where="test",
    )


def records(n: int, seed: int = 5) -> list[dict[str, object]]:
    """Distinct texts of varied length: answers from 27 tokens to the 60-token limit (the server echoes)."""
    rng = random.Random(seed)
    return [{"id": f"r{i}", "text": f"{i:04d}" + "x" * rng.randint(100, 300)} for i in range(n)]


def worst_case(text: str) -> float:
    """USD a request may cost by the documented rule: (request bytes / 4 + max_tokens) at the highest rate."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS}
    return (len(orjson.dumps(body)) // 4 + MAX_TOKENS) * max(IN, OUT) / 1e6


def cost(text: str) -> float:
    """USD of a clean answer from the test server: it echoes, and counts ~4 characters per token."""
    return ((len(text) // 4 + 1) * IN + min(MAX_TOKENS, len("echo: " + text) // 4 + 1) * OUT) / 1e6


def echo(text: str) -> str:
    """The test server's answer: the prompt echoed, cut at max_tokens (~4 characters a token)."""
    answer = "echo: " + text
    return answer if len(answer) // 4 + 1 <= MAX_TOKENS else answer[: MAX_TOKENS * 4]


def billed_by_server(log: list[RequestRecord]) -> float:
    """What the provider would bill, from its own log: every answer it produced (a 200), error answers free."""
    return sum(r.prompt_tokens * IN + r.completion_tokens * OUT for r in log if r.status == 200) / 1e6


def max_overlap(log: list[RequestRecord]) -> int:
    events = sorted([(r.received_at, 1) for r in log] + [(r.finished_at, -1) for r in log])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def run(ledger: Ledger, job_id: int, **over: Any) -> RunSummary:
    return asyncio.run(run_job(ledger, job_id, overrides=Overrides(**over), options=FAST))


@pytest.mark.slow
def test_budget_holds_at_concurrency_64_and_resume_with_more_finishes(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    n = 600
    # 500s (not billed: settle to 0) and truncated 200s (billed, usage unknown: kept at the worst case).
    server.faults = Faults(latency_s=0.05, latency_jitter_s=0.02, p_500=0.05, p_truncated=0.03, seed=11)
    lines = records(n)
    budget = round(sum(cost(str(r["text"])) for r in lines) * 0.4, 2)  # the cap falls mid-job
    job_id = prepare_job(ledger, job_spec(server, concurrency=64, max_attempts=10), write_jsonl(lines)).job_id

    first = run(ledger, job_id, budget_usd=budget)

    assert first.exit_code == ExitCode.BUDGET and first.result.stop_reason == "budget"
    assert "budget of" in (first.result.stop_message or "")
    # really ran wide (dozens of reservations at once, not a trickle); how close to 64 the
    # slow start gets before the cap depends on the machine's load
    assert max_overlap(server.log) >= 32
    spent = LedgerQueries(ledger.engine).spent_usd(job_id)
    assert spent <= budget  # the ledger's cost of every attempt
    assert billed_by_server(server.log) <= budget  # and the provider's own count, truncated answers included
    assert spent >= budget * 0.75  # and the budget was used, not given up at the first crowd in flight
    counts = first.counts
    assert counts[ItemState.RUNNING] == counts[ItemState.FAILED] == 0
    assert counts[ItemState.SUCCEEDED] + counts[ItemState.PENDING] == n
    assert 0 < counts[ItemState.SUCCEEDED] < n
    unfinished = [r for r in LedgerQueries(ledger.engine).iter_items(job_id) if r.state != ItemState.SUCCEEDED]
    assert all(r.state == ItemState.PENDING and r.output is None for r in unfinished)
    answered = set(server.ok_by_key())
    before = len(server.log)

    second = run(ledger, job_id, budget_usd=budget * 10)

    assert second.exit_code == ExitCode.OK, second.counts
    assert second.counts[ItemState.SUCCEEDED] == n
    assert max(server.ok_by_key().values()) == 1  # no item was answered (cleanly) twice
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id))
    assert len({r.custom_id for r in rows}) == n
    assert [r.output for r in rows] == [echo(str(line["text"])) for line in lines]
    assert not [r for r in server.log[before:] if r.key in answered]  # resume sent only what was left
    assert LedgerQueries(ledger.engine).spent_usd(job_id) <= budget * 10


def test_budget_is_used_to_the_last_request_that_fits(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(latency_s=0.02)
    texts = [f"{i:04d}" + "y" * 196 for i in range(300)]  # all 200 characters: one price per answer
    job_id = prepare_job(ledger, job_spec(server, concurrency=64), write_jsonl([{"text": t} for t in texts])).job_id
    budget = 5.0
    assert cost(texts[0]) == pytest.approx(0.155) and worst_case(texts[0]) == pytest.approx(0.254)

    summary = run(ledger, job_id, budget_usd=budget)

    assert summary.exit_code == ExitCode.BUDGET
    spent = LedgerQueries(ledger.engine).spent_usd(job_id)
    assert spent == pytest.approx(billed_by_server(server.log))  # every request answered cleanly and recorded
    # Requests that do not fit while others are in flight wait for them to settle; the run stops only when
    # the next one cannot fit with nothing in flight: less than one worst case is left unused.
    assert budget - worst_case(texts[0]) < spent <= budget
    assert summary.counts[ItemState.SUCCEEDED] == len(server.log) in (31, 32)  # 31 x 0.155 = 4.805 > 5 - 0.254


def test_a_spent_budget_sends_nothing_until_it_is_raised(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = prepare_job(ledger, job_spec(server, concurrency=8, budget_usd=0.5), write_jsonl(records(40))).job_id
    first = run(ledger, job_id)  # the spec's own budget
    assert first.exit_code == ExitCode.BUDGET
    sent = len(server.log)
    assert 0 < sent < 40
    again = run(ledger, job_id)  # same budget: stops before sending anything
    assert again.exit_code == ExitCode.BUDGET
    assert len(server.log) == sent
    assert again.counts == first.counts
    more = run(ledger, job_id, budget_usd=100)
    assert more.exit_code == ExitCode.OK
    assert len(server.log) == 40


def test_error_answers_are_free_and_timeouts_count_at_their_worst_case(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    spec = job_spec(server, concurrency=4, max_attempts=3)
    lines = [{"id": f"r{i}", "text": f"{i}" + "x" * 99} for i in range(5)]
    budget = worst_case(str(lines[0]["text"])) * 2.5  # room for two worst cases, not three
    server.faults = Faults(status_override=500)
    job_id = prepare_job(ledger, spec, write_jsonl(lines)).job_id
    failing = run(ledger, job_id, budget_usd=budget)
    assert failing.exit_code == ExitCode.SOME_FAILED  # 15 error answers, none billed: never stopped by the budget
    assert len(server.log) == 15 and failing.counts[ItemState.FAILED] == 5

    server.faults = Faults(p_hang=1.0)
    server.reset_log()
    job_id = prepare_job(ledger, spec, write_jsonl(lines, "hang.jsonl"), new=True).job_id
    hanging = run(ledger, job_id, budget_usd=budget, timeout=0.2)
    # A timed-out request may have been billed: each keeps its worst case, so only two are ever sent.
    assert hanging.exit_code == ExitCode.BUDGET
    time.sleep(0.3)  # the server logs a hung request when the client drops the connection
    assert len(server.log) == 2
    assert hanging.counts[ItemState.PENDING] == 5


def test_a_budget_without_a_price_sends_nothing(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    unpriced = parse_spec(
        {"provider": {"base_url": server.base_url, "model": "my-model"}, "request": {"template": "{text}"}},
        where="job.toml",
    )
    path = write_jsonl(records(3))
    with pytest.raises(SpecError, match=r"model 'my-model' has no built-in list price"):
        prepare_job(ledger, unpriced.with_overrides(Overrides(budget_usd=1)), path)
    assert ledger.list_jobs() == []  # refused before a job was created
    job_id = prepare_job(ledger, unpriced, path).job_id  # no budget: fine
    with pytest.raises(SpecError, match=r"add a \[pricing\] table"):
        run(ledger, job_id, budget_usd=1)  # resume --budget-usd on it
    assert server.log == []
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.PENDING] == 3
