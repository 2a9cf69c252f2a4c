"""Batch mode under SIGKILL: real ``batchrun submit --mode batch`` / ``resume`` processes against the fake
provider in its own process (with a state directory, so it can be killed and started again mid-batch),
killed at chosen moments — while a shard's file is uploaded, while its create is at the provider, while it
is polled, while its results are downloaded and written back, at random — and resumed until exit 0.

What must hold, from the server's own records (its request log and its log of created batches, both kept
across its restarts): every record billed exactly once; no provider batch created twice for the same items;
the export exact (each custom_id once, the answer the fake model gives that record); the ledger's spend
equal to the server's usage at the batch price.

A few fixed rounds run by default (SQLite; PostgreSQL too when BATCHRUN_TEST_PG is set). A campaign::

    BATCHRUN_BATCHKILL_ROUNDS=40 .venv/bin/python -m pytest -q -p no:cacheprovider \\
        tests/acceptance/test_batch_kill.py -k campaign -s

prints, per round and in total, the kills, the server restarts, the records billed twice and the export
mismatches (which must all be zero).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from batchrun.testing.batch_store import read_created

from ..conftest import pg_schema_url
from .conftest import cli_env, run_cli

PG_URL = os.environ.get("BATCHRUN_TEST_PG")
ROUNDS = int(os.environ.get("BATCHRUN_BATCHKILL_ROUNDS", "0") or 0)
BATCH_INPUT, BATCH_OUTPUT = 0.5, 1.0  # USD per million tokens at the batch price ([pricing] batch_*)

SPEC = """
[provider]
kind = "{kind}"
base_url = "{base_url}"
model = "gpt-4o-mini"
api_key_env = "OPENAI_API_KEY"
[request]
template = "Say: {{text}}"
max_tokens = 40
[pricing]
input_per_million = 1.0
output_per_million = 2.0
batch_input_per_million = {batch_input}
batch_output_per_million = {batch_output}
[run]
mode = "batch"
[batch]
max_requests = {max_requests}
poll_interval = 0.1
poll_max = 0.3
create_timeout = "{create_timeout}"
"""


class Provider:
    """``python -m batchrun.testing serve`` in its own process, on a state directory and a request log
    that outlive it: :meth:`restart` kills it and starts it again on the same port."""

    def __init__(self, root: Path, *args: str) -> None:
        self.state = root / "provider-state"
        self.log = root / "provider-log.jsonl"
        self._stderr = (root / "provider.err").open("ab")
        self.args = args
        self.port = 0
        self.restarts = 0
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "batchrun.testing", "serve", "--port", str(self.port),
               "--batch-state", str(self.state), "--log", str(self.log), *self.args]
        for _ in range(50):  # the port of a killed server can take a moment to be free again
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.startswith("listening on "):
                self.proc = proc
                self.port = int(line.strip().rpartition(":")[2].split("/")[0])
                return
            proc.wait()
            proc.stdout.close()
            time.sleep(0.1)
        raise AssertionError(f"the fake provider did not start: {cmd}")

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def close(self) -> None:
        self.kill()
        self._stderr.close()

    # -- what it recorded -----------------------------------------------------------------

    def batch_lines(self) -> list[dict[str, Any]]:
        """Each batch line it answered: one record per line of a batch (a batch answers each of its lines once;
        a record written again after a restart counts once)."""
        seen: dict[tuple[str, str], dict[str, Any]] = {}
        with self.log.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n") or b'"api":"batch:' not in raw:
                    continue
                rec = orjson.loads(raw)
                seen.setdefault((rec["batch_id"], rec["custom_id"]), rec)
        return list(seen.values())

    def created(self) -> list[dict[str, Any]]:
        return read_created(self.state)

    def left(self) -> list[str]:
        """What is still stored at the provider that a client can delete: OpenAI files, Anthropic batches."""
        files = [p.stem for p in (self.state / "files").glob("*.json")]
        batches = [p.parent.name for p in (self.state / "batches").glob("*/batch.json")
                   if orjson.loads(p.read_bytes())["kind"] == "anthropic"]
        return files + batches


@dataclass
class Round:
    """What one round did, for the campaign's figures."""

    name: str
    runs: int = 0
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    restarts: int = 0
    billed_twice: int = 0
    unbilled: int = 0
    created_twice: int = 0
    mismatches: int = 0
    files_left: int = 0  # files (OpenAI) or batches (Anthropic) never deleted at the provider
    seconds: float = 0.0
    stops: list[str] = field(default_factory=list)  # why a resume exited 75 before the one that finished


class Ledger:
    """A look at the ledger batchrun writes (to time the kills), over its own connection."""

    def __init__(self, url: str) -> None:
        # pre-ping: another test may restart the shared PostgreSQL server between two looks
        self.engine = create_engine(url if "://" in url else f"sqlite:///{url}", pool_pre_ping=True)

    def shards(self) -> dict[int, tuple[str, int]]:
        """Each shard's state and how many creates it was sent."""
        try:
            with self.engine.connect() as conn:
                return {int(i): (str(s), int(c or 0))
                        for i, s, c in conn.execute(text("select id, state, creates from shards"))}
        except (OperationalError, ProgrammingError):
            return {}  # not made yet, or busy

    def items(self) -> int:
        try:
            with self.engine.connect() as conn:
                return int(conn.execute(text("select count(*) from items")).scalar() or 0)
        except (OperationalError, ProgrammingError):
            return 0

    def spend(self) -> float:
        with self.engine.connect() as conn:
            return float(conn.execute(text("select coalesce(sum(cost_usd), 0) from attempts")).scalar() or 0.0)

    def close(self) -> None:
        self.engine.dispose()


def write_job(root: Path, provider: Provider, kind: str, n: int, max_requests: int,
              create_timeout: str) -> tuple[Path, Path]:
    spec = root / "job.toml"
    base = provider.anthropic_url if kind == "anthropic" else provider.openai_url
    spec.write_text(SPEC.format(kind=kind, base_url=base, max_requests=max_requests, create_timeout=create_timeout,
                                batch_input=BATCH_INPUT, batch_output=BATCH_OUTPUT))
    data = root / "in.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": f"record {i}"}) + b"\n" for i in range(n)))
    return spec, data


def start(root: Path, args: list[str]) -> subprocess.Popen[bytes]:
    err = (root / "batchrun.err").open("ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "batchrun", *args], stdout=subprocess.DEVNULL, stderr=err,
                                env=cli_env(root))
    finally:
        err.close()


def kill(proc: subprocess.Popen[bytes]) -> bool:
    """SIGKILL it; whether it was still running."""
    alive = proc.poll() is None
    if alive:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    return alive


def until(proc: subprocess.Popen[bytes], ledger: Ledger, want: str, timeout: float = 20.0) -> bool:
    """Wait until this process moves a shard into state ``want`` (a new shard, a state it was not in when
    the process started, or another create sent); False if the process ends or time runs out first."""
    before = ledger.shards()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(now[0] == want and before.get(i) != now for i, now in ledger.shards().items()):
            return True
        time.sleep(0.005)
    return False


def shard_of(batch: dict[str, Any]) -> str:
    """The shard a provider batch was made for: OpenAI's metadata names it; Anthropic's line ids carry its tag."""
    if batch["kind"] == "openai":
        return str(batch["metadata"]["batchrun_shard"])
    (tag,) = {str(c).rpartition("_")[0] for c in batch["custom_ids"]}
    return tag


def check(provider: Provider, ledger: Ledger, out: Path, n: int, result: Round, *, resent: bool = False) -> None:
    """The round's promises, from the server's records and the export; the figures into ``result``.
    ``resent``: lines may fail or expire in a batch, so an item may rightly be in more than one."""
    keys = {f"Say: record {i}" for i in range(n)}
    lines = provider.batch_lines()
    billed = collections.Counter(r["key"] for r in lines if r["status"] == 200)
    result.billed_twice = sum(1 for k, v in billed.items() if v > 1)
    result.unbilled = len(keys - set(billed))
    created = provider.created()
    made_for = collections.Counter(shard_of(b) for b in created)
    held = collections.Counter(k for b in created for k in b["keys"])
    result.created_twice = sum(v - 1 for v in made_for.values()) + (
        0 if resent else sum(v - 1 for v in held.values()))
    exported = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    ids = collections.Counter(x["custom_id"] for x in exported)
    result.mismatches = sum(v - 1 for v in ids.values()) + len(set(ids) ^ {f"r{i}" for i in range(n)}) + sum(
        1 for x in exported
        if x["status"] != "succeeded" or x["output"] != f"echo: Say: record {x['custom_id'].removeprefix('r')}"
    )
    assert set(billed) == keys and result.billed_twice == 0, f"billed twice: {[k for k, v in billed.items() if v > 1]}"
    assert result.created_twice == 0 and set(held) == keys, "a shard was made twice, or an item put in two batches"
    assert result.mismatches == 0, f"export not exact: {len(exported)} lines for {n} records"
    result.files_left = len(provider.left())
    assert result.files_left == 0, f"left at the provider: {provider.left()}"
    usage = sum(r["prompt_tokens"] * BATCH_INPUT + r["completion_tokens"] * BATCH_OUTPUT
                for r in lines if r["status"] == 200) / 1e6
    assert ledger.spend() == pytest.approx(usage, rel=1e-9, abs=1e-12), "ledger spend == server usage x batch price"


TRIGGERS = ("upload", "create", "poll", "writeback", "random")
WANT = {"upload": "preparing", "create": "creating", "poll": "live", "writeback": "ended"}


def play(root: Path, db: str, kind: str, seed: int, *, n: int = 60, kills: int = 3) -> Round:
    """One round: submit, SIGKILL at ``kills`` moments drawn from ``seed`` (and, in some rounds, kill and
    restart the provider mid-batch), then resume until exit 0; checked."""
    rng = random.Random(seed)
    began = time.monotonic()
    result = Round(f"{kind}/{'pg' if '://' in db else 'sqlite'}/seed={seed}")
    # Some rounds fail lines (5xx inside the batch: sent again in the next shard) or let batches expire
    # part-way (the rest sent again): items then rightly go in more than one batch.
    line_faults = ["--batch-p-line-500", "0.05"] if rng.random() < 0.4 else []
    expiry = ["--batch-expire-after", "0.8"] if rng.random() < 0.25 else []
    provider = Provider(
        root, "--seed", str(seed), "--batch-turnaround", "1.0", "--batch-create-delay", "0.4",
        "--batch-p-create-500", "0.15", "--batch-p-upload-500", "0.15", "--batch-p-poll-500", "0.05",
        "--batch-p-poll-429", "0.05", *line_faults, *expiry,
    )
    result.name += "".join((" line-500s" if line_faults else "", " expiring" if expiry else ""))
    ledger = Ledger(db)
    proc: subprocess.Popen[bytes] | None = None
    try:
        spec, data = write_job(root, provider, kind, n, max_requests=rng.choice((15, 20, 30)), create_timeout="2s")
        out = root / "out.jsonl"
        plan = [rng.choice(TRIGGERS) for _ in range(kills)]
        restart_at = rng.randrange(kills + 1) if rng.random() < 0.5 else None
        args = ["submit", str(spec), "--input", str(data), "--mode", "batch", "--wait", "--db", db,
                "--output", str(out), "--quiet"]
        for step, trigger in enumerate(plan):
            proc = start(root, args)
            result.runs += 1
            if trigger == "random":
                time.sleep(rng.uniform(0.3, 4.0))
            elif until(proc, ledger, WANT[trigger]):
                time.sleep(rng.uniform(0.0, 0.15))
            else:
                trigger = "late"  # the moment never came: killed whenever it is
            if step == restart_at:
                provider.restart()
            if kill(proc):
                result.kills[trigger] += 1
            elif proc.returncode != 0:
                result.stops.append(f"a run ended by itself with exit {proc.returncode}")
            if ledger.items() == n:  # stored: from here on the job is resumed (else submitted again)
                args = ["resume", "1", "--wait", "--db", db, "--output", str(out), "--quiet"]
        for _ in range(10):
            result.runs += 1
            done = run_cli(root, *args, timeout=180)
            if done.returncode == 0:
                break
            assert done.returncode == 75, done.stderr
            result.stops.append(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
        else:
            raise AssertionError("resume never finished the job")
        result.restarts = provider.restarts
        check(provider, ledger, out, n, result, resent=bool(line_faults or expiry))
    finally:
        if proc is not None:
            kill(proc)
        ledger.close()
        provider.close()
    result.seconds = time.monotonic() - began
    return result


def test_a_create_at_the_provider_when_its_sender_is_killed_is_waited_out_not_sent_again(tmp_path: Path) -> None:
    """The create request is at the provider (which takes 13 s to make the batch) when batchrun is killed.
    The sender is dead, but its create is not: resume waits until the create's timeout and a margin have
    passed since it was sent, finds the batch, and adopts it instead of creating a second one. (A resume
    that took a dead sender for "no create on its way" sent it again after two empty listings.)"""
    provider = Provider(tmp_path, "--seed", "1", "--batch-turnaround", "0.5", "--batch-create-delay", "13")
    db = str(tmp_path / "ledger.db")
    ledger = Ledger(db)
    try:
        spec, data = write_job(tmp_path, provider, "openai", 10, max_requests=10, create_timeout="15s")
        out = tmp_path / "out.jsonl"
        proc = start(tmp_path, ["submit", str(spec), "--input", str(data), "--mode", "batch", "--wait",
                                "--db", db, "--quiet"])
        seen = until(proc, ledger, "creating")
        time.sleep(0.5)  # the create's body is in: the provider is making the batch
        assert kill(proc) and seen, (tmp_path / "batchrun.err").read_text()
        assert provider.created() == []
        done = run_cli(tmp_path, "resume", "1", "--wait", "--db", db, "--output", str(out))
        assert done.returncode == 0, done.stderr
        assert "its create got no answer and may still be made at the provider" in done.stderr
        assert len(provider.created()) == 1, "the batch was created twice"
        assert "found at the provider" in done.stderr
        check(provider, ledger, out, 10, Round("hole"))
    finally:
        ledger.close()
        provider.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_killed_at_each_moment_and_resumed_every_record_is_billed_once(tmp_path: Path, kind: str) -> None:
    seed = 7 if kind == "openai" else 8
    result = play(tmp_path, str(tmp_path / "ledger.db"), kind, seed)
    assert sum(result.kills.values()) >= 2, result
    print(result)


def test_on_postgresql_too(tmp_path: Path, pg_url: str) -> None:
    result = play(tmp_path, pg_url, "openai", 21, kills=2)
    assert sum(result.kills.values()) >= 1, result
    print(result)


def on_pg(statement: str) -> None:
    assert PG_URL
    engine = create_engine(PG_URL)
    try:
        with engine.begin() as conn:
            conn.execute(text(statement))
    finally:
        engine.dispose()


@pytest.mark.skipif(ROUNDS <= 0, reason="set BATCHRUN_BATCHKILL_ROUNDS=N for a campaign of N rounds")
@pytest.mark.timeout(180 * max(ROUNDS, 1))
def test_campaign(tmp_path: Path) -> None:
    rounds: list[Round] = []
    for seed in range(1000, 1000 + ROUNDS):
        root = tmp_path / f"round-{seed}"
        root.mkdir()
        kind = ("openai", "anthropic")[seed % 2]
        schema = f"t_{uuid.uuid4().hex[:12]}" if PG_URL and seed % 4 >= 2 else None  # half the rounds on PG
        db = pg_schema_url(schema) if schema else str(root / "ledger.db")
        if schema:
            on_pg(f"CREATE SCHEMA {schema}")
        try:
            result = play(root, db, kind, seed, n=120, kills=random.Random(seed).randint(2, 5))
        finally:
            if schema:
                on_pg(f"DROP SCHEMA {schema} CASCADE")
        rounds.append(result)
        print(f"{result.name}: {result.runs} runs, kills {dict(result.kills)}, {result.restarts} provider "
              f"restarts, billed twice {result.billed_twice}, created twice {result.created_twice}, "
              f"export mismatches {result.mismatches}, files left {result.files_left}, {result.seconds:.1f} s"
              + (f"; resumes that stopped early: {result.stops}" if result.stops else ""), flush=True)
    kills: collections.Counter[str] = collections.Counter()
    for r in rounds:
        kills.update(r.kills)
    print(f"campaign: {len(rounds)} rounds, {sum(kills.values())} kills {dict(kills)}, "
          f"{sum(r.restarts for r in rounds)} provider restarts, billed twice {sum(r.billed_twice for r in rounds)}, "
          f"created twice {sum(r.created_twice for r in rounds)}, export mismatches "
          f"{sum(r.mismatches for r in rounds)}, files left {sum(r.files_left for r in rounds)}", flush=True)

