"""Batch mode's side of the ledger (batchrun/ledger/shards.py) on real SQLite and PostgreSQL:
a shard holds exactly its items, a results line lands once, every write is fenced by the job lock."""

from __future__ import annotations

import pytest

from batchrun.errors import LockLostError
from batchrun.ledger import AttemptRecord, Ledger, LedgerQueries, Outcome
from batchrun.ledger.shards import ShardLedger, ShardPlan
from batchrun.states import ItemState, ShardState

from .test_ledger import make_job
from .test_ledger_fences import make_stale


def plan(item_ids: list[int], token: str = "t1") -> ShardPlan:
    return ShardPlan(token=token, kind="openai", endpoint="/v1/chat/completions", model="m", own_ids=True,
                     item_ids=item_ids, bytes=100 * len(item_ids), prompt_tokens=10 * len(item_ids), worst_usd=0.5)


def attempt(job_id: int, item_id: int, run_id: str, shard_id: int, *, counted: bool = True) -> AttemptRecord:
    return AttemptRecord(job_id=job_id, item_id=item_id, run_id=run_id, number=1, started_at=0.0,
                         queue_wait_ms=None, latency_ms=None, status_code=200, error_class=None,
                         cost_usd=0.01 if counted else None, counted=counted, shard_id=shard_id)


def test_a_shard_holds_exactly_its_items(ledger: Ledger) -> None:
    job_id = make_job(ledger, 5)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    pending = shards.pending_items(job_id)
    shard = shards.add(job_id, run, plan([i.id for i in pending[:3]]))
    assert (shard.state, shard.requests, shard.own_ids) == (ShardState.PREPARING, 3, True)
    counts = LedgerQueries(ledger.engine).counts(job_id)
    assert (counts[ItemState.SUBMITTED], counts[ItemState.PENDING]) == (3, 2)
    assert [i.custom_id for i in shards.iter_shard_items(shard.id)] == ["c1", "c2", "c3"]
    assert [i.custom_id for i in shards.pending_items(job_id)] == ["c4", "c5"]
    assert ledger.spent_usd(job_id) == pytest.approx(0.5)  # the budget counts what open shards reserved
    # The online runner never claims a submitted item.
    assert [c.custom_id for c in ledger.claim(job_id, run, 10, 60, exclusive=True)] == ["c4", "c5"]
    # A second shard of items already taken holds only what is still pending.
    second = shards.add(job_id, run, plan([i.id for i in pending], token="t2"))
    assert second.requests == 0


def test_a_results_line_lands_once(ledger: Ledger) -> None:
    job_id = make_job(ledger, 3)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    items = shards.pending_items(job_id)
    shard = shards.add(job_id, run, plan([i.id for i in items]))
    done = Outcome(items[0].id, ItemState.SUCCEEDED, 1, status_code=200, response="{}", output="ok", cost_usd=0.01)
    again = Outcome(items[1].id, ItemState.PENDING, 1, error_class="server_error", error_message="HTTP 500")
    attempts = [attempt(job_id, items[0].id, run, shard.id), attempt(job_id, items[1].id, run, shard.id)]
    assert shards.record_results(shard, run, [done, again], attempts) == 2
    # The same lines again (a crash during write-back, collected a second time): nothing more.
    assert shards.record_results(shard, run, [done, again], attempts) == 0
    queries = LedgerQueries(ledger.engine)
    rows = {r.custom_id: r for r in queries.iter_items(job_id)}
    assert (rows["c1"].state, rows["c1"].attempts, rows["c1"].output) == (ItemState.SUCCEEDED, 1, "ok")
    assert (rows["c2"].state, rows["c2"].attempts, rows["c2"].error_class) == (ItemState.PENDING, 1, "server_error")
    assert queries.attempt_totals(job_id).cost_usd == pytest.approx(0.02)
    # What the results did not name goes back to pending, uncharged; the shard is collected.
    assert shards.close(shard, run) == 1
    assert rows["c3"].attempts == 0 and queries.counts(job_id)[ItemState.PENDING] == 2
    assert shards.get(shard.id).state == ShardState.COLLECTED
    assert ledger.spent_usd(job_id) == pytest.approx(0.02)  # the reservation is gone once the results are in
    assert [i.custom_id for i in shards.pending_items(job_id)] == ["c2", "c3"]


def test_a_user_cancelled_shard_leaves_its_unanswered_items_cancelled(ledger: Ledger) -> None:
    job_id = make_job(ledger, 2)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    shard = shards.add(job_id, run, plan([i.id for i in shards.pending_items(job_id)]))
    [marked] = shards.cancel_requested(job_id)
    assert marked.cancel_reason == "user"
    assert shards.close(marked, run, left=ItemState.CANCELLED) == 2
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.CANCELLED] == 2
    assert shards.get(shard.id).state == ShardState.COLLECTED


def test_a_refused_shard_fails_the_named_lines_and_gives_back_the_rest(ledger: Ledger) -> None:
    job_id = make_job(ledger, 3)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    items = shards.pending_items(job_id)
    shard = shards.add(job_id, run, plan([i.id for i in items]))
    assert shards.refuse(shard, run, "invalid line", {items[1].id: "bad model"}) == 2
    rows = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_id)}
    assert (rows["c2"].state, rows["c2"].error_message) == (ItemState.FAILED, "bad model")
    assert rows["c1"].state == rows["c3"].state == ItemState.PENDING
    refused = shards.get(shard.id)
    assert (refused.state, refused.error) == (ShardState.FAILED, "invalid line")


def test_a_replayed_add_finds_its_shard(ledger: Ledger) -> None:
    """A transaction retried after its acknowledgement was lost (PostgreSQL ride-out) makes no second shard."""
    job_id = make_job(ledger, 2)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    the_plan = plan([i.id for i in shards.pending_items(job_id)], token="replayed")
    first = shards.add(job_id, run, the_plan)
    again = shards.add(job_id, run, the_plan)
    assert again.id == first.id and len(shards.shards(job_id)) == 1 and again.requests == 2


def test_shard_line_ids_name_the_shard_where_asked(ledger: Ledger) -> None:
    job_id = make_job(ledger, 2)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    items = shards.pending_items(job_id)
    named = ShardPlan(token=f"{job_id}-00ff00ff00ff00ff", kind="anthropic", endpoint=None, model="m", own_ids=False,
                      item_ids=[i.id for i in items])
    shard = shards.add(job_id, run, named)
    ids = [shard.line_id(i.id, i.custom_id) for i in items]
    assert ids == [f"00ff00ff00ff00ff_{i.id}" for i in items]
    assert [shard.item_of(x) for x in ids] == [i.id for i in items]
    assert shard.item_of("c1") is None and shard.item_of("0123_5") is None  # another shard's, or an item's own
    assert set(shards.items_by_line_id(shard, [*ids, "ffff_1"])) == set(ids)


def test_a_run_taken_over_writes_nothing_to_its_shards(ledger: Ledger) -> None:
    job_id = make_job(ledger, 2)
    shards = ShardLedger(ledger)
    old = ledger.start_run(job_id, "submit", exclusive=True)
    shard = shards.add(job_id, old, plan([i.id for i in shards.pending_items(job_id)]))
    make_stale(ledger, job_id)
    new = ledger.start_run(job_id, "resume", exclusive=True)
    for write in (
        lambda: shards.update(shard, old, state=ShardState.CREATING),
        lambda: shards.add(job_id, old, plan([], token="t9")),
        lambda: shards.close(shard, old),
        lambda: shards.refuse(shard, old, "x"),
    ):
        with pytest.raises(LockLostError):
            write()
    assert shards.update(shard, new, state=ShardState.CREATING).state == ShardState.CREATING


def test_update_records_what_the_provider_said(ledger: Ledger) -> None:
    job_id = make_job(ledger, 1)
    shards = ShardLedger(ledger)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    shard = shards.add(job_id, run, plan([i.id for i in shards.pending_items(job_id)]))
    live = shards.update(shard, run, state=ShardState.LIVE, batch_id="batch_1", counts={"total": 1, "completed": 0})
    assert (live.batch_id, dict(live.counts)) == ("batch_1", {"total": 1, "completed": 0})
    assert shards.known_batch_ids("openai") == {"batch_1"}
    assert not shards.deadline_passed(job_id, 60.0) and shards.deadline_passed(job_id, -1.0)
    sent = shards.sending_create(live, run)
    assert (sent.state, sent.creates, sent.run_id) == (ShardState.CREATING, 1, run)
    assert sent.create_sent_at is not None and abs(sent.create_sent_at - shards.now()) < 5
    with pytest.raises(ValueError, match="job_id"):
        shards.update(shard, run, job_id=2)


def test_a_late_online_answer_lands_on_an_item_now_in_a_shard(ledger: Ledger) -> None:
    """An online run frozen past its lock's staleness; the job is taken over in batch mode and the item put
    in a shard: the online answer it paid for still lands (an answer is never thrown away while the item
    has none), and the shard's later line for it lands on nothing."""
    job_id = make_job(ledger, 1)
    shards = ShardLedger(ledger)
    old = ledger.start_run(job_id, "submit", exclusive=True)
    [claimed] = ledger.claim(job_id, old, 1, 60, exclusive=True, token=1)
    make_stale(ledger, job_id)
    new = ledger.start_run(job_id, "resume", exclusive=True)
    assert ledger.requeue_orphans(job_id, new) == 1
    shard = shards.add(job_id, new, plan([claimed.id]))
    late = Outcome(claimed.id, ItemState.SUCCEEDED, 1, status_code=200, response="{}", output="online", claim=1)
    ledger.record(old, [late], [])
    [row] = LedgerQueries(ledger.engine).iter_items(job_id)
    assert (row.state, row.output) == (ItemState.SUCCEEDED, "online")
    line = Outcome(claimed.id, ItemState.SUCCEEDED, 1, status_code=200, response="{}", output="batch")
    assert shards.record_results(shard, new, [line], [attempt(job_id, claimed.id, new, shard.id)]) == 0
    assert [r.output for r in LedgerQueries(ledger.engine).iter_items(job_id)] == ["online"]
