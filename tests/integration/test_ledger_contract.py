"""What a run relies on of its ledger (:class:`~batchrun.ledger.RunLedger`), the same scenarios on SQLite,
PostgreSQL and the in-memory stand-in (:class:`batchrun.testing.ledger.InMemoryLedger`), so the stand-in the
runner's unit tests use cannot drift from the real ledger: the job lock and its fences, claims and leases,
outcomes landing only where they may, the response cache's look-up, the rate buckets. The fences only the
real ledger has (ingest, a replayed write, the database clock, sessions cut) are
tests/integration/test_ledger_fences.py.

A stalled lock holder is made with ``stale_after=-1`` and a lapsed lease with ``lease_seconds=-1``, so
every backend is driven through its calls alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchrun.errors import JobLockedError, JobNotFoundError, LockLostError
from batchrun.ledger import AttemptRecord, ItemRow, Ledger, LedgerQueries, Outcome, RunLedger
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ItemState
from batchrun.testing.ledger import InMemoryLedger

SPEC = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))


@dataclass
class Backend:
    """A ledger, and how a test adds a job of ``n`` items (custom ids c1..cn) and reads its items back."""

    ledger: RunLedger
    add_job: Callable[[int], int]
    items: Callable[[int], list[ItemRow]]

    def states(self, job_id: int) -> list[str]:
        return [r.state for r in self.items(job_id)]


def _real(ledger: Ledger) -> Backend:
    def add_job(n: int) -> int:
        job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash=f"h{time.time_ns()}")
        ledger.insert_items(
            job_id,
            [{"line": i, "custom_id": f"c{i}", "url": None, "body": "{}", "state": ItemState.PENDING}
             for i in range(1, n + 1)],
        )
        ledger.finish_ingest(job_id)
        return job_id

    return Backend(ledger, add_job, lambda job_id: list(LedgerQueries(ledger.engine).iter_items(job_id)))


def _memory() -> Backend:
    ledger = InMemoryLedger()
    return Backend(ledger, lambda n: ledger.add_job(SPEC, ["{}"] * n), ledger.items)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "memory":
        yield _memory()
        return
    url = str(tmp_path / "ledger.db") if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))
    ledger = Ledger.open(url)
    try:
        yield _real(ledger)
    finally:
        ledger.close()


def _attempt(job_id: int, item_id: int, run: str, seq: int, **over: object) -> AttemptRecord:
    fields: dict[str, object] = {"queue_wait_ms": 0.0, "latency_ms": 100.0, "status_code": 200, "error_class": None}
    fields.update(over)
    return AttemptRecord(job_id, item_id, run, seq, time.time(), seq=seq, **fields)  # type: ignore[arg-type]


# -- the job and its lock ---------------------------------------------------------


def test_a_job_reads_back_with_its_counts(backend: Backend) -> None:
    job_id = backend.add_job(3)
    job = backend.ledger.get_job(job_id)
    assert (job.id, job.total, job.ingest_done, job.spec.provider.model) == (job_id, 3, True, "m")
    counts = backend.ledger.counts(job_id)
    assert counts[ItemState.PENDING] == 3 and counts[ItemState.SUCCEEDED] == 0 and ItemState.CANCELLED in counts
    assert [r.custom_id for r in backend.items(job_id)] == ["c1", "c2", "c3"]
    with pytest.raises(JobNotFoundError):
        backend.ledger.get_job(job_id + 100)


def test_a_run_that_lost_its_lock_is_refused_claims_heartbeats_and_sweeps(backend: Backend) -> None:
    """Issue 14, case 2: heartbeat, claim and the orphan sweep check the lock in their own transaction, so a
    run that stalled past the lock's staleness and was taken over writes nothing more."""
    led = backend.ledger
    job_id = backend.add_job(4)
    old = led.start_run(job_id, "submit", exclusive=True)
    with pytest.raises(JobLockedError, match=old):
        led.start_run(job_id, "resume", exclusive=True)
    assert {c.custom_id for c in led.claim(job_id, old, 2, 60, exclusive=True, token=1)} == {"c1", "c2"}
    assert len(led.heartbeat(job_id, old, 60, exclusive=True)) == 2
    new = led.start_run(job_id, "resume", exclusive=True, stale_after=-1)  # the old holder stalled
    for fenced in (
        lambda: led.claim(job_id, old, 2, 60, exclusive=True, token=2),
        lambda: led.heartbeat(job_id, old, 60, exclusive=True),
        lambda: led.requeue_orphans(job_id, old),
    ):
        with pytest.raises(LockLostError, match=f"taken over by run {new}"):
            fenced()
    assert backend.states(job_id) == [ItemState.RUNNING] * 2 + [ItemState.PENDING] * 2  # the fenced calls wrote nothing
    assert led.requeue_orphans(job_id, new) == 2
    assert led.counts(job_id)[ItemState.RUNNING] == 0
    led.end_run(job_id, old, 75)  # the new holder is not disturbed by the old one's end
    with pytest.raises(JobLockedError, match=new):
        led.start_run(job_id, "resume", exclusive=True)
    led.end_run(job_id, new, 0)
    led.start_run(job_id, "resume", exclusive=True)  # free again


def test_a_replayed_start_finds_its_own_run(backend: Backend) -> None:
    """start_run replayed after a lost acknowledgement (the same run id) carries on, instead of
    finding the job locked by itself."""
    led = backend.ledger
    job_id = backend.add_job(1)
    run = led.start_run(job_id, "submit", exclusive=True, run_id="a" * 16)
    assert led.start_run(job_id, "submit", exclusive=True, run_id=run) == run
    with pytest.raises(JobLockedError):
        led.start_run(job_id, "submit", exclusive=True)


def test_requeue_orphans_is_fenced_by_the_lock(backend: Backend) -> None:
    """A run that stalled between taking the lock and putting orphans back must not, once woken, put
    back the items of the run that took the job over meanwhile."""
    led = backend.ledger
    job_id = backend.add_job(4)
    slow = led.start_run(job_id, "resume", exclusive=True)
    new = led.start_run(job_id, "resume", exclusive=True, stale_after=-1)
    led.claim(job_id, new, 4, 60, exclusive=True, token=1)
    with pytest.raises(LockLostError):
        led.requeue_orphans(job_id, slow)
    assert led.counts(job_id)[ItemState.RUNNING] == 4


def test_a_run_without_the_lock_may_not_make_fenced_calls(backend: Backend) -> None:
    job_id = backend.add_job(1)
    worker = backend.ledger.start_run(job_id, "worker", exclusive=False)
    with pytest.raises(LockLostError, match="another run, since ended"):
        backend.ledger.claim(job_id, worker, 1, 60, exclusive=True)
    assert backend.ledger.claim(job_id, worker, 1, 60) != []  # unfenced, as a worker claims


# -- claims and leases ---------------------------------------------------------------


def test_claims_lease_in_input_order_and_a_replay_returns_what_the_first_leased(backend: Backend) -> None:
    """A claim whose commit lost its acknowledgement is replayed whole: it must hand back the items
    the first one leased, not lease more that nobody works until the run ends."""
    led = backend.ledger
    job_id = backend.add_job(10)
    run = led.start_run(job_id, "worker", exclusive=False)
    first = led.claim(job_id, run, 3, 60, token=7)
    assert [(c.custom_id, c.body, c.attempts, c.claim, c.followups) for c in first] == [
        ("c1", "{}", 0, 7, None), ("c2", "{}", 0, 7, None), ("c3", "{}", 0, 7, None),
    ]
    assert led.claim(job_id, run, 3, 60, token=7) == first
    assert [c.custom_id for c in led.claim(job_id, run, 3, 60, token=8)] == ["c4", "c5", "c6"]
    assert led.counts(job_id)[ItemState.RUNNING] == 6
    assert [c.custom_id for c in led.claim(job_id, run, 100, 60, token=9)] == ["c7", "c8", "c9", "c10"]
    assert led.claim(job_id, run, 100, 60, token=10) == []


def test_a_worker_learns_which_items_it_still_holds(backend: Backend) -> None:
    """Issue 14, case 2 (workers): the heartbeat renews the run's leases and returns the items still
    leased to it, by claim; the sweep takes those whose lease lapsed."""
    led = backend.ledger
    job_id = backend.add_job(4)
    stalled = led.start_run(job_id, "worker", exclusive=False)
    lapsed = led.claim(job_id, stalled, 2, -1, token=1)  # leases already lapsed: the run stalled
    live = led.claim(job_id, stalled, 2, 60, token=2)
    assert led.heartbeat(job_id, stalled, 60) == {c.id: c.claim for c in lapsed + live}
    assert led.requeue_expired(job_id) == 0  # the heartbeat renewed them all
    assert led.claim(job_id, stalled, 2, 60, token=3) == []  # nothing pending: nothing leased
    led.heartbeat(job_id, stalled, -1)  # every lease now lapsed
    assert led.requeue_expired(job_id) == 4
    other = led.start_run(job_id, "worker", exclusive=False)
    taken = led.claim(job_id, other, 2, 60, token=1)
    again = led.claim(job_id, stalled, 2, 60, token=5)  # the stalled run claims the other two afresh
    assert led.heartbeat(job_id, stalled, 60) == {c.id: 5 for c in again}
    assert led.heartbeat(job_id, other, 60) == {c.id: 1 for c in taken}


def test_requeue_orphans_spares_live_workers_and_own_items(backend: Backend) -> None:
    led = backend.ledger
    job_id = backend.add_job(8)
    dead = led.start_run(job_id, "submit", exclusive=True)
    led.claim(job_id, dead, 2, 60, exclusive=True, token=1)
    worker = led.start_run(job_id, "worker", exclusive=False)
    led.claim(job_id, worker, 2, 60, token=1)
    stalled_worker = led.start_run(job_id, "worker", exclusive=False)
    led.claim(job_id, stalled_worker, 2, -1, token=1)
    new = led.start_run(job_id, "resume", exclusive=True, stale_after=-1)
    mine = led.claim(job_id, new, 1, 60, exclusive=True, token=1)
    assert led.requeue_orphans(job_id, new) == 4  # the dead holder's and the lapsed worker's
    led.end_run(job_id, worker, 0)
    assert led.requeue_orphans(job_id, new) == 2  # an ended worker's items are orphans too
    assert led.heartbeat(job_id, new, 60, exclusive=True) == {mine[0].id: 1}


def test_release_held_gives_back_only_the_runs_own_items(backend: Backend) -> None:
    led = backend.ledger
    job_id = backend.add_job(5)
    run = led.start_run(job_id, "worker", exclusive=False)
    other = led.start_run(job_id, "worker", exclusive=False)
    led.claim(job_id, run, 2, 60, token=1)
    led.claim(job_id, run, 1, 60, token=2)
    kept = led.claim(job_id, other, 1, 60, token=1)
    assert led.release_held(job_id, run) == 3
    assert led.heartbeat(job_id, run, 60) == {}
    assert led.heartbeat(job_id, other, 60) == {kept[0].id: 1}
    assert led.counts(job_id)[ItemState.PENDING] == 4


# -- outcomes and their fences -------------------------------------------------------


def test_outcomes_are_written_and_attempts_charged(backend: Backend) -> None:
    led = backend.ledger
    job_id = backend.add_job(3)
    run = led.start_run(job_id, "submit", exclusive=True)
    a, b, c = led.claim(job_id, run, 3, 60, exclusive=True, token=1)
    led.record(
        run,
        [
            Outcome(a.id, ItemState.SUCCEEDED, 2, status_code=200, response='{"x": 1}', output="yes", parsed='"yes"',
                    request_id="r1", input_tokens=3, output_tokens=4, latency_ms=100.0, finished_at=time.time(),
                    cost_usd=0.25, request_hash="k-a", claim=1),
            Outcome(b.id, ItemState.FAILED, 1, status_code=400, response="bad", error_class="client_error",
                    error_message="HTTP 400", claim=1),
            Outcome(c.id, ItemState.PENDING, 1, status_code=503, error_class="server_error", error_message="HTTP 503",
                    claim=1),
        ],
        [
            _attempt(job_id, a.id, run, 1, status_code=500, error_class="server_error", latency_ms=50.0),
            _attempt(job_id, a.id, run, 2, cost_usd=0.25, latency_ms=100.0),
            _attempt(job_id, b.id, run, 3, status_code=400, error_class="client_error"),
            _attempt(job_id, c.id, run, 4, status_code=429, error_class="rate_limited", counted=False),
            _attempt(job_id, c.id, run, 5, status_code=503, error_class="server_error", latency_ms=None),
        ],
    )
    rows = backend.items(job_id)
    assert [(r.state, r.attempts, r.status_code, r.error_class) for r in rows] == [
        (ItemState.SUCCEEDED, 2, 200, None), (ItemState.FAILED, 1, 400, "client_error"),
        (ItemState.PENDING, 1, 503, "server_error"),
    ]
    assert (rows[0].output, rows[0].parsed, rows[0].request_id, rows[0].input_tokens, rows[0].cost_usd) == (
        "yes", '"yes"', "r1", 3, 0.25
    )
    assert (rows[1].response, rows[1].error_message) == ("bad", "HTTP 400")
    assert led.spent_usd(job_id) == pytest.approx(0.25)
    assert led.recent_latencies(job_id, 10) == [pytest.approx(0.1)]
    assert led.claim(job_id, run, 1, 60, exclusive=True, token=2)[0].attempts == 1  # the put-back one, charged once
    assert led.heartbeat(job_id, run, 60, exclusive=True) == {c.id: 2}


def test_recent_latencies_are_the_latest_clean_ones_oldest_first(backend: Backend) -> None:
    led = backend.ledger
    job_id = backend.add_job(1)
    run = led.start_run(job_id, "worker", exclusive=False)
    item = led.claim(job_id, run, 1, 60, token=1)[0]
    led.record(run, [], [_attempt(job_id, item.id, run, n, latency_ms=n * 1000.0) for n in range(1, 6)]
               + [_attempt(job_id, item.id, run, 6, latency_ms=9000.0, error_class="timeout")])
    assert led.recent_latencies(job_id, 3) == [3.0, 4.0, 5.0]
    assert led.recent_latencies(job_id, 0) == []
    assert led.recent_latencies(job_id + 100, 3) == [] and led.spent_usd(job_id + 100) == 0.0


def test_an_outcome_lands_only_on_the_claim_it_answers(backend: Backend) -> None:
    """A worker stalled past its lease has its items swept back and then claims them again itself:
    an outcome it had queued for the earlier claim (a put-back, a failure) must not end the new one,
    or the item goes back to pending while the new claim's request is in flight, and is sent twice."""
    led = backend.ledger
    job_id = backend.add_job(2)
    run = led.start_run(job_id, "worker", exclusive=False)
    first = led.claim(job_id, run, 2, -1, token=1)
    assert led.requeue_expired(job_id) == 2
    again = led.claim(job_id, run, 2, 60, token=2)
    assert [c.id for c in again] == [c.id for c in first]
    led.record(run, [Outcome(first[0].id, ItemState.PENDING, 1, claim=1),
                     Outcome(first[1].id, ItemState.FAILED, 1, error_class="server_error", claim=1),
                     Outcome(first[1].id, ItemState.RUNNING, 1, followups='[["a", "b"]]', claim=1)], [])
    assert backend.states(job_id) == [ItemState.RUNNING, ItemState.RUNNING]
    assert led.heartbeat(job_id, run, 60) == {again[0].id: 2, again[1].id: 2}
    other = led.start_run(job_id, "worker", exclusive=False)
    led.record(other, [Outcome(again[0].id, ItemState.FAILED, 1, error_class="x", claim=2)], [])  # not its item
    assert backend.states(job_id) == [ItemState.RUNNING, ItemState.RUNNING]
    led.record(run, [Outcome(again[0].id, ItemState.PENDING, 1, claim=2)], [])
    assert backend.states(job_id) == [ItemState.PENDING, ItemState.RUNNING]


def test_a_late_answer_lands_on_an_item_another_run_failed_and_the_first_answer_wins(backend: Backend) -> None:
    """The item's lease lapsed, another run took it and filed it failed (or invalid): the first run's
    answer, paid for, still lands, since the item has none. On an item already answered it does not."""
    led = backend.ledger
    job_id = backend.add_job(3)
    slow = led.start_run(job_id, "worker", exclusive=False)
    taken = led.claim(job_id, slow, 3, -1, token=1)
    assert led.requeue_expired(job_id) == 3
    other = led.start_run(job_id, "worker", exclusive=False)
    led.claim(job_id, other, 3, 60, token=1)
    led.record(other, [Outcome(taken[0].id, ItemState.FAILED, 5, error_class="bad_request", claim=1),
                       Outcome(taken[1].id, ItemState.INVALID_OUTPUT, 3, error_class="schema_invalid", claim=1),
                       Outcome(taken[2].id, ItemState.SUCCEEDED, 1, output="first", claim=1)], [])
    led.record(slow, [Outcome(t.id, ItemState.SUCCEEDED, 1, status_code=200, output="late", claim=1) for t in taken],
               [])
    assert [(r.state, r.output, r.error_class) for r in backend.items(job_id)] == [
        (ItemState.SUCCEEDED, "late", None), (ItemState.SUCCEEDED, "late", None), (ItemState.SUCCEEDED, "first", None),
    ]
    assert led.heartbeat(job_id, other, 60) == {}  # a landed answer ends every claim of the item


def test_re_ask_progress_and_a_put_back_in_one_batch_keep_the_re_ask(backend: Backend) -> None:
    """A stop right after a re-ask was noted puts the item back in the same batch: the re-ask must
    be kept, or the resume pays for the first answer again."""
    led = backend.ledger
    job_id = backend.add_job(1)
    run = led.start_run(job_id, "submit", exclusive=False)
    item = led.claim(job_id, run, 1, 60, token=1)[0]
    followups = '[["{}", "answer with a name"]]'
    led.record(run, [Outcome(item.id, ItemState.RUNNING, 1, followups=followups, claim=1)], [])
    assert backend.states(job_id) == [ItemState.RUNNING]
    led.record(run, [Outcome(item.id, ItemState.RUNNING, 1, followups=followups, claim=1),
                     Outcome(item.id, ItemState.PENDING, 1, claim=1)], [])
    assert led.claim(job_id, run, 1, 60, token=2)[0].followups == followups
    led.record(run, [Outcome(item.id, ItemState.SUCCEEDED, 1, output="x", claim=2)], [])
    assert backend.items(job_id)[0].state == ItemState.SUCCEEDED


# -- the response cache -----------------------------------------------------------------


def test_find_cached_gives_the_newest_success_per_key_and_points_at_who_paid(backend: Backend) -> None:
    led = backend.ledger
    first_job, second_job = backend.add_job(3), backend.add_job(2)
    run = led.start_run(first_job, "worker", exclusive=False)
    a, b, c = led.claim(first_job, run, 3, 60, token=1)
    led.record(run, [
        Outcome(a.id, ItemState.SUCCEEDED, 1, status_code=200, response="ra", output="A", request_id="q1",
                input_tokens=1, output_tokens=2, request_hash="k1", claim=1),
        Outcome(b.id, ItemState.FAILED, 1, error_class="client_error", request_hash="k2", claim=1),
        Outcome(c.id, ItemState.INVALID_OUTPUT, 1, output="?", request_hash="k3", claim=1),
    ], [])
    run2 = led.start_run(second_job, "worker", exclusive=False)
    d, e = led.claim(second_job, run2, 2, 60, token=1)
    led.record(run2, [
        Outcome(d.id, ItemState.SUCCEEDED, 1, status_code=200, response="ra", output="A", request_hash="k1",
                cached_from=a.id, claim=1),
        Outcome(e.id, ItemState.SUCCEEDED, 1, status_code=200, response="rb", output="B", request_hash="k2", claim=1),
    ], [])
    found = led.find_cached({"k1", "k2", "k3", "k4"})
    assert set(found) == {"k1", "k2"}  # failed and invalid answers are never reused
    assert (found["k1"].item_id, found["k1"].output, found["k1"].request_id) == (a.id, "A", None)  # the copy's, pointing at a
    assert (found["k2"].item_id, found["k2"].response, found["k2"].status_code) == (e.id, "rb", 200)
    assert led.find_cached(set()) == {}
    only_first = led.find_cached({"k1"})
    assert only_first["k1"].item_id == a.id


# -- the job's rate budgets -----------------------------------------------------------


def test_a_rate_bucket_starts_full_and_a_take_past_it_waits_for_the_refill(backend: Backend) -> None:
    led = backend.ledger
    job_id = backend.add_job(1)
    assert led.take_rate_budget(job_id, "requests", 5) == 0.0  # no bucket: no wait
    led.set_rate_budget(job_id, "requests", 1.0, 10.0)
    assert led.take_rate_budget(job_id, "requests", 10) == 0.0
    wait = led.take_rate_budget(job_id, "requests", 5)
    assert 4.5 < wait <= 5.0
    led.set_rate_budget(job_id, "requests", 10.0, 10.0)  # a newer run's limit: the level stays, the rate is new
    assert 0.45 < led.take_rate_budget(job_id, "requests", 0) <= 0.5
    led.set_rate_budget(job_id, "tokens", 0.0, 100.0)
    assert led.take_rate_budget(job_id, "tokens", 1000) == 0.0  # no rate: never waits


def test_an_attempt_keeps_its_error_message_and_time_to_first_byte(backend: Backend) -> None:
    led = backend.ledger
    job_id = backend.add_job(1)
    run = led.start_run(job_id, "submit", exclusive=True)
    [item] = led.claim(job_id, run, 1, 60, exclusive=True, token=1)
    led.record(
        run,
        [Outcome(item.id, ItemState.SUCCEEDED, 2, status_code=200, output="x", finished_at=time.time(), claim=item.claim)],
        [
            _attempt(job_id, item.id, run, 1, status_code=500, error_class="server_error", error_message="HTTP 500: boom"),
            _attempt(job_id, item.id, run, 2, ttfb_ms=12.5),
        ],
    )
    if isinstance(led, InMemoryLedger):
        kept = [(a.error_message, a.ttfb_ms) for a in led.attempts(job_id)]
    else:
        assert isinstance(led, Ledger)
        kept = [(a.error_message, a.ttfb_ms) for a in LedgerQueries(led.engine).item_attempts(job_id, [item.id])[item.id]]
    assert kept == [("HTTP 500: boom", None), (None, 12.5)]
    assert backend.items(job_id)[0].error_message is None  # the item's own message is cleared by its success
