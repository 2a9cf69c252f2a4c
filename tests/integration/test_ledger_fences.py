"""Issue 14 at the ledger: where two runs meet or one stalls, the lock and the leases hold.

Each test reproduces one case of the issue with the ledger's own calls (both backends,
real SQLite files and real PostgreSQL); tests/acceptance/test_stalls.py does the same
with real processes frozen by SIGSTOP. The cases a run relies on through
:class:`~batchrun.ledger.RunLedger` (case 2: a run that lost its lock, a worker learning
what it still holds; outcomes landing only on the claim they answer; replayed claims and
starts; the fenced orphan sweep; re-ask progress beside a put-back) run on the in-memory
stand-in too, in tests/integration/test_ledger_contract.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import OperationalError

from batchrun.errors import JobLockedError, LockLostError
from batchrun.ingest import INSERT_BATCH
from batchrun.jobs import prepare_job
from batchrun.ledger import AsyncLedger, AttemptRecord, Ledger, LedgerQueries, Outcome
from batchrun.states import ItemState

from .test_ingest import BATCH_SPEC, batch_line
from .test_ledger import SPEC, make_job


def make_stale(ledger: Ledger, job_id: int) -> None:
    """The lock holder stalled: its heartbeat is an hour old (its process is alive: this one)."""
    with ledger.engine.begin() as conn:
        conn.execute(text("update jobs set lock_heartbeat = lock_heartbeat - 3600 where id = :id"), {"id": job_id})


def rows(n: int, start: int = 1, key: str = "c") -> list[dict[str, Any]]:
    return [{"line": i, "custom_id": f"{key}{i}", "url": None, "body": "{}", "state": ItemState.PENDING}
            for i in range(start, start + n)]


def test_an_ingest_taken_over_writes_nothing_more(ledger: Ledger) -> None:
    """Case 1: the first ingester stalls past the lock's staleness; the second takes over and
    carries on from the last stored line; the first, woken, is refused every write."""
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash="overlap")
    first = ledger.start_run(job_id, "ingest", exclusive=True)
    ledger.insert_items(job_id, rows(10), run_id=first)
    make_stale(ledger, job_id)
    second = ledger.start_run(job_id, "ingest", exclusive=True)
    assert ledger.last_ingested_line(job_id) == 10
    ledger.insert_items(job_id, rows(10, start=11), run_id=second)
    with pytest.raises(LockLostError, match=f"taken over by run {second}") as lost:
        ledger.insert_items(job_id, rows(10, start=11), run_id=first)
    assert lost.value.exit_code == 75
    with pytest.raises(LockLostError):
        ledger.finish_ingest(job_id, run_id=first)
    assert ledger.finish_ingest(job_id, run_id=second) == 20
    assert [r.line for r in LedgerQueries(ledger.engine).iter_items(job_id)] == list(range(1, 21))


def test_a_line_is_stored_once_whoever_writes_it(ledger: Ledger) -> None:
    """Case 1 (the copy): a line already stored is never filed again, not even as a rejected duplicate,
    so export cannot hide the real item behind a rejected copy of its line."""
    job_id = ledger.create_job(SPEC, input_path="in.jsonl", input_hash="twice")
    ledger.insert_items(job_id, rows(INSERT_BATCH // 10))
    assert ledger.insert_items(job_id, rows(INSERT_BATCH // 10)) == []  # the same lines again
    stored = list(LedgerQueries(ledger.engine).iter_items(job_id))
    assert len(stored) == INSERT_BATCH // 10 and {r.state for r in stored} == {ItemState.PENDING}
    with pytest.raises(Exception):  # the database refuses a second row for a line
        with ledger.engine.begin() as conn:
            conn.execute(
                text("insert into items (job_id, line, custom_id, state, attempts) values (:j, 1, 'x', 'rejected', 0)"),
                {"j": job_id},
            )


def test_a_crash_inside_an_ingest_batch_loses_no_line(
    ledger: Ledger, write_jsonl: Callable[..., Path]
) -> None:
    """Case 3: a batch and its duplicate-id rejections are one transaction. A crash while the
    rejections are written used to leave the batch committed without them, and the next
    ingest (which starts after the highest stored line) never stored the line."""
    lines = [batch_line(f"id-{i}") for i in range(1, 41)]
    lines[29] = batch_line("id-3")  # line 30 repeats line 3's custom_id
    path = write_jsonl(lines)

    # The database itself fails the write of a duplicate-id rejection (COPY included).
    if ledger.is_sqlite:
        crash = [
            "CREATE TRIGGER crash BEFORE INSERT ON items WHEN NEW.error_class = 'duplicate_custom_id' "
            "BEGIN SELECT RAISE(ABORT, 'killed while the rejections were written'); END"
        ]
        heal = ["DROP TRIGGER crash"]
    else:
        crash = [
            "CREATE FUNCTION crash() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'killed while the rejections were written'; END $$",
            "CREATE TRIGGER crash BEFORE INSERT ON items FOR EACH ROW "
            "WHEN (NEW.error_class = 'duplicate_custom_id') EXECUTE FUNCTION crash()",
        ]
        heal = ["DROP TRIGGER crash ON items", "DROP FUNCTION crash()"]
    with ledger.engine.begin() as conn:
        for statement in crash:
            conn.execute(text(statement))
    with pytest.raises(Exception, match="killed while the rejections were written"):
        prepare_job(ledger, BATCH_SPEC, path)
    with ledger.engine.begin() as conn:
        for statement in heal:
            conn.execute(text(statement))
    again = prepare_job(ledger, BATCH_SPEC, path)
    stored = list(LedgerQueries(ledger.engine).iter_items(again.job_id))
    assert [r.line for r in stored] == list(range(1, 41))
    assert stored[29].state == ItemState.REJECTED and stored[29].error_class == "duplicate_custom_id"
    assert ledger.get_job(again.job_id).total == 40


@pytest.mark.postgres
def test_a_replayed_write_counts_once(pg_url: str) -> None:
    """Case 5: a PostgreSQL write whose acknowledgement was lost is retried whole by the ride-out;
    the replay adds no attempt row and charges no attempt twice."""
    ledger = Ledger.open(pg_url)
    try:
        job_id = make_job(ledger, 2)
        run = ledger.start_run(job_id, "worker", exclusive=False)
        item = ledger.claim(job_id, run, 1, 60)[0]
        attempts = [
            AttemptRecord(job_id, item.id, run, 1, time.time(), 0.0, 5.0, 500, "server_error", seq=1),
            AttemptRecord(job_id, item.id, run, 2, time.time(), 0.0, 5.0, 200, None, 3, 4, cost_usd=0.5, seq=2),
        ]
        outcome = Outcome(item.id, ItemState.SUCCEEDED, 2, status_code=200, output="x", cost_usd=0.5)
        calls = 0

        def record_then_lose_the_ack() -> None:
            nonlocal calls
            calls += 1
            ledger.record(run, [outcome], attempts)
            if calls == 1:  # committed; then the connection dropped before the answer came back
                error = OperationalError("COMMIT", {}, Exception("server closed the connection"))
                error.connection_invalidated = True
                raise error

        import asyncio

        aledger = AsyncLedger(ledger, ride_out_seconds=5)
        try:
            asyncio.run(aledger.call(record_then_lose_the_ack))
        finally:
            aledger.close()
        assert calls == 2
        with ledger.engine.connect() as conn:
            n, spent = conn.execute(
                text("select count(*), sum(cost_usd) from attempts where job_id = :j"), {"j": job_id}
            ).one()
        assert (n, spent) == (2, 0.5)
        row = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_id)}[item.custom_id]
        assert (row.state, row.attempts) == (ItemState.SUCCEEDED, 2)
    finally:
        ledger.close()


@pytest.mark.postgres
def test_postgres_leases_and_locks_use_the_database_clock(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 8: a worker whose clock runs ahead does not put live items of others back, nor take a
    live lock: lease expiry and lock staleness are read on the database's clock."""
    ledger = Ledger.open(pg_url)
    try:
        job_id = make_job(ledger, 4)
        busy = ledger.start_run(job_id, "worker", exclusive=False)
        ledger.claim(job_id, busy, 2, 60)
        holder = ledger.start_run(job_id, "submit", exclusive=True)
        import batchrun.ledger.store as store

        real = time.time
        monkeypatch.setattr(store.time, "time", lambda: real() + 3600)
        assert ledger.requeue_expired(job_id) == 0
        assert ledger.requeue_expired_jobs() == 0
        with pytest.raises(JobLockedError, match=holder):
            ledger.start_run(job_id, "resume", exclusive=True)
        # And the leases it hands out are the database's time plus the lease.
        ahead = ledger.start_run(job_id, "worker", exclusive=False)
        ledger.claim(job_id, ahead, 2, 60)
        with ledger.engine.connect() as conn:
            latest = conn.execute(text("select max(lease_expires) - extract(epoch from now()) from items")).scalar()
        assert 0 < latest <= 61
    finally:
        ledger.close()


@pytest.mark.postgres
def test_deadlocks_are_retried(pg_url: str) -> None:
    """Case 10: PostgreSQL breaks a deadlock (a lease sweep against a commit, each updating the
    other's rows) by rolling one transaction back: that is retried like a lost connection,
    not a crash of the run. A real deadlock between two connections here."""
    import threading

    from batchrun.ledger.engine import is_transient

    ledger = Ledger.open(pg_url)
    try:
        job_id = make_job(ledger, 2)
        ids = [r.item_id for r in LedgerQueries(ledger.engine).iter_items(job_id)]
        both_hold_one = threading.Barrier(2)
        errors: list[BaseException] = []

        def update_in_order(order: list[int]) -> None:
            try:
                with ledger.engine.begin() as conn:
                    for i, item_id in enumerate(order):
                        conn.execute(text("update items set attempts = attempts + 1 where id = :i"), {"i": item_id})
                        if i == 0:
                            both_hold_one.wait(timeout=10)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=update_in_order, args=(o,)) for o in (ids, ids[::-1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(errors) == 1, errors
        assert is_transient(errors[0])
    finally:
        ledger.close()


@pytest.mark.postgres
def test_a_stalled_session_is_ended_and_an_export_carries_on(pg_url: str) -> None:
    """A process stalled inside a transaction would hold its rows (and everyone waiting on them) until
    it wakes: the ledger's PostgreSQL sessions end after PG_IDLE_IN_TRANSACTION_S idle in one. The
    export's server-side cursor is the one read that spans many round trips: when its session is
    ended mid-way, it carries on after the last line read, every line once."""
    from batchrun.ledger.engine import PG_IDLE_IN_TRANSACTION_S

    ledger = Ledger.open(pg_url)
    try:
        with ledger.engine.connect() as conn:
            setting = conn.execute(text("show idle_in_transaction_session_timeout")).scalar()
        assert setting == f"{int(PG_IDLE_IN_TRANSACTION_S)}s"
        job_id = make_job(ledger, 250)
        ledger.engine.dispose()
        sessions: list[int] = []
        event.listen(ledger.engine, "connect", lambda dbapi, _: sessions.append(dbapi.info.backend_pid))
        rows = LedgerQueries(ledger.engine).iter_items(job_id, chunk=100)
        first = [next(rows) for _ in range(30)]
        assert len(sessions) == 1
        with ledger.engine.connect() as conn:  # what the timeout does to a stalled exporter's session
            conn.execute(text("select pg_terminate_backend(:pid)"), {"pid": sessions[0]})
        lines = [r.line for r in first] + [r.line for r in rows]
        assert lines == list(range(1, 251))
    finally:
        ledger.close()


class _Proxy:
    """A TCP proxy to PostgreSQL that can cut every session and refuse new ones for a while: the
    server restarting, as a client sees it."""

    def __init__(self, port: int = 5432) -> None:
        import socket
        import threading

        self._target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.refusing = False
        self._pairs: list[tuple[Any, Any]] = []
        self._threading = threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing:
                client.close()
                continue
            server = socket.create_connection(self._target)
            self._pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                self._threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def restart(self, down_for: float) -> None:
        """Cut every session now; refuse connections for ``down_for`` seconds."""
        import socket

        self.refusing = True
        for client, server in self._pairs:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._pairs.clear()
        timer = self._threading.Timer(down_for, lambda: setattr(self, "refusing", False))
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.slow
def test_an_export_rides_out_a_server_restart(pg_url: str) -> None:
    """The export's cursor is cut by a restart and the server refuses connections for a while (chaos
    round 10025: a traceback): the export waits for it and carries on after the last line read."""
    proxy = _Proxy()
    url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert url != pg_url
    ledger = Ledger.open(url)
    try:
        job_id = make_job(ledger, 250)
        rows = LedgerQueries(ledger.engine).iter_items(job_id, chunk=100)
        first = [next(rows) for _ in range(30)]
        proxy.restart(down_for=2.0)
        lines = [r.line for r in first] + [r.line for r in rows]
        assert lines == list(range(1, 251))
    finally:
        ledger.close()
        proxy.close()
