"""The chaos campaign (README.md in this folder): seeded rounds of kills, stalls, overlaps,
faults and bad input against the real CLI, checked from the ledger, the exports and the
fake server's log.

By default a few fixed rounds run (SQLite; PostgreSQL too when BATCHRUN_TEST_PG is set).
``BATCHRUN_CHAOS_ROUNDS=N`` runs N seeded rounds instead (from ``BATCHRUN_CHAOS_SEED``, default
1), alternating the backends of ``BATCHRUN_CHAOS_BACKEND`` (sqlite, postgres or both).

The harness's own checks are tested here too: a check that cannot fail is a defect, so a
finished round's ledger, exports and server log are corrupted on purpose and each check must
say so.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from batchrun.testing import Faults, RequestRecord

from .harness import (
    BAD_KINDS,
    PG_URL,
    Round,
    RoundResult,
    build_input,
    campaign,
    make_plan,
    pick_bad_lines,
    run_round,
    visible_lines,
)

ROUNDS = int(os.environ.get("BATCHRUN_CHAOS_ROUNDS", "0") or 0)
FIRST_SEED = int(os.environ.get("BATCHRUN_CHAOS_SEED", "1") or 1)
CAMPAIGN = ROUNDS > 0 or "BATCHRUN_CHAOS_SEED" in os.environ

# Fixed rounds for CI, picked for what they cover (python -c "from tests.chaos.harness import
# make_plan; print(make_plan(SEED, 'sqlite').describe())" shows a plan).
SQLITE_SEEDS = [130, 232, 296]
PG_SEEDS = [125, 381]

skip_in_campaign = pytest.mark.skipif(CAMPAIGN, reason="BATCHRUN_CHAOS_ROUNDS/SEED set: the campaign runs instead")


def _assert_passed(result: RoundResult) -> None:
    print(result.report())
    assert result.ok, result.report()


@skip_in_campaign
@pytest.mark.parametrize("seed", SQLITE_SEEDS)
def test_chaos_round_sqlite(seed: int, tmp_path: Path) -> None:
    _assert_passed(run_round(seed, "sqlite", tmp_path / f"round-{seed}"))


@skip_in_campaign
@pytest.mark.postgres
@pytest.mark.skipif(not PG_URL, reason="set BATCHRUN_TEST_PG to a PostgreSQL URL to run PostgreSQL tests")
@pytest.mark.parametrize("seed", PG_SEEDS)
def test_chaos_round_postgres(seed: int, tmp_path: Path) -> None:
    _assert_passed(run_round(seed, "postgres", tmp_path / f"round-{seed}"))


@pytest.mark.timeout(0)
@pytest.mark.skipif(not CAMPAIGN, reason="set BATCHRUN_CHAOS_ROUNDS=N (and BATCHRUN_CHAOS_SEED) for a campaign")
def test_chaos_campaign(tmp_path: Path) -> None:
    folder = Path(os.environ.get("BATCHRUN_CHAOS_DIR") or tmp_path)
    rounds = ROUNDS or 1
    started = time.monotonic()
    totals: collections.Counter[str] = collections.Counter()

    def progress(result: RoundResult) -> None:
        totals["rounds"] += 1
        totals[f"rounds_{result.plan.backend}"] += 1
        totals["events"] += sum(1 for e in result.plan.events if e.applied)
        totals["kill_stop_events"] += result.disruptive
        totals["lines"] += result.plan.lines
        totals["requests"] += result.requests
        totals["lost"] += result.lost
        totals["resent"] += result.resent
        totals["takeovers"] += result.takeovers
        totals["failed"] += 0 if result.ok else 1
        for e in result.plan.events:
            if e.applied:
                totals[f"event_{e.action}"] += 1
        print(result.report() if not result.ok else result.report().splitlines()[0], flush=True)

    results = campaign(FIRST_SEED, rounds, folder, on_round=progress)
    failed = [r for r in results if not r.ok]
    summary = (
        f"chaos campaign: {totals['rounds']} rounds (seeds {FIRST_SEED}..{FIRST_SEED + rounds - 1}; "
        f"{totals['rounds_sqlite']} SQLite, {totals['rounds_postgres']} PostgreSQL) in "
        f"{time.monotonic() - started:.0f}s; {totals['events']} events landed (kill {totals['event_kill']}, "
        f"term {totals['event_term']}, stop {totals['event_stop']}, overlap {totals['event_overlap']}; "
        f"{totals['takeovers']} takeovers of a frozen run); "
        f"{totals['lines']} input lines, {totals['requests']} requests; {totals['lost']} answers lost and "
        f"{totals['resent']} re-sent over {totals['kill_stop_events']} kill/stop events; "
        f"{len(failed)} rounds failed" + (f": seeds {[r.plan.seed for r in failed]}" if failed else "")
    )
    print(summary, flush=True)
    assert not failed, summary + "\n\n" + "\n\n".join(r.report() for r in failed)


# ------------------------------------------------------------------ the harness's own tests


def test_plans_and_inputs_are_what_they_claim() -> None:
    """Every round's input has its line count, every kind of bad line, and keys as modelled."""
    seen_shapes = set()
    for seed in range(60):
        plan = make_plan(seed, "sqlite")
        seen_shapes.add(plan.shape)
        assert make_plan(seed, "sqlite").describe() == plan.describe(), "a seed decides its plan"
        data, specs = build_input(plan)
        assert build_input(plan)[0] == data, "a seed decides its input"
        newline = b"\r\n" if plan.crlf else b"\n"
        assert len(data.split(newline)) - (1 if plan.final_newline else 0) == plan.lines
        assert [s.number for s in specs] == list(range(1, plan.lines + 1))
        assert set(plan.bad.values()) == set(BAD_KINDS)
        assert {s.number for s in specs if s.bad} == set(plan.bad)
        good = [s.custom_id for s in specs if s.bad is None]
        assert len(good) == len(set(good)), "good lines have unique keys"
        texts = [s.text for s in specs if s.bad is None]
        assert len(texts) == len(set(texts)), "good lines send unique messages (the server's key)"
        dupes = [s for s in specs if s.bad == "duplicate_custom_id"]
        assert all(s.custom_id in good for s in dupes)
        visible = visible_lines(specs)
        assert not any(s.custom_id in visible and visible[s.custom_id] is s for s in dupes), "a duplicate is only in the errors file"
        assert 1 <= len(plan.events) <= 3
    assert len(seen_shapes) == 5


@pytest.fixture(scope="module")
def finished_round(tmp_path_factory: pytest.TempPathFactory) -> Round:
    """A small round with faults (a schema with fenced and prose answers, re-asks) but no events."""
    plan = make_plan(7, "sqlite")
    plan.shape, plan.kind, plan.schema, plan.stream, plan.id_mode = "plain-anthropic", "anthropic", True, False, "mixed"
    plan.lines, plan.concurrency = 240, 8
    plan.bad = pick_bad_lines(random.Random(7), plan.lines)
    plan.events = []
    plan.faults = Faults(latency_s=0.003, p_500=0.03, p_reset=0.02, p_bad_body=0.02, p_fenced=0.1, p_prose=0.05,
                         p_schema_violation=0.1, p_not_json=0.03, p_truncated_json=0.03, seed=7)
    folder = tmp_path_factory.mktemp("chaos") / "round"
    folder.mkdir()
    rnd = Round(plan, folder)
    result = rnd.run()
    print(result.report())
    assert result.ok, result.report()
    return rnd


def _recheck(rnd: Round, tmp_path: Path, mutate: Callable[[Round], None]) -> list[str]:
    copy = tmp_path / "copy"
    shutil.copytree(rnd.folder, copy)
    clone = rnd.clone(copy)
    mutate(clone)
    clone.check()
    assert clone.db is not None
    clone.db.close()
    return clone.result.problems


def _sql(rnd: Round, *statements: str) -> None:
    conn = sqlite3.connect(rnd.folder / "ledger.db")
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


def _drop_unique_line_indexes(rnd: Round) -> list[str]:
    conn = sqlite3.connect(rnd.folder / "ledger.db")
    try:
        names = [name for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'items'")
                 if sql and "UNIQUE" in sql.upper() and "line" in sql]
    finally:
        conn.close()
    return [f"DROP INDEX {name}" for name in names]


def _rewrite(path: Path, edit: Callable[[list[bytes]], list[bytes]]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in edit(path.read_bytes().splitlines())))


def _good_line(rnd: Round) -> int:
    return next(s.number for s in rnd.specs if s.bad is None and s.number > 5)


def test_clean_round_passes_and_counts_nothing_lost(finished_round: Round, tmp_path: Path) -> None:
    assert finished_round.result.lost == 0 and finished_round.result.resent == 0
    assert finished_round.result.requests >= finished_round.plan.lines - len(finished_round.plan.bad)
    assert _recheck(finished_round, tmp_path, lambda r: None) == []


CORRUPTIONS: dict[str, tuple[Callable[[Round], None], str]] = {
    "item deleted from the ledger": (
        lambda r: _sql(r, f"DELETE FROM attempts WHERE item_id IN (SELECT id FROM items WHERE line = {_good_line(r)})",
                       f"DELETE FROM items WHERE line = {_good_line(r)}"),
        "input lines never stored",
    ),
    "input line stored twice": (  # (a ledger with a unique index on the line is first stripped of it)
        lambda r: _sql(r, *_drop_unique_line_indexes(r), "INSERT INTO items (job_id, line, custom_id, state, attempts, error_class) "
                          f"SELECT job_id, line, custom_id || '-again', 'rejected', 0, 'duplicate_custom_id' FROM items "
                          f"WHERE line = {_good_line(r)}"),
        "lines stored more than once",
    ),
    "good item left pending": (
        lambda r: _sql(r, f"UPDATE items SET state = 'pending' WHERE line = {_good_line(r)}"),
        "wrong state",
    ),
    "export line duplicated": (
        lambda r: _rewrite(r.p["final"], lambda ls: ls + ls[3:4]),
        "custom_ids on more than one line",
    ),
    "export line dropped": (
        lambda r: _rewrite(r.p["final"], lambda ls: ls[:4] + ls[5:]),
        "expected lines missing",
    ),
    "export torn halfway": (
        lambda r: r.p["final"].write_bytes(r.p["final"].read_bytes()[: r.p["final"].stat().st_size // 2]),
        "not JSON (torn file?)",
    ),
    "output of another record": (
        lambda r: _rewrite(r.p["final"], lambda ls: _swap_outputs(ls)),
        "do not match their input",
    ),
    "rejected line missing from the errors file": (
        lambda r: _rewrite(r.p["final_errors"], _drop_first_rejected),
        "bad lines not listed as rejected",
    ),
    "attempt row replayed": (
        lambda r: _sql(r, "INSERT INTO attempts (job_id, item_id, run_id, number, started_at, status_code, input_tokens, "
                          "output_tokens) SELECT job_id, item_id, run_id, number, started_at, status_code, input_tokens, "
                          "output_tokens FROM attempts WHERE status_code = 200 LIMIT 3"),
        "more attempt rows with an HTTP status than responses",
    ),
    "paid answers never recorded": (
        lambda r: _sql(r, "DELETE FROM attempts WHERE id IN (SELECT id FROM attempts WHERE status_code = 200 LIMIT 20)"),
        "paid work lost",
    ),
    "answers paid twice": (
        lambda r: r.server_log.extend(_extra_answers(r, 20)),
        "paid twice",
    ),
    "a rejected line sent": (
        lambda r: r.server_log.append(RequestRecord(0, 0.0, 0.0, "POST", "/v1/messages", "duplicate hello", "ok", 200, 1, 1)),
        "requests for no good input line",
    ),
    "key in a log file": (
        lambda r: (r.folder / "procs" / "p1-submit.err").write_text(f"Authorization: Bearer {r.api_key}\n"),
        "the API key is written in",
    ),
    "key in the ledger": (
        lambda r: _sql(r, f"UPDATE items SET error_message = 'bad key {r.api_key}' WHERE line = {_good_line(r)}"),
        "the API key is written in",
    ),
    "export temp file left behind": (
        lambda r: (r.folder / ".final.jsonl.abc123.tmp").write_bytes(b"{"),
        "temporary export files left behind",
    ),
}


def _drop_first_rejected(lines: list[bytes]) -> list[bytes]:
    first = next(i for i, x in enumerate(lines) if orjson.loads(x)["status"] == "rejected")
    return lines[:first] + lines[first + 1:]


def _swap_outputs(lines: list[bytes]) -> list[bytes]:
    rows = [orjson.loads(x) for x in lines]
    ok = [i for i, row in enumerate(rows) if row["status"] == "succeeded"]
    a, b = ok[1], ok[2]
    rows[a]["output"], rows[b]["output"] = rows[b]["output"], rows[a]["output"]
    return [orjson.dumps(row) for row in rows]


def _extra_answers(rnd: Round, n: int) -> list[RequestRecord]:
    """``n`` more clean answers for items that already had one (what a double-paying run causes)."""
    answered = [rec for rec in rnd.server_log if rec.outcome == "ok" and rec.output_fault is None]
    return [RequestRecord(10**6 + i, 0.0, 0.0, rec.method, rec.path, rec.key, "ok", 200, 1, 1, None, rec.api)
            for i, rec in enumerate(answered[:n])]


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_each_check_bites(finished_round: Round, tmp_path: Path, name: str) -> None:
    mutate, expected = CORRUPTIONS[name]
    problems = _recheck(finished_round, tmp_path, mutate)
    assert any(expected in p for p in problems), f"{name}: the checks found {problems}"


def test_exit_codes_and_tracebacks_are_checked(finished_round: Round, tmp_path: Path) -> None:
    """A run that died of SIGTERM (143/-15) or printed a traceback is a failure; a SIGKILLed one is not."""

    def mutate(r: Round) -> None:
        r.procs = []
        for code, sig in ((-15, []), (0, ["SIGKILL"]), (-9, ["SIGKILL"]), (143, [])):
            proc = r.spawn("status", "--help")
            proc.wait(30)
            proc.popen.returncode = code
            proc.signals, proc.signal_times = sig, [0.0] * len(sig)
        tb = r.spawn("status", "--help")
        tb.wait(30)
        tb.err.write_text('Traceback (most recent call last):\n  File "x.py"\nKeyError: 1\n')

    problems = _recheck(finished_round, tmp_path, mutate)
    exits = [p for p in problems if "exit code" in p]
    assert len(exits) == 2 and "exit -15" in exits[0] and "exit 143" in exits[1], problems
    assert any("traceback on stderr" in p for p in problems), problems
