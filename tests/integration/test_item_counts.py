"""The counts ``status`` and ``list`` read (``item_counts``, kept by the database) equal COUNT(*) over
the items after any mix of writes: the ledger's own transitions and a plain SQL update alike."""

from __future__ import annotations

import random
import time

from sqlalchemy import func, select, text

from batchrun.ledger import Ledger, LedgerQueries, Outcome
from batchrun.ledger.models import items
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


def check(ledger: Ledger, jobs: list[int], step: str) -> None:
    listed = {job.id: counts for job, counts in ledger.list_jobs()}
    for job_id in jobs:
        expected = counted_by_hand(ledger, job_id)
        assert LedgerQueries(ledger.engine).counts(job_id) == expected, step
        assert listed[job_id] == expected, step


def test_counts_stay_exact_under_a_random_mix_of_writes(ledger: Ledger) -> None:
    rng = random.Random(18)
    jobs = [ledger.create_job(SPEC, input_path=f"in{j}.jsonl", input_hash=f"h{j}-{time.time_ns()}") for j in range(2)]
    lines = dict.fromkeys(jobs, 0)
    runs = {job_id: ledger.start_run(job_id, "submit", exclusive=True) for job_id in jobs}
    tokens = dict.fromkeys(jobs, 0)
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
        ledger.record(runs[job_id], outcomes, [])

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
