"""JobRunner on the in-memory ledger (:class:`batchrun.testing.ledger.InMemoryLedger`), sending with the
real :class:`~batchrun.providers.http.Sender` over ``httpx.MockTransport``: admission (slow start, the
cap), stopping (asked to, a refused key, the budget, a lost lock), re-asks, and the response cache, each
in a fraction of a second. tests/integration/test_scheduler.py runs the runner on real SQLite and
PostgreSQL ledgers against the fake server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from batchrun.providers import provider_for
from batchrun.providers.http import Sender
from batchrun.ratelimit import PROBE_ANSWERS
from batchrun.scheduler import JobRunner, RunOptions, RunResult
from batchrun.spec import JobSpec, parse_spec
from batchrun.states import ItemState, StopReason, exit_code_for
from batchrun.testing.ledger import InMemoryLedger

FAST = RunOptions(backoff_initial=0.001, backoff_max=0.01, flush_interval=0.01)
SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["spam", "ham"]}},
    "required": ["label"],
    "additionalProperties": False,
}

Answer = Callable[[dict[str, Any], int], httpx.Response | Awaitable[httpx.Response]]


def chat(text: str | None = None, *, status: int = 200, prompt_tokens: int = 10, completion_tokens: int = 5) -> httpx.Response:
    """An OpenAI Chat Completions answer (``text``), or an error body with ``status``."""
    if status != 200:
        return httpx.Response(status, json={"error": {"message": f"HTTP {status}", "type": "error", "code": None}})
    return httpx.Response(200, json={
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    })


def question(body: dict[str, Any]) -> str:
    """The first user message: what a request asks, re-asks included."""
    return str(body["messages"][0]["content"])


class FakeChat:
    """The API in this process: ``answer(body, asked)`` says what each request gets (``asked``: how
    often this question was asked before), awaited when it is a coroutine. Counts what is in flight."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer: Answer = answer or (lambda body, asked: chat(f"echo: {question(body)}"))
        self.bodies: list[dict[str, Any]] = []
        self.asked: Counter[str] = Counter()
        self.in_flight = 0
        self.peak = 0
        self.answered = 0
        self.started: list[tuple[int, int]] = []  # (answers given so far, requests in flight) at each request

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        asked = self.asked[question(body)]
        self.asked[question(body)] += 1
        self.bodies.append(body)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.started.append((self.answered, self.in_flight))
        try:
            response = self.answer(body, asked)
            return await response if inspect.isawaitable(response) else response
        finally:
            self.in_flight -= 1
            self.answered += 1


def make_spec(*, output: dict[str, Any] | None = None, pricing: dict[str, float] | None = None, **run: Any) -> JobSpec:
    data: dict[str, Any] = {"provider": {"base_url": "http://llm.test/v1", "model": "m"}, "run": run}
    if output is not None:
        data["output"] = output
    if pricing is not None:
        data["pricing"] = pricing
    return parse_spec(data, where="test")


def add_job(ledger: InMemoryLedger, spec: JobSpec, n: int) -> int:
    """A job of ``n`` questions q0..q<n-1>."""
    return ledger.add_job(
        spec, [{"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 5} for i in range(n)]
    )


def runner(ledger: InMemoryLedger, job_id: int, api: FakeChat, options: RunOptions = FAST) -> JobRunner:
    job = ledger.get_job(job_id)
    sender = Sender(httpx.MockTransport(api), httpx.Timeout(5.0))
    return JobRunner(ledger, job, job.spec, provider_for(job.spec, read_key=False), options, sender=sender)


def run(job_runner: JobRunner) -> RunResult:
    """The run, ended in the ledger as ``jobs.run_job`` ends it (the job lock given back)."""
    result = asyncio.run(job_runner.run())
    ledger, job_id = job_runner.ledger, job_runner.job.id
    ledger.end_run(job_id, result.run_id, exit_code_for(ledger.counts(job_id), result.stop_reason))
    return result


async def answer_after(seconds: float, text: str = "ok") -> httpx.Response:
    await asyncio.sleep(seconds)
    return chat(text)


def states(ledger: InMemoryLedger, job_id: int) -> dict[str, str]:
    return {f"q{row.line - 1}": row.state for row in ledger.items(job_id)}


# -- admission -------------------------------------------------------------------


def test_slow_start_the_first_answers_come_from_initial_concurrency_requests_then_it_opens() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=32), 300)
    api = FakeChat(lambda body, asked: answer_after(0.005))
    result = run(runner(ledger, job_id, api, dataclasses.replace(FAST, initial_concurrency=3)))
    assert result.stop_reason is None
    assert ledger.counts(job_id)[ItemState.SUCCEEDED] == 300 and len(api.bodies) == 300
    assert [in_flight for answered, in_flight in api.started if answered == 0] == [1, 2, 3]
    early = [(answered, in_flight) for answered, in_flight in api.started if answered < PROBE_ANSWERS]
    assert all(in_flight <= 3 + answered for answered, in_flight in early)  # one more for each clean answer
    assert 16 <= api.peak <= 32  # then opened towards the cap, never past it


def test_never_more_requests_in_flight_than_the_concurrency() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=6), 120)
    api = FakeChat(lambda body, asked: answer_after(0.004))
    result = run(runner(ledger, job_id, api, dataclasses.replace(FAST, initial_concurrency=6)))
    assert result.stop_reason is None and ledger.counts(job_id)[ItemState.SUCCEEDED] == 120
    assert api.peak == 6


# -- stopping --------------------------------------------------------------------------


def test_request_stop_puts_unstarted_items_back_at_once_and_in_flight_ones_get_the_grace() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=4, grace_seconds=0.3), 20)
    during_grace: dict[str, str] = {}

    async def answer(body: dict[str, Any], asked: int) -> httpx.Response:
        if api.in_flight == 4:  # four requests out: stop now
            job_runner.request_stop(StopReason.SIGNAL, "told to stop")
        if question(body) in ("q0", "q1"):
            return await answer_after(0.05)  # within the grace
        await asyncio.sleep(0.15)
        during_grace.update(states(ledger, job_id))
        await asyncio.sleep(60)  # past it: cut
        raise AssertionError("not cut at the end of the grace")

    api = FakeChat(answer)
    job_runner = runner(ledger, job_id, api)
    started = time.monotonic()
    result = run(job_runner)
    took = time.monotonic() - started
    assert (result.stop_reason, result.stop_message) == (StopReason.SIGNAL, "told to stop")
    assert [question(b) for b in api.bodies] == ["q0", "q1", "q2", "q3"]  # nothing sent after the stop
    running = {"q2": ItemState.RUNNING, "q3": ItemState.RUNNING}
    done = {"q0": ItemState.SUCCEEDED, "q1": ItemState.SUCCEEDED}
    assert during_grace == {f"q{i}": ItemState.PENDING for i in range(4, 20)} | running | done
    assert states(ledger, job_id) == {f"q{i}": ItemState.PENDING for i in range(2, 20)} | done
    assert [row.attempts for row in ledger.items(job_id)][:4] == [1, 1, 0, 0]  # the cut ones are not charged
    assert 0.3 <= took < 15  # the grace, then cut: far below the 60 s the answer would take


def test_a_refused_key_stops_the_run_with_every_item_pending() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=8), 30)

    async def refuse(body: dict[str, Any], asked: int) -> httpx.Response:
        await asyncio.sleep(0.005)
        return chat(status=401)

    api = FakeChat(refuse)
    result = run(runner(ledger, job_id, api))
    assert result.stop_reason == StopReason.AUTH and "authentication refused" in (result.stop_message or "")
    assert len(api.bodies) == FAST.initial_concurrency  # the requests already out when the first refusal came
    assert ledger.counts(job_id)[ItemState.PENDING] == 30
    assert {row.attempts for row in ledger.items(job_id)} == {0}  # a refusal is not the item's fault
    assert [(a.status_code, a.error_class, a.counted) for a in ledger.attempts(job_id)] == [(401, "auth", False)] * 4


def test_the_budget_stops_the_run_before_it_is_exceeded_and_a_resume_sends_nothing() -> None:
    ledger = InMemoryLedger()
    pricing = {"input_per_million": 1000.0, "output_per_million": 1000.0}  # 0.1 cent a token
    job_id = add_job(ledger, make_spec(concurrency=4, budget_usd=0.2, pricing=pricing), 40)
    api = FakeChat(lambda body, asked: answer_after(0.002))
    result = run(runner(ledger, job_id, api))
    assert result.stop_reason == StopReason.BUDGET and "budget of" in (result.stop_message or "")
    counts = ledger.counts(job_id)
    assert counts[ItemState.SUCCEEDED] == len(api.bodies) >= 5
    assert counts[ItemState.PENDING] == 40 - len(api.bodies)
    spent = ledger.spent_usd(job_id)
    assert spent == pytest.approx(len(api.bodies) * 15 * 0.001) and 0.15 < spent <= 0.2  # used to the last request that fit
    again = FakeChat()
    result = run(runner(ledger, job_id, again))  # the spend so far comes from the ledger
    assert result.stop_reason == StopReason.BUDGET and again.bodies == []


def test_a_lost_lock_stops_sending_at_once_without_the_grace() -> None:
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=4, grace_seconds=10), 400)
    taken_by: list[str] = []
    sent_while_stopping: list[str] = []

    async def answer(body: dict[str, Any], asked: int) -> httpx.Response:
        if job_runner.stopping:
            sent_while_stopping.append(question(body))
        if len(api.bodies) == 20:  # another run takes the job over (this one stalled, as far as it knows)
            taken_by.append(ledger.start_run(job_id, "resume", exclusive=True, stale_after=-1))
        if len(api.bodies) >= 20:
            await asyncio.sleep(60)  # in flight when the run learns it lost the lock: cut, no grace
        return await answer_after(0.001)

    api = FakeChat(answer)
    job_runner = runner(ledger, job_id, api, dataclasses.replace(FAST, heartbeat_interval=0.02))
    started = time.monotonic()
    result = run(job_runner)
    assert result.stop_reason == StopReason.LOCK_LOST and taken_by[0] in (result.stop_message or "")
    assert time.monotonic() - started < 2.0
    assert sent_while_stopping == []
    assert 20 <= len(api.bodies) < 20 + 4  # none after those already out (at most the concurrency)
    assert ledger.counts(job_id)[ItemState.RUNNING] == 0


# -- re-asks ---------------------------------------------------------------------------


def test_an_invalid_answer_is_re_asked_with_feedback_up_to_the_retries_then_kept_as_invalid() -> None:
    """At concurrency 1 the invalid answer's slot, held until its re-ask state is committed, is the only one:
    every re-ask goes out after the re-asks so far are in the ledger."""
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=1, output={"schema": SCHEMA, "validation_retries": 2}), 2)
    committed_before_sent: list[bool] = []

    def answer(body: dict[str, Any], asked: int) -> httpx.Response:
        if asked:  # a re-ask: the re-asks so far are in the ledger already
            row = next(r for r in ledger.rows(job_id) if f"q{r['line'] - 1}" == question(body))
            committed = [turn for pair in orjson.loads(row["followups"] or "[]") for turn in pair]
            committed_before_sent.append([m["content"] for m in body["messages"][1:]] == committed)
        if question(body) == "q1" and asked == 1:
            return chat('{"label": "ham"}')
        return chat('{"label": "eggs"}')

    api = FakeChat(answer)
    result = run(runner(ledger, job_id, api))
    assert result.stop_reason is None
    assert api.asked == {"q0": 3, "q1": 2}
    q0_turns = [len(b["messages"]) for b in api.bodies if question(b) == "q0"]
    assert q0_turns == [1, 3, 5]  # each re-ask carries the invalid answers and the feedback so far
    reask = next(b for b in api.bodies if question(b) == "q0" and len(b["messages"]) == 3)
    assert reask["messages"][1] == {"role": "assistant", "content": '{"label": "eggs"}'}
    assert "label" in reask["messages"][2]["content"]
    assert committed_before_sent == [True] * 3
    invalid, valid = ledger.items(job_id)
    assert (invalid.state, invalid.error_class, invalid.output) == (
        ItemState.INVALID_OUTPUT, "schema_invalid", '{"label": "eggs"}'
    )  # the raw answer is kept
    assert invalid.validation_errors and "label" in invalid.validation_errors
    assert (valid.state, valid.parsed) == (ItemState.SUCCEEDED, '{"label":"ham"}')


def test_a_resumed_run_carries_on_from_the_committed_re_asks() -> None:
    ledger = InMemoryLedger()
    spec = make_spec(concurrency=4, grace_seconds=0.05, output={"schema": SCHEMA, "validation_retries": 1})
    job_id = add_job(ledger, spec, 2)

    async def stop_at_the_re_ask(body: dict[str, Any], asked: int) -> httpx.Response:
        if not asked:
            return await answer_after(0.005, '{"label": "eggs"}')
        first.request_stop(StopReason.SIGNAL)  # stopped while the re-ask is out
        await asyncio.sleep(60)
        raise AssertionError("not cut")

    first = runner(ledger, job_id, FakeChat(stop_at_the_re_ask))
    assert run(first).stop_reason == StopReason.SIGNAL
    assert [(r["state"], len(orjson.loads(r["followups"]))) for r in ledger.rows(job_id)] == [(ItemState.PENDING, 1)] * 2

    api = FakeChat(lambda body, asked: chat('{"label": "spam"}' if question(body) == "q0" else '{"label": "eggs"}'))
    assert run(runner(ledger, job_id, api)).stop_reason is None
    assert [len(b["messages"]) for b in api.bodies] == [3, 3]  # the re-ask again, not the first question
    assert api.bodies[0]["messages"][1]["content"] == '{"label": "eggs"}'
    assert states(ledger, job_id) == {"q0": ItemState.SUCCEEDED, "q1": ItemState.INVALID_OUTPUT}  # no second re-ask
    assert [r.attempts for r in ledger.items(job_id)] == [2, 2]


# -- the response cache ------------------------------------------------------------------


def test_an_answered_request_is_reused_without_sending_it() -> None:
    ledger = InMemoryLedger()
    spec = make_spec(concurrency=4, pricing={"input_per_million": 1.0, "output_per_million": 1.0})
    first_job = add_job(ledger, spec, 10)
    run(runner(ledger, first_job, FakeChat()))
    second_job = add_job(ledger, spec, 12)  # the same ten questions and two new ones
    api = FakeChat()
    job_runner = runner(ledger, second_job, api)
    assert run(job_runner).stop_reason is None
    assert [question(b) for b in api.bodies] == ["q10", "q11"]
    assert job_runner.stats.cached == 10
    first, second = ledger.items(first_job), ledger.items(second_job)
    assert [r.cached_from for r in second] == [r.item_id for r in first] + [None, None]
    assert [(r.state, r.output, r.cost_usd) for r in second[:10]] == [
        (ItemState.SUCCEEDED, f"echo: q{i}", 0.0) for i in range(10)
    ]
    assert {a.item_id for a in ledger.attempts(second_job)} == {r.item_id for r in second[10:]}  # no attempt rows

    no_cache = add_job(ledger, dataclasses.replace(spec, run=dataclasses.replace(spec.run, cache=False)), 3)
    api = FakeChat()
    run(runner(ledger, no_cache, api))
    assert len(api.bodies) == 3
