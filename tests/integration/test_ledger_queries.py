"""LedgerQueries: the read-only questions status, report, compare and export ask, on both backends.

Each test writes a small job through the Ledger's own calls and reads it back;
tests/integration/test_report.py checks the same figures end to end against the
fake server's request log.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy

from batchrun.ledger import AttemptRecord, Ledger, LedgerQueries, Outcome
from batchrun.states import ItemState

from .test_ledger import SPEC, make_job


def _attempt(
    job_id: int, item_id: int, number: int, *, latency_ms: float = 100.0, status_code: int = 200,
    error_class: str | None = None, **usage: Any,
) -> AttemptRecord:
    """Attempt ``number`` of an item, started at 1000 + number, waiting 1 ms in the queue."""
    return AttemptRecord(job_id, item_id, "r", number, 1000.0 + number, 1.0, latency_ms, status_code, error_class, **usage)


def _answered_job(ledger: Ledger) -> tuple[int, list[int]]:
    """Five items: c1, c2 succeeded (c2 after a 500), c3 failed on a 400, c4 reused c1's answer, c5 pending."""
    job_id = make_job(ledger, 5)
    run = ledger.start_run(job_id, "test", exclusive=True)
    ids = [c.id for c in ledger.claim(job_id, run, 4, 60)]
    ledger.record(
        run,
        [
            Outcome(ids[0], ItemState.SUCCEEDED, 1, status_code=200, output="a", finished_at=2000.0, cost_usd=0.25),
            Outcome(ids[1], ItemState.SUCCEEDED, 2, status_code=200, output="b", finished_at=2010.0, cost_usd=0.5),
            Outcome(ids[2], ItemState.FAILED, 1, status_code=400, error_class="bad_request",
                    error_message="HTTP 400: no such model", finished_at=2005.0),
            Outcome(ids[3], ItemState.SUCCEEDED, 0, status_code=200, output="a", finished_at=2001.0, cached_from=ids[0]),
        ],
        [
            _attempt(job_id, ids[0], 1, latency_ms=40.0, input_tokens=10, output_tokens=2, cost_usd=0.25),
            _attempt(job_id, ids[1], 2, latency_ms=900.0, status_code=500, error_class="server_error"),
            _attempt(job_id, ids[1], 3, latency_ms=60.0, input_tokens=20, output_tokens=4, cached_tokens=8,
                     cost_usd=0.5, ttft_ms=15.0),
            _attempt(job_id, ids[2], 4, latency_ms=5.0, status_code=400, error_class="bad_request"),
        ],
    )
    return job_id, ids


def test_counts_totals_and_spend(ledger: Ledger) -> None:
    job_id, _ = _answered_job(ledger)
    queries = LedgerQueries(ledger.engine)
    counts = queries.counts(job_id)
    assert set(counts) == {s.value for s in ItemState}  # every state, 0 when none
    assert (counts["succeeded"], counts["failed"], counts["running"], counts["pending"]) == (3, 1, 0, 1)
    assert queries.cached_count(job_id) == 1
    totals = queries.attempt_totals(job_id)
    assert (totals.requests, totals.clean, totals.input_tokens, totals.output_tokens, totals.cached_tokens) == (
        4, 2, 30, 6, 8
    )
    assert totals.cost_usd == pytest.approx(0.75) == queries.spent_usd(job_id)
    assert (totals.first_started_at, totals.last_started_at) == (1001.0, 1004.0)
    assert queries.requests_per_item(job_id) == {1: 2, 2: 1}  # c1 and c3 once, c2 twice


def test_distributions_cover_clean_answers_except_queue_wait(ledger: Ledger) -> None:
    job_id, _ = _answered_job(ledger)
    queries = LedgerQueries(ledger.engine)
    latency = queries.attempt_distribution(job_id, "latency_ms", (50, 99))
    assert (latency.count, latency.minimum, latency.maximum, latency.mean) == (2, 40.0, 60.0, 50.0)
    assert latency.percentiles == {50: 40.0, 99: 60.0}  # nearest rank
    assert queries.attempt_distribution(job_id, "queue_wait_ms").count == 4
    assert queries.attempt_distribution(job_id, "ttft_ms").percentiles == {50: 15.0, 90: 15.0, 99: 15.0}
    assert queries.attempt_distribution(make_job(ledger, 1), "latency_ms").count == 0
    assert queries.attempt_histogram(job_id, "latency_ms", 0.0, 50.0) == {0: 1, 1: 1}
    assert queries.attempt_histogram(job_id, "latency_ms", 50.0, 50.0) == {0: 1}  # values from ``low`` on
    with pytest.raises(ValueError, match="unknown attempt measure"):
        queries.attempt_distribution(job_id, "cost_usd")


def test_throughput_leaves_reused_answers_out(ledger: Ledger) -> None:
    job_id, _ = _answered_job(ledger)
    queries = LedgerQueries(ledger.engine)
    assert queries.succeeded_span(job_id) == (2, 2000.0, 2010.0)
    assert queries.succeeded_per_interval(job_id, 2000.0, 5.0) == {0: 1, 2: 1}


def test_errors_by_class_and_by_status(ledger: Ledger) -> None:
    job_id, _ = _answered_job(ledger)
    queries = LedgerQueries(ledger.engine)
    by_class = {g.key: (g.attempts, g.items, g.example) for g in queries.errors_by_class(job_id)}
    assert by_class == {"bad_request": (1, 1, "HTTP 400: no such model"), "server_error": (1, 0, None)}
    by_status = {g.key: (g.attempts, g.items, g.example) for g in queries.errors_by_status(job_id)}
    assert by_status == {400: (1, 1, "HTTP 400: no such model"), 500: (1, 0, None)}


def test_an_error_met_only_by_items_that_later_succeeded_has_its_attempts_message(ledger: Ledger) -> None:
    job_id = make_job(ledger, 2)
    run = ledger.start_run(job_id, "test", exclusive=True)
    ids = [c.id for c in ledger.claim(job_id, run, 2, 60)]
    ledger.record(
        run,
        [Outcome(i, ItemState.SUCCEEDED, 2, status_code=200, output="a", finished_at=2000.0) for i in ids],
        [
            _attempt(job_id, ids[0], 1, status_code=500, error_class="server_error", error_message="HTTP 500: boom"),
            _attempt(job_id, ids[0], 2),
            _attempt(job_id, ids[1], 3, status_code=None, error_class="timeout",  # type: ignore[arg-type]
                     error_message="timed out after 5 s"),
            _attempt(job_id, ids[1], 4, status_code=503, error_class="server_error", error_message="HTTP 503: busy"),
            _attempt(job_id, ids[1], 5),
        ],
    )
    queries = LedgerQueries(ledger.engine)
    by_class = {g.key: (g.attempts, g.items, g.example) for g in queries.errors_by_class(job_id)}
    assert by_class["timeout"] == (1, 0, "timed out after 5 s")
    assert by_class["server_error"][:2] == (2, 0) and by_class["server_error"][2] in ("HTTP 500: boom", "HTTP 503: busy")
    by_status = {g.key: (g.attempts, g.items, g.example) for g in queries.errors_by_status(job_id)}
    assert by_status == {500: (1, 0, "HTTP 500: boom"), 503: (1, 0, "HTTP 503: busy"), None: (1, 0, "timed out after 5 s")}


def test_an_attempts_example_is_a_seek_into_the_errors_index(tmp_path: Path) -> None:
    with Ledger.open(tmp_path / "l.db") as ledger, ledger.engine.connect() as conn:
        from batchrun.ledger.models import attempts as a

        query = (
            sqlalchemy.select(a.c.error_message)
            .where(a.c.job_id == 1, a.c.error_class == "server_error", a.c.error_message.is_not(None),
                   a.c.status_code == 500)
            .limit(1)
        )
        sql = str(query.compile(conn.engine, compile_kwargs={"literal_binds": True}))
        plan = " ".join(row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
    assert "ix_attempts_errors" in plan, plan


def test_the_answer_splits_queue_wait_and_latency_are_seeks_into_their_index(tmp_path: Path) -> None:
    from batchrun.ledger.models import attempts as a

    base = [a.c.job_id == 1, a.c.error_class.is_(None), a.c.ttfb_ms.is_not(None)]
    with Ledger.open(tmp_path / "l.db") as ledger, ledger.engine.connect() as conn:
        for measure, index in (("queue_wait_ms", "queue_wait"), ("latency_ms", "latency")):
            column = a.c[measure]
            for order in (column, column.desc()):
                query = sqlalchemy.select(column).where(*base, column.is_not(None)).order_by(order).limit(1).offset(5)
                sql = str(query.compile(conn.engine, compile_kwargs={"literal_binds": True}))
                plan = " ".join(row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
                assert f"ix_attempts_{index} " in plan and "TEMP B-TREE" not in plan, plan


def test_attempt_messages_are_redacted_and_shortened() -> None:
    from batchrun.ledger.store import ATTEMPT_MESSAGE_CHARS, attempt_message
    from batchrun.redact import register_secret

    register_secret("sk-attempt-secret-123")
    kept = attempt_message("HTTP 401: key sk-attempt-secret-123 refused " + "x" * 2000)
    assert kept is not None and "sk-attempt-secret-123" not in kept and "[REDACTED]" in kept
    assert len(kept) == ATTEMPT_MESSAGE_CHARS and kept.endswith("…")
    assert attempt_message("short") == "short" and attempt_message(None) is None


def test_the_answer_split_covers_clean_answers_with_a_ttfb(ledger: Ledger) -> None:
    job_id = make_job(ledger, 4)
    run = ledger.start_run(job_id, "test", exclusive=True)
    ids = [c.id for c in ledger.claim(job_id, run, 4, 60)]
    ledger.record(
        run,
        [Outcome(i, ItemState.SUCCEEDED, 1, status_code=200, output="a", finished_at=2000.0) for i in ids],
        [
            _attempt(job_id, ids[0], 1, latency_ms=100.0, ttfb_ms=20.0),
            _attempt(job_id, ids[1], 2, latency_ms=300.0, ttfb_ms=250.0),
            _attempt(job_id, ids[2], 3, latency_ms=50.0, ttfb_ms=40.0),
            _attempt(job_id, ids[3], 4, latency_ms=7.0),  # no TTFB (a ledger row from before 0010): left out
            _attempt(job_id, ids[3], 5, latency_ms=900.0, ttfb_ms=1.0, status_code=500, error_class="server_error"),
        ],
    )
    split = LedgerQueries(ledger.engine).answer_split(job_id, (50, 99))
    assert {m: (d.count, d.percentiles) for m, d in split.items()} == {
        "queue_wait_ms": (3, {50: 1.0, 99: 1.0}),
        "ttfb_ms": (3, {50: 40.0, 99: 250.0}),
        "latency_ms": (3, {50: 100.0, 99: 300.0}),
    }
    assert LedgerQueries(ledger.engine).answer_split(make_job(ledger, 1))["ttfb_ms"].count == 0


def test_recent_latencies_are_clean_answers_oldest_first(ledger: Ledger) -> None:
    job_id, _ = _answered_job(ledger)
    queries = LedgerQueries(ledger.engine)
    assert queries.recent_latencies(job_id, 10) == [0.04, 0.06]
    assert queries.recent_latencies(job_id, 1) == [0.06]


def test_iter_items_in_input_order_across_chunks(ledger: Ledger) -> None:
    job_id, ids = _answered_job(ledger)
    rows = list(LedgerQueries(ledger.engine).iter_items(job_id, chunk=2))
    assert [r.line for r in rows] == [1, 2, 3, 4, 5]
    assert [r.item_id for r in rows[:4]] == ids
    assert (rows[0].state, rows[0].output, rows[0].input_tokens, rows[0].cost_usd) == ("succeeded", "a", None, 0.25)
    assert (rows[2].error_class, rows[2].status_code) == ("bad_request", 400)
    assert rows[3].cached_from == ids[0] and rows[4].state == ItemState.PENDING


def test_shadowed_rejections_are_rejected_lines_whose_custom_id_is_taken(ledger: Ledger) -> None:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash=f"h{time.time_ns()}")
    rejected = {"state": ItemState.REJECTED, "url": None, "body": None, "error_class": "invalid_json"}
    ledger.insert_items(
        job_id,
        [
            {"line": 1, "custom_id": "a", "url": None, "body": "{}", "state": ItemState.PENDING},
            {"line": 2, "custom_id": "a", **rejected},  # a's id is taken by line 1
            {"line": 3, "custom_id": "b", **rejected},  # the first line with b: it stands for b
            {"line": 4, "custom_id": "b", **rejected},  # b again
        ],
    )
    by_line = {r.line: r.item_id for r in LedgerQueries(ledger.engine).iter_items(job_id)}
    assert LedgerQueries(ledger.engine).shadowed_rejections(job_id) == {by_line[2], by_line[4]}


def test_two_jobs_shared_outputs_and_their_differences(ledger: Ledger) -> None:
    def job(outputs: dict[int, str | None]) -> int:
        job_id = make_job(ledger, 6)
        run = ledger.start_run(job_id, "test", exclusive=True)
        claimed = ledger.claim(job_id, run, 6, 60)
        ledger.record(
            run,
            [
                Outcome(c.id, ItemState.SUCCEEDED, 1, output=outputs[i]) if outputs.get(i)
                else Outcome(c.id, ItemState.FAILED, 1, error_class="server_error")
                for i, c in enumerate(claimed, 1)
            ],
            [],
        )
        return job_id

    job_a = job({1: "x", 2: "y", 3: "z", 4: "w", 5: "v"})
    job_b = job({1: "x", 2: "Y", 3: "z", 4: "W", 6: "u"})
    queries = LedgerQueries(ledger.engine)
    shared = queries.shared_outputs(job_a, job_b)
    assert (shared.shared, shared.both_succeeded) == (6, 4)
    assert list(queries.iter_output_differences(job_a, job_b, "output", chunk=1)) == [("c2", "y", "Y"), ("c4", "w", "W")]
    with pytest.raises(ValueError, match="cannot compare"):
        list(queries.iter_output_differences(job_a, job_b, "response"))


def test_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    with Ledger.open(db) as ledger:
        job_id = make_job(ledger, 3)
        writer = sqlite3.connect(db, isolation_level=None, timeout=0.1)
        writer.execute("BEGIN IMMEDIATE")  # another process mid-write
        try:
            started = time.monotonic()
            assert LedgerQueries(ledger.engine).counts(job_id)["pending"] == 3
            assert len(list(LedgerQueries(ledger.engine).iter_items(job_id))) == 3
            assert time.monotonic() - started < 1
        finally:
            writer.execute("ROLLBACK")
            writer.close()
