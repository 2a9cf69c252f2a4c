"""What ``status`` and ``list`` read from the tables the database keeps (``item_counts``,
``attempt_totals``, ``attempt_histogram``, and the distributions' indexes) equals what a full scan
of the items and attempts gives, after any mix of writes: the ledger's own transitions, replayed
writes and a plain SQL update alike."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from sqlalchemy import func, select, text

from batchrun.ledger import AttemptRecord, Ledger, LedgerQueries, Outcome
from batchrun.ledger.models import attempts, items
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ItemState, no_counts

SPEC = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))


def counted_by_hand(ledger: Ledger, job_id: int) -> dict[str, int]:
    counts = no_counts()
    with ledger.engine.connect() as conn:
        for state, n in conn.execute(
            select(items.c.state, func.count()).where(items.c.job_id == job_id).group_by(items.c.state)
        ):
            counts[state] = n
    return counts


def nearest_rank(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[max(1, -(-p * len(ordered) // 100)) - 1]


def check_attempts(ledger: Ledger, job_id: int, step: str) -> None:
    """Totals, requests per item and distributions against the attempts read one by one."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(select(attempts).where(attempts.c.job_id == job_id)).all()
    queries = LedgerQueries(ledger.engine)
    totals = queries.attempt_totals(job_id)
    assert totals.requests == len(rows), step
    assert totals.clean == sum(1 for r in rows if r.error_class is None), step
    assert totals.input_tokens == sum(r.input_tokens or 0 for r in rows), step
    assert totals.output_tokens == sum(r.output_tokens or 0 for r in rows), step
    assert totals.cost_usd == pytest.approx(sum(r.cost_usd or 0.0 for r in rows)), step
    assert totals.first_started_at == min((r.started_at for r in rows), default=None), step
    assert totals.last_started_at == max((r.started_at for r in rows), default=None), step
    per_item = Counter(Counter(r.item_id for r in rows).values())
    assert queries.requests_per_item(job_id) == dict(per_item), step
    for measure, covers in (
        ("latency_ms", lambda r: r.error_class is None and r.latency_ms is not None),
        ("queue_wait_ms", lambda r: r.queue_wait_ms is not None),
        ("ttft_ms", lambda r: r.error_class is None and r.ttft_ms is not None),
    ):
        values = [getattr(r, measure) for r in rows if covers(r)]
        dist = queries.attempt_distribution(job_id, measure, (1, 50, 90, 99, 100))
        assert dist.count == len(values), (step, measure)
        if values:
            assert dist.percentiles == {p: nearest_rank(values, p) for p in (1, 50, 90, 99, 100)}, (step, measure)
            assert (dist.minimum, dist.maximum) == (min(values), max(values)), (step, measure)
            assert dist.mean == pytest.approx(sum(values) / len(values)), (step, measure)


def check(ledger: Ledger, jobs: list[int], step: str) -> None:
    listed = {job.id: counts for job, counts in ledger.list_jobs()}
    for job_id in jobs:
        expected = counted_by_hand(ledger, job_id)
        assert LedgerQueries(ledger.engine).counts(job_id) == expected, step
        assert listed[job_id] == expected, step
        check_attempts(ledger, job_id, step)


@pytest.mark.slow
def test_counts_stay_exact_under_a_random_mix_of_writes(ledger: Ledger) -> None:
    rng = random.Random(18)
    jobs = [ledger.create_job(SPEC, input_path=f"in{j}.jsonl", input_hash=f"h{j}-{time.time_ns()}") for j in range(2)]
    lines = dict.fromkeys(jobs, 0)
    runs = {job_id: ledger.start_run(job_id, "submit", exclusive=True) for job_id in jobs}
    tokens = dict.fromkeys(jobs, 0)
    seq = dict.fromkeys(jobs, 0)
    held: dict[int, list[tuple[int, int]]] = {job_id: [] for job_id in jobs}

    def ingest(job_id: int) -> None:
        rows = []
        for _ in range(rng.randint(1, 40)):
            lines[job_id] += 1
            n = lines[job_id]
            # Some custom_ids repeat: the ledger rejects the later line (a duplicate).
            custom_id = f"c{rng.randint(1, n)}" if rng.random() < 0.1 else f"c{n}"
            bad = rng.random() < 0.05
            rows.append({"line": n, "custom_id": custom_id, "url": None, "body": None if bad else "{}",
                         "state": ItemState.REJECTED if bad else ItemState.PENDING,
                         **({"error_class": "bad_json", "error_message": "x"} if bad else {})})
        ledger.insert_items(job_id, rows, run_id=runs[job_id])
        if rng.random() < 0.3:  # an ingest replayed after a lost acknowledgement stores nothing twice
            ledger.insert_items(job_id, rows, run_id=runs[job_id])

    def claim(job_id: int) -> None:
        tokens[job_id] += 1
        got = ledger.claim(job_id, runs[job_id], rng.randint(1, 30), 60.0, exclusive=True, token=tokens[job_id])
        held[job_id] += [(item.id, item.claim) for item in got]

    def record(job_id: int) -> None:
        rng.shuffle(held[job_id])
        take, held[job_id] = held[job_id][: rng.randint(0, 20)], held[job_id][20:]
        states = [ItemState.SUCCEEDED, ItemState.FAILED, ItemState.INVALID_OUTPUT, ItemState.PENDING, ItemState.RUNNING]
        outcomes = [Outcome(item_id, rng.choice(states), 1, claim=claim, finished_at=time.time()) for item_id, claim in take]
        sent = []
        for item_id, _ in take:
            for number in range(rng.randint(0, 3)):  # 0-3 requests each, some failed, some streamed
                seq[job_id] += 1
                failed = rng.random() < 0.3
                sent.append(AttemptRecord(
                    job_id, item_id, runs[job_id], number + 1, time.time() - rng.random() * 100,
                    rng.choice([None, round(rng.random() * 50, 1)]), round(rng.random() * 900, 1),
                    500 if failed else 200, "server_error" if failed else None,
                    input_tokens=rng.randint(1, 99), output_tokens=None if failed else rng.randint(1, 99),
                    cost_usd=rng.random() / 100, ttft_ms=rng.choice([None, round(rng.random() * 90, 1)]),
                    seq=seq[job_id],
                ))
        ledger.record(runs[job_id], outcomes, sent)
        if sent and not ledger.is_sqlite and rng.random() < 0.3:  # replayed after a lost acknowledgement (PostgreSQL)
            ledger.record(runs[job_id], outcomes, sent)

    def sql_update(job_id: int) -> None:  # a path the ledger does not know of (batch mode, a future one)
        state = rng.choice([ItemState.SUBMITTED, ItemState.PENDING, ItemState.SUCCEEDED])
        with ledger.engine.begin() as conn:
            conn.execute(
                text("UPDATE items SET state = :s WHERE job_id = :j AND state != 'rejected' AND id % 7 = :k"),
                {"s": str(state), "j": job_id, "k": rng.randint(0, 6)},
            )

    def verdicts(job_id: int) -> None:  # revalidate: succeeded <-> invalid_output
        with ledger.engine.connect() as conn:
            ids = conn.execute(select(items.c.id).where(
                items.c.job_id == job_id, items.c.state.in_([ItemState.SUCCEEDED, ItemState.INVALID_OUTPUT])
            ).limit(5)).scalars().all()
        ledger.set_verdicts([
            (item_id, rng.choice([ItemState.SUCCEEDED, ItemState.INVALID_OUTPUT]), None, None, None, None) for item_id in ids
        ])

    actions = {
        "ingest": ingest,
        "claim": claim,
        "record": record,
        "retry": lambda j: ledger.retry(j, [ItemState.FAILED, ItemState.INVALID_OUTPUT]),
        "release": lambda j: (ledger.release_held(j, runs[j]), held[j].clear()),
        "requeue": lambda j: ledger.requeue_orphans(j, runs[j]),
        "verdicts": verdicts,
        "sql": sql_update,
        "heartbeat": lambda j: ledger.heartbeat(j, runs[j], 60.0, exclusive=True),
        "cancel": lambda j: ledger.cancel(j) if rng.random() < 0.2 else None,
    }
    names = list(actions)
    for step in range(120):
        job_id = rng.choice(jobs)
        name = "ingest" if step < 4 else rng.choice(names)
        actions[name](job_id)
        if step % 10 == 0 or name == "sql":
            check(ledger, jobs, f"step {step}: {name}")
    check(ledger, jobs, "end")
    for job_id in jobs:
        ledger.finish_ingest(job_id, run_id=runs[job_id])
        assert ledger.get_job(job_id).total == sum(counted_by_hand(ledger, job_id).values())
    check(ledger, jobs, "after the fold")
    assert sum(sum(counted_by_hand(ledger, j).values()) for j in jobs) > 40
    assert sum(LedgerQueries(ledger.engine).attempt_totals(j).requests for j in jobs) > 40  # not vacuous


def test_a_job_without_items_counts_zero_everywhere(ledger: Ledger) -> None:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash=f"h{time.time_ns()}")
    assert LedgerQueries(ledger.engine).counts(job_id) == no_counts()
    assert {job.id: counts for job, counts in ledger.list_jobs()}[job_id] == no_counts()


def test_postgresql_folds_its_appended_rows(ledger: Ledger) -> None:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash=f"h{time.time_ns()}")
    for start in range(0, 50, 10):
        ledger.insert_items(job_id, [{"line": i, "custom_id": f"c{i}", "url": None, "body": "{}",
                                      "state": ItemState.PENDING} for i in range(start + 1, start + 11)])
    run_id = ledger.start_run(job_id, "submit", exclusive=True)
    ledger.claim(job_id, run_id, 20, 60.0, exclusive=True, token=1)
    ledger.fold_counts(job_id)
    with ledger.engine.connect() as conn:
        rows = conn.execute(text("SELECT state, n FROM item_counts WHERE job_id = :j ORDER BY state"), {"j": job_id}).all()
    assert [tuple(r) for r in rows if r[1]] == [("pending", 30), ("running", 20)]
    assert len(rows) == 2 if ledger.is_sqlite else len(rows) <= 2
    assert LedgerQueries(ledger.engine).counts(job_id) == counted_by_hand(ledger, job_id)
