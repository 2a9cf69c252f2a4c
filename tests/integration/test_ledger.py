from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from batchrun.errors import JobLockedError, JobNotFoundError, LedgerError
from batchrun.ledger import AttemptRecord, Ledger, LedgerQueries, Outcome
from batchrun.ledger.engine import SCHEMA_HEAD, alembic_config, create_ledger_engine, resolve_db_url, upgrade_to_head
from batchrun.ledger.models import metadata
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ItemState

SPEC = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))


def make_job(ledger: Ledger, n: int) -> int:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash=f"h{time.time_ns()}")
    ledger.insert_items(
        job_id,
        [{"line": i, "custom_id": f"c{i}", "url": None, "body": "{}", "state": ItemState.PENDING} for i in range(1, n + 1)],
    )
    ledger.finish_ingest(job_id)
    return job_id


def test_migration_from_blank_to_head_matches_models(db_url: str) -> None:
    engine = create_ledger_engine(resolve_db_url(db_url))
    try:
        assert upgrade_to_head(engine, migrate_new=True) is True  # every migration, from a blank database
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn)
            assert ctx.get_current_revision() == SCHEMA_HEAD
            assert compare_metadata(ctx, metadata) == []
            assert {"jobs", "items", "attempts", "runs", "exports"} <= set(inspect(conn).get_table_names())
        assert upgrade_to_head(engine) is False  # opening again applies nothing
    finally:
        engine.dispose()


def _sqlite_schema(path: Path) -> dict[str, object]:
    """What a SQLite schema means, read back from the file (column order aside: Alembic appends added columns)."""
    con = sqlite3.connect(path)
    try:
        schema: dict[str, object] = {}
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"):
            schema[f"{table} columns"] = sorted(row[1:] for row in con.execute(f"PRAGMA table_xinfo({table})"))
            schema[f"{table} foreign keys"] = sorted(row[2:] for row in con.execute(f"PRAGMA foreign_key_list({table})"))
            for _, index, unique, origin, partial in con.execute(f"PRAGMA index_list({table})"):
                columns = [(name, desc, coll, key) for _, _, name, desc, coll, key in con.execute(f"PRAGMA index_xinfo({index})")]
                schema[f"{table} index {index}"] = (unique, origin, partial, columns)
        schema["index sql"] = sorted(
            (name, " ".join(sql.split()))
            for name, sql in con.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        )
        schema["other objects"] = sorted(
            (kind, name, " ".join((sql or "").split()))  # triggers: what they do, not only their names
            for kind, name, sql in con.execute("SELECT type, name, sql FROM sqlite_master WHERE type NOT IN ('table', 'index')")
        )
        schema["version"] = con.execute("SELECT version_num FROM alembic_version").fetchall()
        return schema
    finally:
        con.close()


def test_a_new_sqlite_ledger_is_made_at_head_and_matches_the_migrated_one(tmp_path: Path) -> None:
    migrated = create_ledger_engine(resolve_db_url(tmp_path / "migrated.db"))
    upgrade_to_head(migrated, migrate_new=True)
    migrated.dispose()
    Ledger.open(tmp_path / "new.db").close()  # the way a first submit makes one
    new, reference = _sqlite_schema(tmp_path / "new.db"), _sqlite_schema(tmp_path / "migrated.db")
    assert len(new) > 20 and new["version"] == [(SCHEMA_HEAD,)]
    assert new == reference


def test_a_new_sqlite_ledger_opens_without_alembic(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom batchrun.ledger import Ledger\n"
        f"Ledger.open({str(tmp_path / 'l.db')!r}).close()\nprint('alembic' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_schema_head_constant_matches_the_migrations() -> None:
    from alembic.script import ScriptDirectory

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == SCHEMA_HEAD


def test_sqlite_pragmas(tmp_path: Path) -> None:
    with Ledger.open(tmp_path / "l.db") as ledger, ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL: results survive power loss


def test_db_upgrade_command_and_alembic_config(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    proc = subprocess.run(
        [sys.executable, "-m", "batchrun", "db", "upgrade", "--db", str(db)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        assert conn.execute(text("select version_num from alembic_version")).scalar() == SCHEMA_HEAD
    engine.dispose()
    assert Path(alembic_config().get_main_option("script_location"), "env.py").is_file()


def test_unreachable_ledger_is_a_clear_error() -> None:
    with pytest.raises(LedgerError, match="cannot open ledger postgresql\\+psycopg://nobody:\\*\\*\\*@127.0.0.1:1/x"):
        Ledger.open("postgresql+psycopg://nobody:secret@127.0.0.1:1/x")


def test_claim_leases_in_order_and_never_twice(ledger: Ledger) -> None:
    job_id = make_job(ledger, 10)
    run_a = ledger.start_run(job_id, "test", exclusive=False)
    run_b = ledger.start_run(job_id, "test", exclusive=False)
    first = ledger.claim(job_id, run_a, 4, 60)
    second = ledger.claim(job_id, run_b, 100, 60)
    assert [c.custom_id for c in first] == ["c1", "c2", "c3", "c4"]
    assert [c.custom_id for c in second] == [f"c{i}" for i in range(5, 11)]
    assert ledger.claim(job_id, run_a, 10, 60) == []
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.RUNNING] == 10


def test_outcomes_land_on_held_items_and_the_first_answer_wins(ledger: Ledger) -> None:
    job_id = make_job(ledger, 3)
    run_a = ledger.start_run(job_id, "test", exclusive=False)
    claimed = ledger.claim(job_id, run_a, 3, 60)
    # Anything but an answer only lands on an item its run holds.
    ledger.record(
        "someone-else",
        [Outcome(claimed[0].id, ItemState.FAILED, 1, error_class="client_error"),
         Outcome(claimed[1].id, ItemState.PENDING, 1, error_class="server_error")],
        [],
    )
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.RUNNING] == 3
    ledger.record(
        run_a,
        [
            Outcome(claimed[0].id, ItemState.SUCCEEDED, 1, status_code=200, output="x", latency_ms=5.0, input_tokens=3, output_tokens=4),
            Outcome(claimed[1].id, ItemState.FAILED, 2, status_code=400, error_class="client_error", error_message="bad"),
            Outcome(claimed[2].id, ItemState.PENDING, 1, error_class="server_error"),
        ],
        [
            AttemptRecord(job_id, claimed[2].id, run_a, 1, time.time(), 0.0, 5.0, 500, "server_error"),
            AttemptRecord(job_id, claimed[2].id, run_a, 2, time.time(), 0.0, 5.0, 429, "rate_limited", counted=False),
        ],
    )
    counts = LedgerQueries(ledger.engine).counts(job_id)
    assert (counts["succeeded"], counts["failed"], counts["pending"], counts["running"]) == (1, 1, 1, 0)
    rows = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_id)}
    assert rows["c1"].output == "x" and rows["c1"].input_tokens == 3
    assert rows["c3"].attempts == 1  # charged attempts count (the 429 does not), across going back to pending
    # A second record of the same success is ignored: the lease is gone.
    ledger.record(run_a, [Outcome(claimed[0].id, ItemState.FAILED, 9)], [])
    assert {r.custom_id: r.state for r in LedgerQueries(ledger.engine).iter_items(job_id)}["c1"] == ItemState.SUCCEEDED


def test_a_late_answer_lands_on_an_item_with_none(ledger: Ledger) -> None:
    """A run whose lease lapsed while its answer came back: the answer is paid for, so it lands
    if the item has none yet (pending again, or re-leased to another run); a second answer never does."""
    job_id = make_job(ledger, 2)
    slow = ledger.start_run(job_id, "worker", exclusive=False)
    taken = ledger.claim(job_id, slow, 2, -1)  # leases already expired
    assert ledger.requeue_expired(job_id) == 2
    other = ledger.start_run(job_id, "worker", exclusive=False)
    assert [c.id for c in ledger.claim(job_id, other, 1, 60)] == [taken[0].id]
    ledger.record(
        slow,
        [Outcome(taken[0].id, ItemState.SUCCEEDED, 1, status_code=200, output="late, while re-leased"),
         Outcome(taken[1].id, ItemState.SUCCEEDED, 1, status_code=200, output="late, while pending")],
        [],
    )
    ledger.record(other, [Outcome(taken[0].id, ItemState.SUCCEEDED, 1, status_code=200, output="second")], [])
    rows = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_id)}
    assert {k: (r.state, r.output) for k, r in rows.items()} == {
        "c1": (ItemState.SUCCEEDED, "late, while re-leased"),
        "c2": (ItemState.SUCCEEDED, "late, while pending"),
    }
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.RUNNING] == 0
    # An item cancelled while its answer was in flight keeps the answer (it was paid for), once.
    job_2 = make_job(ledger, 1)
    gone = ledger.start_run(job_2, "worker", exclusive=False)
    item = ledger.claim(job_2, gone, 1, 60)[0]
    ledger.cancel(job_2)
    ledger.record(gone, [Outcome(item.id, ItemState.SUCCEEDED, 1, status_code=200, output="x")], [])
    ledger.record(gone, [Outcome(item.id, ItemState.SUCCEEDED, 1, status_code=200, output="again")], [])
    (row,) = LedgerQueries(ledger.engine).iter_items(job_2)
    assert (row.state, row.output) == (ItemState.SUCCEEDED, "x")


def test_exclusive_lock_names_the_holder_and_dead_holders_do_not_block(ledger: Ledger) -> None:
    job_id = make_job(ledger, 1)
    run_a = ledger.start_run(job_id, "submit", exclusive=True)
    with pytest.raises(JobLockedError) as info:
        ledger.start_run(job_id, "resume", exclusive=True)
    assert f"pid {os.getpid()}" in info.value.message and run_a in info.value.message
    assert info.value.exit_code == 75
    ledger.end_run(job_id, run_a, 0)
    run_b = ledger.start_run(job_id, "resume", exclusive=True)
    # Pretend run_b's process died: a dead pid on this host frees the lock at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with ledger.engine.begin() as conn:
        conn.execute(text("update jobs set lock_pid = :pid where id = :id"), {"pid": dead.pid, "id": job_id})
    run_c = ledger.start_run(job_id, "resume", exclusive=True)
    assert run_c not in (run_a, run_b)
    # A holder on another host is trusted until its heartbeat goes stale.
    with ledger.engine.begin() as conn:
        conn.execute(text("update jobs set lock_host = 'elsewhere', lock_heartbeat = :t where id = :id"), {"t": time.time(), "id": job_id})
    with pytest.raises(JobLockedError, match="on elsewhere"):
        ledger.start_run(job_id, "resume", exclusive=True)
    with ledger.engine.begin() as conn:
        conn.execute(text("update jobs set lock_heartbeat = :t where id = :id"), {"t": time.time() - 3600, "id": job_id})
    ledger.start_run(job_id, "resume", exclusive=True)


def test_orphans_and_expired_leases_go_back_to_pending(ledger: Ledger) -> None:
    job_id = make_job(ledger, 4)
    dead_run = ledger.start_run(job_id, "submit", exclusive=False)
    ledger.claim(job_id, dead_run, 2, 0.001)
    time.sleep(0.01)
    assert ledger.requeue_expired(job_id) == 2
    ledger.claim(job_id, dead_run, 3, 600)
    assert ledger.requeue_expired(job_id) == 0
    me = ledger.start_run(job_id, "resume", exclusive=True)
    assert ledger.requeue_orphans(job_id, me) == 3
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.PENDING] == 4


def test_heartbeat_extends_leases(ledger: Ledger) -> None:
    job_id = make_job(ledger, 2)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    ledger.claim(job_id, run, 2, 0.001)
    ledger.heartbeat(job_id, run, 600)
    time.sleep(0.01)
    assert ledger.requeue_expired(job_id) == 0


def test_retry_and_cancel(ledger: Ledger) -> None:
    job_id = make_job(ledger, 4)
    run = ledger.start_run(job_id, "submit", exclusive=True)
    c = ledger.claim(job_id, run, 3, 60)
    ledger.record(
        run,
        [
            Outcome(c[0].id, ItemState.FAILED, 5, status_code=500, error_class="server_error", error_message="boom"),
            Outcome(c[1].id, ItemState.FAILED, 1, status_code=400, error_class="client_error", error_message="bad"),
            Outcome(c[2].id, ItemState.SUCCEEDED, 1, status_code=200),
        ],
        [],
    )
    with pytest.raises(ValueError, match="only by error_class, status_code, custom_id"):
        ledger.retry(job_id, [ItemState.FAILED], {"response": "x"})  # any column but the filters is refused
    assert ledger.retry(job_id, [ItemState.FAILED], {"error_class": "server_error"}) == 1
    rows = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_id)}
    assert rows["c1"].state == ItemState.PENDING and rows["c1"].attempts == 0 and rows["c1"].error_class is None
    assert rows["c2"].state == ItemState.FAILED
    assert ledger.cancel(job_id) == 2  # c1 (pending again) and c4
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.CANCELLED] == 2
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.SUCCEEDED] == 1


def test_unknown_job(ledger: Ledger) -> None:
    with pytest.raises(JobNotFoundError, match="no job 999"):
        ledger.get_job(999)


def test_nul_characters_are_stored(ledger: Ledger) -> None:
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash="nul")
    ledger.insert_items(job_id, [{"line": 1, "custom_id": "a\x00b", "url": None, "body": "{}", "state": "pending"}])
    run = ledger.start_run(job_id, "test", exclusive=True)
    item = ledger.claim(job_id, run, 1, 60)[0]
    ledger.record(run, [Outcome(item.id, ItemState.SUCCEEDED, 1, output="x\x00y", error_message=None)], [])
    row = next(LedgerQueries(ledger.engine).iter_items(job_id))
    assert row.state == ItemState.SUCCEEDED
    assert row.output in ("x\x00y", "x\ufffdy")  # SQLite keeps it; PostgreSQL text cannot


def test_jobs_stored_under_an_earlier_hash_are_found_by_their_spec_own_key_source_first(ledger: Ledger) -> None:
    """Two jobs of one input that an earlier version told apart by their key variable: each spec finds
    its own job again (not the newest of the two), and once found it is stored under the current hash."""
    import dataclasses

    base = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))
    team_a = dataclasses.replace(base, provider=dataclasses.replace(base.provider, api_key_env="TEAM_A_KEY"))
    team_b = dataclasses.replace(base, provider=dataclasses.replace(base.provider, api_key_env="TEAM_B_KEY"))
    first = ledger.create_job(team_a, input_path="in.jsonl", input_hash="h")
    second = ledger.create_job(team_b, input_path="in.jsonl", input_hash="h")
    with ledger.engine.begin() as conn:  # as an earlier version stored them: hashes that differ by the variable
        conn.execute(text("UPDATE jobs SET spec_hash = 'old-' || id"))
    assert ledger.find_job(team_a, "h") == first and ledger.find_job(team_b, "h") == second
    found, created = ledger.find_or_create_job(team_a, input_path="in.jsonl", input_hash="h", new=False)
    assert (found, created) == (first, False)
    with ledger.engine.connect() as conn:
        hashes = dict(conn.execute(text("SELECT id, spec_hash FROM jobs")).all())
    assert hashes == {first: team_a.identity_hash(), second: team_b.identity_hash()}  # both found once
    assert ledger.find_job(team_a, "h") == first and ledger.find_job(team_b, "h") == second  # still their own
    assert ledger.find_job(base, "other-input") is None
