"""Batch mode end to end (batchrun/batch.py): real ledgers on both backends, the fake server's batch APIs
on 127.0.0.1 (OpenAI Files + Batch, Anthropic Message Batches), each record billed exactly once."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchrun.batch import BatchOptions
from batchrun.jobs import RunSummary, prepare_job, run_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.ledger.shards import ShardLedger
from batchrun.spec import JobSpec, Overrides, parse_spec
from batchrun.states import ExitCode, ItemState, ShardState, StopReason
from batchrun.testing import BatchFaults, FakeProviderServer, Faults

SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"],
          "additionalProperties": False}


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(batch_faults=BatchFaults(turnaround_s=0.3, seed=5)) as srv:
        yield srv


def spec_for(server: FakeProviderServer, kind: str = "openai", **sections: dict[str, Any]) -> JobSpec:
    base = server.anthropic_base_url if kind == "anthropic" else server.base_url
    data: dict[str, Any] = {
        "provider": {"kind": kind, "base_url": base, "model": "gpt-4o-mini", "api_key_env": "BATCHRUN_NO_KEY"},
        "request": {"template": "Say: {text}", "max_tokens": 40},
        "run": {"mode": "batch", **sections.pop("run", {})},
        "batch": {"poll_interval": 0.1, "poll_max": 0.5, **sections.pop("batch", {})},
    }
    data.update(sections)
    return parse_spec(data, where="test.toml")


def records(n: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "text": f"record {prefix}{i}"} for i in range(n)]


def submit(ledger: Ledger, spec: JobSpec, path: Path) -> int:
    return prepare_job(ledger, spec, path).job_id


def run(ledger: Ledger, job_id: int, overrides: Overrides | None = None, **options: Any) -> RunSummary:
    opts = BatchOptions(reconcile_wait=0.2, api_retry_seconds=10.0, heartbeat_interval=0.5, **options)
    return asyncio.run(run_job(ledger, job_id, overrides=overrides, batch=opts))


def billed_once(server: FakeProviderServer, n: int) -> None:
    billed = server.billed_by_key()
    assert len(billed) == n, f"{len(billed)} records billed, expected {n}"
    twice = {k: v for k, v in billed.items() if v > 1}
    assert not twice, f"billed more than once: {list(twice.items())[:5]}"


def outputs(ledger: Ledger, job_id: int) -> dict[str, str | None]:
    return {r.custom_id: r.output for r in LedgerQueries(ledger.engine).iter_items(job_id)}


@pytest.mark.parametrize("kind", ["openai", "openai-responses", "anthropic"])
def test_a_job_goes_through_batches_and_each_record_is_billed_once(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], kind: str
) -> None:
    spec = spec_for(server, kind, batch={"max_requests": 40})
    job_id = submit(ledger, spec, write_jsonl(records(100)))
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.OK, summary
    assert summary.counts[ItemState.SUCCEEDED] == 100
    billed_once(server, 100)
    shards = ShardLedger(ledger).shards(job_id)
    assert [s.requests for s in shards] == [40, 40, 20]
    assert {s.state for s in shards} == {ShardState.COLLECTED}
    got = outputs(ledger, job_id)
    assert got["r7"] is not None and "record r7" in got["r7"]  # the fake echoes the prompt
    queries = LedgerQueries(ledger.engine)
    # Priced at the batch rate (half of gpt-4o-mini's list price), one charged attempt each.
    totals = queries.attempt_totals(job_id)
    assert totals.requests == 100 and totals.cost_usd > 0
    usage_cost = (totals.input_tokens * 0.075 + totals.output_tokens * 0.30) / 1e6
    assert totals.cost_usd == pytest.approx(usage_cost)


def test_a_5xx_on_create_after_creating_is_reconciled_not_resubmitted(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.3, p_create_500=1.0, seed=3)
    job_id = submit(ledger, spec_for(server, batch={"max_requests": 25}), write_jsonl(records(50)))
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.OK
    billed_once(server, 50)
    creates = server.batch_calls()["POST /v1/batches"]
    assert creates == 2  # one create per shard, each answered 500: both adopted from the list


def test_poll_faults_are_not_errors(ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.5, p_poll_429=0.3, p_poll_500=0.2, seed=9)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(30)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    billed_once(server, 30)


def test_failed_lines_go_in_the_next_shard_until_attempts_are_used(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.2, p_line_500=0.3, p_line_400=0.1, seed=21)
    job_id = submit(ledger, spec_for(server, run={"max_attempts": 3}), write_jsonl(records(60)))
    summary = run(ledger, job_id)
    counts = summary.counts
    assert counts[ItemState.PENDING] == counts[ItemState.SUBMITTED] == 0
    assert counts[ItemState.SUCCEEDED] + counts[ItemState.FAILED] == 60
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id))
    failed = [r for r in rows if r.state == ItemState.FAILED]
    assert failed and all(r.error_class in ("client_error", "server_error") for r in failed)
    assert all(r.attempts <= 3 for r in rows)
    assert any(r.attempts > 1 and r.state == ItemState.SUCCEEDED for r in rows)  # retried in a later shard
    assert len(ShardLedger(ledger).shards(job_id)) > 1
    billed = server.billed_by_key()
    assert all(n == 1 for n in billed.values())  # a success is never billed twice
    assert len(billed) == counts[ItemState.SUCCEEDED]


@pytest.mark.slow
def test_an_expired_batch_keeps_what_it_finished_and_sends_the_rest_again(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=2.0, expire_after_s=0.6, seed=2)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(40)))
    first = ShardLedger(ledger)
    summary = run(ledger, job_id, wait=True)
    assert summary.exit_code == ExitCode.OK
    shards = first.shards(job_id)
    assert len(shards) >= 2 and shards[0].provider_status == "expired"
    billed_once(server, 40)
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id))
    assert all(r.attempts == 1 for r in rows)  # an expired line was never charged an attempt


def test_without_wait_the_run_leaves_the_batches_for_the_next_one(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=1.0, seed=4)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(20)))
    first = run(ledger, job_id, wait=False)
    assert first.exit_code == ExitCode.TEMPFAIL and first.result.stop_reason == StopReason.AT_PROVIDER
    assert first.counts[ItemState.SUBMITTED] == 20 and first.at_provider == 20
    assert "batchrun resume" in (first.result.stop_message or "")
    later = None
    for _ in range(50):
        later = run(ledger, job_id, wait=False)
        if later.exit_code != ExitCode.TEMPFAIL:
            break
        asyncio.run(asyncio.sleep(0.2))
    assert later is not None and later.exit_code == ExitCode.OK
    billed_once(server, 20)


@pytest.mark.slow
def test_structured_answers_are_validated_and_reasked_in_the_next_shard(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(p_schema_violation=0.4, p_fenced=0.2, seed=8)
    spec = spec_for(server, output={"schema": SCHEMA, "validation_retries": 2})
    job_id = submit(ledger, spec, write_jsonl(records(30)))
    summary = run(ledger, job_id)
    assert summary.counts[ItemState.SUCCEEDED] + summary.counts[ItemState.INVALID_OUTPUT] == 30
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id))
    succeeded = [r for r in rows if r.state == ItemState.SUCCEEDED]
    assert succeeded and all(r.parsed is not None and "label" in r.parsed for r in succeeded)
    reasked = [r for r in succeeded if r.attempts > 1]
    assert reasked, "a schema violation is re-asked in a later shard"
    assert len(ShardLedger(ledger).shards(job_id)) >= 2
    invalid = [r for r in rows if r.state == ItemState.INVALID_OUTPUT]
    assert all(r.attempts == 3 and r.output is not None for r in invalid)  # two re-asks, the raw answer kept


def test_the_response_cache_answers_in_batch_mode_too(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    spec = spec_for(server)
    first = submit(ledger, spec, write_jsonl(records(10)))
    assert run(ledger, first).exit_code == ExitCode.OK
    second = prepare_job(ledger, spec, write_jsonl(records(15)), new=True).job_id
    summary = run(ledger, second)
    assert summary.exit_code == ExitCode.OK
    assert LedgerQueries(ledger.engine).cached_count(second) == 10
    billed_once(server, 15)


@pytest.mark.slow
def test_a_budget_reserves_each_shard_and_stops_before_the_cap(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    # Worst case per request at the batch price: (prompt estimate + 40 answer tokens) x $0.30/M.
    spec = spec_for(server, run={"budget_usd": 0.00006}, batch={"max_requests": 20})
    job_id = submit(ledger, spec, write_jsonl(records(200)))
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.BUDGET, summary.result
    spent = LedgerQueries(ledger.engine).spent_usd(job_id)
    assert 0 < spent <= 0.00006
    assert summary.counts[ItemState.PENDING] > 0 and summary.counts[ItemState.SUBMITTED] == 0


def test_switching_a_job_to_online_leaves_its_live_batches_to_finish(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=1.0, seed=6)
    job_id = submit(ledger, spec_for(server, batch={"max_requests": 10}), write_jsonl(records(10)))
    first = run(ledger, job_id, wait=False)
    assert first.counts[ItemState.SUBMITTED] == 10
    # New work arrives for the job? No: the same job, resumed online, collects its batch.
    summary = run(ledger, job_id, overrides=Overrides(mode="online"))
    assert summary.exit_code == ExitCode.OK
    billed_once(server, 10)
    assert collections.Counter(s.state for s in ShardLedger(ledger).shards(job_id)) == {ShardState.COLLECTED: 1}


def test_reasks_can_go_online(ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]) -> None:
    server.faults = Faults(p_schema_violation=0.4, seed=8)
    spec = spec_for(server, output={"schema": SCHEMA, "validation_retries": 2}, batch={"reask": "online"})
    job_id = submit(ledger, spec, write_jsonl(records(30)))
    summary = run(ledger, job_id)
    assert summary.counts[ItemState.SUCCEEDED] + summary.counts[ItemState.INVALID_OUTPUT] == 30
    assert len(ShardLedger(ledger).shards(job_id)) == 1  # one batch; every re-ask went online
    online = [r for r in server.log if r.api == "chat"]
    assert online and all(r.key is not None for r in online)
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id))
    assert any(r.attempts > 1 and r.state == ItemState.SUCCEEDED for r in rows)


@pytest.mark.slow
def test_a_batch_over_the_enqueued_token_limit_is_sent_again_smaller(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.2, enqueued_token_limit=60, seed=12)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(40)))
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.OK, summary.result
    shards = ShardLedger(ledger).shards(job_id)
    refused = [s for s in shards if s.state == ShardState.FAILED]
    assert refused and "token_limit_exceeded" in (refused[0].error or "")
    collected = [s for s in shards if s.state == ShardState.COLLECTED]
    assert max(s.requests for s in collected) < refused[0].requests
    billed_once(server, 40)
    assert all(r.attempts == 1 for r in LedgerQueries(ledger.engine).iter_items(job_id))  # refusals cost nothing


@pytest.mark.slow
def test_a_batch_refused_as_a_whole_is_sent_again_smaller_and_never_loops(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.2, max_file_requests=15, seed=13)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(40)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    sizes = [s.requests for s in ShardLedger(ledger).shards(job_id) if s.state == ShardState.COLLECTED]
    assert max(sizes) <= 15
    billed_once(server, 40)
    # A provider that refuses everything: the run stops after a few refusals instead of looping.
    server.batch_faults = BatchFaults(turnaround_s=0.2, max_file_requests=0, seed=13)
    other = prepare_job(ledger, spec_for(server), write_jsonl(records(5, "s")), new=True).job_id
    stopped = run(ledger, other)
    assert stopped.result.stop_reason == StopReason.ERROR and "refused" in (stopped.result.stop_message or "")
    assert stopped.counts[ItemState.PENDING] == 5


@pytest.mark.slow
def test_past_the_deadline_what_is_left_goes_online(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=20.0, seed=14)
    job_id = submit(ledger, spec_for(server, batch={"deadline": 1.0}), write_jsonl(records(30)))
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.OK, summary.result
    [shard] = ShardLedger(ledger).shards(job_id)
    assert shard.cancel_reason == "deadline" and shard.state == ShardState.COLLECTED
    by_route = ShardLedger(ledger).answered_by_route(job_id)
    assert by_route["online"] > 0 and by_route["batch"] + by_route["online"] == 30
    billed_once(server, 30)


def test_an_upload_answered_500_after_storing_is_found_not_sent_twice(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.2, p_upload_500=1.0, seed=15)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(10)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    assert server.batch_calls()["POST /v1/files"] == 1  # the stored file was found by its name
    billed_once(server, 10)


def test_status_warns_before_the_provider_drops_uncollected_results(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    from sqlalchemy import text

    from batchrun.report import job_status, status_lines

    server.batch_faults = BatchFaults(turnaround_s=30.0, seed=16)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(3)))
    assert run(ledger, job_id, wait=False).counts[ItemState.SUBMITTED] == 3
    assert job_status(ledger, job_id)["batch"]["warnings"] == []
    with ledger.engine.begin() as conn:  # the batch was made 25 days ago and never collected
        conn.execute(text("update shards set provider_created_at = provider_created_at - 25 * 86400"))
    data = job_status(ledger, job_id)
    [warning] = data["batch"]["warnings"]
    assert "drops its results in" in warning and f"batchrun resume {job_id}" in warning
    assert any(line.startswith("  warning   shard") for line in status_lines(data))


@pytest.mark.slow
def test_report_and_its_page_show_the_shards_and_their_turnaround(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    from rich.console import Console

    from batchrun.html_report import render_html
    from batchrun.report import job_report, render_report

    server.batch_faults = BatchFaults(turnaround_s=1.5, seed=17)  # OpenAI's times are whole seconds
    job_id = submit(ledger, spec_for(server, batch={"max_requests": 4}), write_jsonl(records(8)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    data = job_report(ledger, job_id)
    turnaround = data["batch"]["turnaround_s"]
    assert turnaround["p50"] is not None and 1 <= turnaround["p50"] <= 3
    console = Console(record=True, width=140)
    render_report(data, console)
    text = console.export_text()
    assert "Provider batches (batch mode)" in text and "answered 8 by batch, 0 online" in text
    page = render_html(data)
    assert "Provider batches (batch mode)" in page and page.count("<td class=\"n\">4</td>") >= 2


class Intercept(httpx.AsyncBaseTransport):
    """The real transport, unless ``hook(request)`` answers instead (returns a Response)."""

    def __init__(self, hook: Callable[[httpx.Request], Awaitable[httpx.Response | None]]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.hook = hook
        self.behind: set[asyncio.Task[None]] = set()  # requests still going to the server on their own

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        answer = await self.hook(request)
        return answer if answer is not None else await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await asyncio.gather(*self.behind)
        await self.inner.aclose()

    def send_behind(self, request: httpx.Request, body: bytes) -> None:
        """Send the request on, its answer thrown away: the client has already been told it failed."""

        async def go() -> None:
            again = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            answer = await self.inner.handle_async_request(again)
            await answer.aclose()

        task = asyncio.ensure_future(go())
        self.behind.add(task)
        task.add_done_callback(self.behind.discard)


def creates(answers: list[str]) -> Intercept:
    """Anthropic/OpenAI creates answered in turn: "lost" (made, answered 500), "overloaded" (529, not made),
    "dropped" (sent to the server, the connection lost before any answer), "gateway" (sent to the server,
    a gateway answers 504 at once), "pass" (as the server answers); after the list, every create passes."""
    left = list(answers)

    async def hook(request: httpx.Request) -> httpx.Response | None:
        if request.method != "POST" or not request.url.path.endswith(("/messages/batches", "/v1/batches")):
            return None
        what = left.pop(0) if left else "pass"
        if what == "lost":
            made = await transport.inner.handle_async_request(request)
            await made.aclose()
            return httpx.Response(500, json={"type": "error", "error": {"type": "api_error", "message": "Internal"}})
        if what == "dropped":
            transport.send_behind(request, await request.aread())
            await asyncio.sleep(0.05)  # the body is out
            raise httpx.ReadError("connection reset by peer", request=request)
        if what == "gateway":
            transport.send_behind(request, await request.aread())
            await asyncio.sleep(0.05)
            return httpx.Response(504, text="<html><body>504 Gateway Time-out</body></html>")
        if what == "overloaded":
            return httpx.Response(529, json={"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})
        return None

    transport = Intercept(hook)
    return transport


@pytest.mark.slow
@pytest.mark.parametrize("answer", ["dropped", "gateway"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_create_that_got_no_answer_is_waited_out_before_it_is_sent_again(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], kind: str, answer: str
) -> None:
    """The create reached the provider, which takes a second to make the batch, and the connection dropped
    before any answer (as for a sender killed mid-create), or a gateway answered 504 (which says nothing of
    the backend behind it): neither is "not created". The shard waits until the create's timeout and a
    margin have passed, finds the batch meanwhile and adopts it."""
    server.batch_faults = BatchFaults(turnaround_s=0.3, create_s=1.0, seed=5)
    job_id = submit(ledger, spec_for(server, kind, batch={"create_timeout": 2.0}), write_jsonl(records(10)))
    summary = run(ledger, job_id, transport=creates([answer]))
    assert summary.exit_code == ExitCode.OK, summary.result
    assert len(server.created_batches()) == 1, "created twice"
    billed_once(server, 10)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_files_a_run_could_not_delete_are_deleted_by_the_next_run(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], kind: str
) -> None:
    """The shard is collected and marked in one transaction; a run that dies (or is refused) before its
    files are deleted at the provider leaves the mark, and the next run deletes them."""

    async def refuse_deletes(request: httpx.Request) -> httpx.Response | None:
        if request.method == "DELETE":
            return httpx.Response(400, json={"error": {"message": "not now", "type": "invalid_request_error"},
                                             "type": "error"})
        return None

    def left_at_provider() -> list[str]:
        with httpx.Client(timeout=10, headers={"anthropic-version": "2023-06-01"}) as client:
            if kind == "anthropic":
                return [b["id"] for b in client.get(server.anthropic_base_url + "/v1/messages/batches").json()["data"]]
            return [f["id"] for f in client.get(server.base_url + "/files").json()["data"]]

    job_id = submit(ledger, spec_for(server, kind), write_jsonl(records(6)))
    assert run(ledger, job_id, transport=Intercept(refuse_deletes)).exit_code == ExitCode.OK
    [shard] = ShardLedger(ledger).shards(job_id)
    assert ShardLedger(ledger).files_left(job_id) == [shard] and left_at_provider()
    assert run(ledger, job_id).exit_code == ExitCode.OK
    assert ShardLedger(ledger).files_left(job_id) == [] and left_at_provider() == []
    assert ShardLedger(ledger).get(shard.id).error is None
    billed_once(server, 6)


@pytest.mark.slow
def test_an_anthropic_shard_never_adopts_a_sibling_shards_batch(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """Shard 1's create makes nothing (529), shard 2's is made but answered 500: both look alike (same size,
    same minute). Each shard's lines carry its own tag, so shard 1 cannot take shard 2's batch for its own."""
    spec = spec_for(server, "anthropic", batch={"max_requests": 10})
    job_id = submit(ledger, spec, write_jsonl(records(20)))
    summary = run(ledger, job_id, transport=creates(["overloaded", "lost"]))
    assert summary.exit_code == ExitCode.OK, summary.result
    billed_once(server, 20)
    batch_ids = [s.batch_id for s in ShardLedger(ledger).shards(job_id) if s.state == ShardState.COLLECTED]
    assert len(batch_ids) == len(set(batch_ids)) == 2


def test_another_ledgers_look_alike_batch_is_never_adopted_nor_deleted(
    tmp_path: Path, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """Two ledgers, the same records under two prompts: A's create makes nothing, B's batch (same size, same
    minute) is live. A does not take B's answers for its own, and B's batch is still there for B."""
    data = write_jsonl(records(10))
    a, b = Ledger.open(str(tmp_path / "a.db")), Ledger.open(str(tmp_path / "b.db"))
    try:
        spec_b = spec_for(server, "anthropic", request={"template": "Translate: {text}", "max_tokens": 40})
        job_b = submit(b, spec_b, data)
        assert run(b, job_b, wait=False).counts[ItemState.SUBMITTED] == 10
        job_a = submit(a, spec_for(server, "anthropic"), data)
        summary_a = run(a, job_a, transport=creates(["overloaded"]))
        assert summary_a.exit_code == ExitCode.OK
        assert all(o and o.startswith("echo: Say: record") for o in outputs(a, job_a).values())
        summary_b = run(b, job_b)
        assert summary_b.exit_code == ExitCode.OK, summary_b.result
        assert all(o and o.startswith("echo: Translate: record") for o in outputs(b, job_b).values())
    finally:
        a.close()
        b.close()


def test_a_slow_host_clock_still_finds_a_lost_anthropic_create(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """This host's clock 20 minutes behind the provider's (every batchrun module's; the fake server keeps the
    true one): the window a lost create is looked for in is set by the provider's Date header."""
    import time as real_time
    import types

    import batchrun.batch
    import batchrun.ledger.shards
    import batchrun.ledger.store
    import batchrun.providers.batches

    slow = types.SimpleNamespace(
        time=lambda: real_time.time() - 1200, monotonic=real_time.monotonic, sleep=real_time.sleep,
        strftime=real_time.strftime, localtime=real_time.localtime,
    )
    for module in (batchrun.batch, batchrun.ledger.shards, batchrun.ledger.store, batchrun.providers.batches):
        monkeypatch.setattr(module, "time", slow)
    job_id = submit(ledger, spec_for(server, "anthropic"), write_jsonl(records(10)))
    summary = run(ledger, job_id, transport=creates(["lost"]))
    assert summary.exit_code == ExitCode.OK
    billed_once(server, 10)


@pytest.mark.slow
def test_a_create_that_cannot_go_out_in_time_is_never_sent(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run frozen between marking the shard `creating` and sending the create (SIGSTOP): once awake it sends
    nothing if the create's time is up, because a run that took the job over meanwhile may have sent it again."""
    from batchrun.providers.openai_batch import OpenAIBatchApi

    real_create = OpenAIBatchApi.create

    async def frozen_then_create(self: OpenAIBatchApi, shard: Any, path: Path, timeout: float) -> Any:
        await asyncio.sleep(1.0)  # the freeze: the monotonic clock went on
        return await real_create(self, shard, path, timeout)

    monkeypatch.setattr(OpenAIBatchApi, "create", frozen_then_create)
    job_id = submit(ledger, spec_for(server, batch={"create_timeout": 0.3}), write_jsonl(records(5)))
    summary = run(ledger, job_id)
    assert server.batch_calls()["POST /v1/batches"] == 0  # nothing ever went out
    # Each try was reconciled (nothing there) and sent again, MAX_CREATES times; then the run stops.
    [shard] = ShardLedger(ledger).shards(job_id)
    assert shard.state == ShardState.FAILED and shard.creates == 3 and "never found" in (shard.error or "")
    assert summary.result.stop_reason == StopReason.ERROR and summary.counts[ItemState.PENDING] == 5


@pytest.mark.slow
def test_cancel_then_resume_sends_nothing_more(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """What a user-cancelled shard would send again (expired, retryable, re-asks) is cancelled instead."""
    from batchrun.batch import cancel_shards

    server.batch_faults = BatchFaults(turnaround_s=3.0, p_line_500=0.5, seed=18)
    job_id = submit(ledger, spec_for(server, batch={"max_requests": 10}), write_jsonl(records(10)))
    assert run(ledger, job_id, wait=False).counts[ItemState.SUBMITTED] == 10
    asyncio.run(asyncio.sleep(1.5))  # some lines answered (some of them 500), the rest not yet
    done = asyncio.run(cancel_shards(ledger, ledger.get_job(job_id)))
    assert done.shards == 1 and not done.problems
    summary = run(ledger, job_id)
    assert summary.counts[ItemState.PENDING] == summary.counts[ItemState.SUBMITTED] == 0
    assert summary.counts[ItemState.CANCELLED] > 0
    assert server.batch_calls()["POST /v1/batches"] == 1  # no new batch after the cancel


def test_the_budget_counts_what_live_batches_reserved_when_the_job_goes_online(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    from batchrun.ledger import LedgerQueries as Queries

    server.batch_faults = BatchFaults(turnaround_s=2.0, seed=19)
    spec = spec_for(server, run={"budget_usd": 0.00004}, batch={"max_requests": 10})
    job_id = submit(ledger, spec, write_jsonl(records(40)))
    first = run(ledger, job_id, wait=False)
    assert first.counts[ItemState.SUBMITTED] > 0
    reserved = ledger.spent_usd(job_id)
    assert reserved > 0  # the live shards' worst case
    online = run(ledger, job_id, overrides=Overrides(mode="online"))
    assert online.exit_code in (ExitCode.BUDGET, ExitCode.OK, ExitCode.SOME_FAILED)
    spent = Queries(ledger.engine).spent_usd(job_id)
    assert spent <= 0.00004 * (1 + 1e-9)


def test_a_batch_the_provider_no_longer_has_gives_its_items_back(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    from sqlalchemy import text

    server.batch_faults = BatchFaults(turnaround_s=30.0, seed=20)
    job_id = submit(ledger, spec_for(server), write_jsonl(records(4)))
    assert run(ledger, job_id, wait=False).counts[ItemState.SUBMITTED] == 4
    with ledger.engine.begin() as conn:  # deleted at the provider, or past its retention
        conn.execute(text("update shards set batch_id = 'batch_gone'"))
    server.batch_faults = BatchFaults(turnaround_s=0.2, seed=20)
    summary = run(ledger, job_id)
    assert summary.exit_code == ExitCode.OK
    first = ShardLedger(ledger).shards(job_id)[0]
    assert first.state == ShardState.FAILED and "no longer has batch batch_gone" in (first.error or "")


def test_an_anthropic_create_refused_for_its_size_is_sent_again_smaller(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.batch_faults = BatchFaults(turnaround_s=0.2, max_batch_requests=15, seed=21)
    job_id = submit(ledger, spec_for(server, "anthropic"), write_jsonl(records(40)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    sizes = [s.requests for s in ShardLedger(ledger).shards(job_id) if s.state == ShardState.COLLECTED]
    assert max(sizes) <= 15
    billed_once(server, 40)
