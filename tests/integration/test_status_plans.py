"""``status`` reads no job's items one by one, on a SQLite ledger made either way: by the migrations
(a ledger upgraded over the versions) or at once (a new ledger). Without planner statistics SQLite
picks among indexes that tie on ``job_id`` by their order in the schema, which the two ways differ in;
a read of the reused answers once took ``uq_items_job_line`` there and read 1,000,000 items (0.22 s)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from batchrun.ledger import Ledger
from batchrun.ledger.basics import resolve_db_url
from batchrun.ledger.engine import create_ledger_engine, upgrade_to_head
from batchrun.ledger.quick import open_quick_reader
from batchrun.report import job_status
from batchrun.spec import Overrides, spec_for_batch_input

# Indexes that hold every item of a job: a status query searching one of them by job_id alone reads them all.
WHOLE_JOB = ("uq_items_job_line", "uq_items_job_custom_id")


def _by_migrations(path: Path) -> None:
    engine = create_ledger_engine(resolve_db_url(path))
    assert upgrade_to_head(engine, migrate_new=True)
    engine.dispose()


@pytest.mark.parametrize("made_by", ["migrations", "a new ledger"])
def test_status_searches_only_the_indexes_that_hold_what_it_counts(
    tmp_path: Path, made_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "l.db"
    if made_by == "migrations":
        _by_migrations(db)
    with Ledger.open(db) as ledger:
        job_id = ledger.create_job(spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m")),
                                   input_path="in.jsonl", input_hash="h")
        ledger.insert_items(job_id, [{"line": i, "custom_id": str(i), "url": "/v1/chat/completions", "body": "{}",
                                      "state": "pending"} for i in range(1, 50)])
    with sqlite3.connect(db) as conn:  # one answer reused from another item: both readers count it
        conn.execute("UPDATE items SET state = 'succeeded', cached_from = 1 WHERE line = 2")
    with Ledger.open(db) as ledger:
        assert job_status(ledger, job_id)["cached"] == 1  # through SQLAlchemy (status --watch, PostgreSQL)
    statements: list[str] = []
    real_connect = sqlite3.connect

    def traced(*args: object, **kwargs: object) -> sqlite3.Connection:
        conn = real_connect(*args, **kwargs)  # type: ignore[arg-type]
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    reader = open_quick_reader(resolve_db_url(db))
    assert reader is not None
    try:
        assert job_status(reader, job_id)["cached"] == 1
    finally:
        reader.close()
    monkeypatch.undo()
    plain = real_connect(db)
    on_items = [s for s in set(statements) if " FROM items " in s]
    assert any("cached_from IS NOT NULL" in s for s in on_items)  # the check is not vacuous
    for sql in on_items:
        plan = " | ".join(row[3] for row in plain.execute("EXPLAIN QUERY PLAN " + sql))
        assert "SCAN items" not in plan and not any(f"INDEX {name} (job_id=?)" in plan for name in WHOLE_JOB), (sql, plan)
    plain.close()
