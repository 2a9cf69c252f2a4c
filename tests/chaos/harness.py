"""The chaos campaign's harness: one seeded round = one job, broken on purpose, then checked.

A round (see README.md in this folder):

1. draws a plan from its seed: the input shape (plain records + a ``[request]`` template for
   OpenAI Chat, OpenAI Responses or Anthropic; OpenAI Batch API lines; Anthropic Message
   Batches lines), with an ``[output]`` schema or not, streamed or not, ~1% bad lines of
   every kind, a fault mix for the fake server, a concurrency, short lease/grace times, and
   1-3 events (SIGKILL, SIGTERM, SIGSTOP held then SIGCONT — sometimes with an overlapping
   ``submit`` started while the first is frozen — or an overlapping ``submit`` while the first
   runs) at moments of the job (start-up/ingest, run, re-asks, export);
2. runs ``batchrun submit`` as a subprocess against an in-process
   :class:`batchrun.testing.FakeProviderServer`, applies the events, then ``batchrun resume 1``
   until the job is finished (exit 0 or 1; 75 carries on) and ``batchrun export``;
3. checks the ledger, every export, the server's log and every file of the round (see
   :meth:`Round.check`). Each problem is one line of text; a round passes with none.

Everything a round does is decided by its seed and backend, except timing: a replayed seed
makes the same input, spec, faults and events, but the moments an event lands at (and so
what the processes were doing) can differ by a few milliseconds.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchrun.testing import FakeProviderServer, Faults, RequestRecord
from batchrun.testing.answers import schema_instance  # the fake model's structured answer

PG_URL = os.environ.get("BATCHRUN_TEST_PG")
JOB_ID = 1  # every round has a fresh ledger: its one job is job 1
RUN_EXITS = (0, 1, 75)  # what submit/resume may exit with in a round (no auth, budget or usage errors)
DOCUMENTED_EXITS = (0, 1, 2, 3, 4, 75)
FINISHED_STATES = ("succeeded", "failed", "invalid_output", "cancelled")
REASK_CLASSES = ("schema_invalid", "not_json", "truncated")
VALID_FAULTS = (None, "fenced", "prose")  # content faults whose answer still parses and validates
ROUND_DEADLINE_S = 300.0
# No signal lands sooner after a process was spawned: before that the interpreter is still
# starting and no program can have installed a handler yet (the default action kills it).
MIN_SIGNAL_AFTER_S = 0.25

SHAPES = {  # shape -> (provider kind, weight)
    "plain-openai": ("openai", 3),
    "plain-anthropic": ("anthropic", 2),
    "plain-responses": ("openai-responses", 1),
    "openai-batch": ("openai", 3),
    "anthropic-batch": ("anthropic", 3),
}
BAD_KINDS = (
    "invalid_json", "invalid_utf8", "blank", "not_an_object", "missing_field",
    "duplicate_custom_id", "too_large", "bad_custom_id",
)
ACTIONS = (("kill", 35), ("term", 20), ("stop", 30), ("overlap", 15))

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"enum": ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100000},
        "echo": {"type": "string"},
        "flag": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["label", "score", "echo", "flag", "tags"],
    "additionalProperties": False,
}
WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "río", "naïve", "東京", "smile🙂", 'quo"te',
    "back\\slash", "tab\there", "new\nline", "{brace}", "100%", "<tag>", "Ünïcödé", "mañana",
    "ça", "Привет", "null", "true", "0", "-", "__", "crème", "brûlée", "z" * 12,
)
TOPICS = ("billing", "shipping", "bugs", "praise", "refunds", "accounts")
TEMPLATE = "Item {meta.n} ({topic}): {text}"
SYSTEM = "You are the chaos campaign's model. Answer briefly."


# ---------------------------------------------------------------------------------- the plan


@dataclass
class Event:
    """One disturbance of a round and, once applied, what happened."""

    action: str  # kill | term | stop | overlap
    moment: str  # start | ingest | run | reask | export
    at: float  # start: seconds after the run was spawned; ingest/run: fraction; reask: count
    hold: float = 0.0  # stop: seconds frozen
    overlap_after: float | None = None  # stop: start an overlapping submit this long into the hold
    outcome: str = "not reached"
    applied: bool = False

    def describe(self) -> str:
        what = {"kill": "SIGKILL", "term": "SIGTERM", "stop": f"SIGSTOP {self.hold:.1f}s", "overlap": "overlapping submit"}[self.action]
        if self.action == "stop" and self.overlap_after is not None:
            what += f" + overlapping submit at {self.overlap_after:.1f}s"
        where = {
            "start": f"{self.at:.2f}s after start",
            "ingest": f"ingest {self.at:.0%}",
            "run": f"run {self.at:.0%}",
            "reask": f"re-ask #{self.at:.0f}",
            "export": "export",
        }[self.moment]
        return f"{what} at {where}: {self.outcome}"


@dataclass
class Plan:
    seed: int
    backend: str  # sqlite | postgres
    shape: str
    kind: str  # provider kind
    schema: bool
    stream: bool
    lines: int
    bad: dict[int, str]  # line number -> bad kind
    id_mode: str  # plain records: custom_id | id_str | id_int | mixed | none
    system: bool
    crlf: bool
    final_newline: bool
    concurrency: int
    lease_seconds: float
    grace_seconds: float
    max_line_bytes: int
    max_attempts: int
    validation_retries: int
    timeout: float
    faults: Faults
    events: list[Event]

    @property
    def stale_seconds(self) -> float:
        """When the job lock of a silent run counts as stale: lease_seconds / 2."""
        return self.lease_seconds / 2

    def describe(self) -> str:
        bad = collections.Counter(self.bad.values())
        flags = [self.shape, "schema" if self.schema else "no schema"]
        if self.stream:
            flags.append("stream")
        if self.shape.startswith("plain"):
            flags.append(f"ids={self.id_mode}")
        if self.crlf:
            flags.append("CRLF")
        if not self.final_newline:
            flags.append("no final newline")
        f = self.faults
        faults = [f"latency {f.latency_s * 1000:.0f}+{f.latency_jitter_s * 1000:.0f}ms"]
        for name in ("p_429", "p_500", "p_503", "p_reset", "p_hang", "p_bad_body", "p_truncated", "p_stream_drop",
                     "p_stream_error", "p_fenced", "p_prose", "p_schema_violation", "p_not_json",
                     "p_truncated_json", "p_refusal"):
            value = getattr(f, name)
            if value:
                faults.append(f"{name}={value:.3f}")
        if f.p_429:
            faults.append(f"retry_after={f.retry_after_s}")
        return (
            f"shape: {', '.join(flags)}; {self.lines} lines, {len(self.bad)} bad "
            f"({', '.join(f'{k} {n}' for k, n in sorted(bad.items()))}); concurrency {self.concurrency}; "
            f"lease {self.lease_seconds:g}s (stale after {self.stale_seconds:g}s), grace {self.grace_seconds:g}s, "
            f"max_line_bytes {self.max_line_bytes}, timeout {self.timeout:g}s\n"
            f"  faults: {', '.join(faults)}"
        )


def _weighted(rng: random.Random, options: Iterable[tuple[str, int]]) -> str:
    names, weights = zip(*options)
    return rng.choices(names, weights)[0]


def pick_bad_lines(rng: random.Random, lines: int) -> dict[int, str]:
    """~1% bad lines, every kind at least once; lines 1-2 and the last line are good."""
    n_bad = max(len(BAD_KINDS), round(lines * 0.01))
    kinds = list(BAD_KINDS) + [rng.choice(BAD_KINDS) for _ in range(n_bad - len(BAD_KINDS))]
    return dict(zip(rng.sample(range(3, lines), n_bad), kinds))


def make_plan(seed: int, backend: str) -> Plan:
    """Everything a round does, drawn from its seed (the backend does not change the draw)."""
    rng = random.Random(seed)
    shape = _weighted(rng, ((s, w) for s, (_, w) in SHAPES.items()))
    kind = SHAPES[shape][0]
    schema = rng.random() < 0.4
    stream = rng.random() < 0.2
    concurrency = int(round(2 ** rng.uniform(1, 5)))  # 2..32, log-uniform
    latency = rng.uniform(0.002, 0.03)
    jitter = rng.uniform(0, 0.03)
    big = rng.random() < 0.15  # an input long enough for ingest to be interrupted between batches
    if big:  # fast, so that the run after the ingest stays short
        concurrency, latency, jitter = 32, rng.uniform(0.001, 0.005), rng.uniform(0, 0.005)
        lines = rng.randint(6000, 9000)
    else:
        # about what one run gets through per second here (each answer holds its slot until committed)
        per_second = min(500.0, concurrency / (latency + jitter / 2 + 0.04))
        lines = max(200, min(3000, int(per_second * rng.uniform(2.5, 5))))
    bad = pick_bad_lines(rng, lines)
    lease = rng.choice((6.0, 7.0, 8.0, 9.0, 10.0))
    grace = rng.choice((1.0, 2.0, 3.0))

    def maybe(p_max: float, chance: float = 0.5) -> float:
        return round(rng.uniform(0, p_max), 4) if rng.random() < chance else 0.0

    faults = Faults(
        latency_s=latency, latency_jitter_s=jitter,
        p_429=maybe(0.006), retry_after_s=rng.choice((None, 0.1, 0.25)),
        p_500=maybe(0.03), p_503=maybe(0.02), p_reset=maybe(0.02), p_hang=maybe(0.003, 0.3),
        p_bad_body=maybe(0.015), p_truncated=maybe(0.015), seed=seed,
    )
    if stream:
        faults.p_stream_drop = maybe(0.015)
        faults.p_stream_error = maybe(0.015)
    if schema:
        faults.p_fenced = maybe(0.1)
        faults.p_prose = maybe(0.05)
        faults.p_schema_violation = maybe(0.06, 0.7)
        faults.p_not_json = maybe(0.03)
        faults.p_truncated_json = maybe(0.03)
        faults.p_refusal = maybe(0.004, 0.3)

    moments = [("start", 3), ("run", 8), ("export", 2)]
    if big:
        moments.append(("ingest", 12))
    if schema:
        moments.append(("reask", 3))
    events = []
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        action = _weighted(rng, ACTIONS)
        moment = _weighted(rng, moments)
        at = {"start": rng.uniform(0.3, 1.0), "ingest": rng.choice((0.0, rng.uniform(0.3, 0.8))), "run": rng.uniform(0.05, 0.85),
              "reask": float(rng.randint(1, 6)), "export": 0.0}[moment]
        event = Event(action, moment, at)
        if action == "stop":
            if rng.random() < 0.5:
                event.hold = rng.uniform(0.3, 2.0)
            else:  # frozen past the lock's stale time: an overlapping run may take the job over
                event.hold = lease / 2 + rng.uniform(2.0, 4.0)
                if rng.random() < 0.8:
                    event.overlap_after = lease / 2 + rng.uniform(0.3, 1.0)
        if moment == "reask":
            faults.p_schema_violation = max(faults.p_schema_violation, rng.uniform(0.12, 0.25))
        events.append(event)
    order = {"start": 0, "ingest": 1, "run": 2, "reask": 2, "export": 3}
    events.sort(key=lambda e: (order[e.moment], e.at if e.moment in ("run", "ingest") else 0))
    return Plan(
        seed=seed, backend=backend, shape=shape, kind=kind, schema=schema, stream=stream, lines=lines, bad=bad,
        id_mode=rng.choice(("custom_id", "id_str", "id_int", "mixed", "none")), system=rng.random() < 0.5,
        crlf=rng.random() < 0.15, final_newline=rng.random() < 0.85, concurrency=concurrency,
        lease_seconds=lease, grace_seconds=grace, max_line_bytes=rng.choice((1500, 2048, 4000, 8192)),
        max_attempts=15, validation_retries=rng.choice((2, 3)), timeout=3.0, faults=faults, events=events,
    )


# ---------------------------------------------------------------------------------- the input


@dataclass
class LineSpec:
    """What batchrun must make of one input line."""

    number: int
    custom_id: str  # the item's key (for a bad line: its own usable id, else its line number)
    bad: str | None = None  # the kind of bad line; None: a good one
    error_class: str | None = None  # the rejection's class
    text: str | None = None  # a good line: the user message it sends (the fake server's key)


def build_input(plan: Plan) -> tuple[bytes, list[LineSpec]]:
    """The input file's bytes and, per line, what batchrun must make of it."""
    rng = random.Random(f"input-{plan.seed}")
    plain = plan.shape.startswith("plain")
    specs: list[LineSpec] = []
    raw: list[bytes] = []
    good_with_id: list[tuple[str, Any]] = []  # (field, value) of earlier good lines that carry an id
    exact_size = rng.random() < 0.3  # one good line exactly max_line_bytes long
    exact_line = rng.choice([n for n in range(2, plan.lines) if n not in plan.bad]) if exact_size else -1
    # a good plain record whose integer id is a bad line's fallback key: that rejected line is
    # then listed only in the errors file
    shadow_line = None
    fallback_bad = [n for n, k in plan.bad.items() if k in ("invalid_json", "blank", "not_an_object", "too_large")]
    if plain and rng.random() < 0.3 and fallback_bad:
        shadow_line = rng.choice(fallback_bad)
    shadow_taker = rng.choice([n for n in range(1, plan.lines + 1) if n not in plan.bad]) if shadow_line else -1

    for n in range(1, plan.lines + 1):
        kind = plan.bad.get(n)
        text = f"L{n} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
        if kind is None:
            record, spec = _good_line(plan, rng, n, text, shadow_line if n == shadow_taker else None)
            if n == exact_line:
                record["pad"] = ""
                size = len(orjson.dumps(record))
                record["pad"] = "p" * max(0, plan.max_line_bytes - size)
            data = orjson.dumps(record)
            if n == exact_line:
                assert len(data) == plan.max_line_bytes, (len(data), plan.max_line_bytes)
            for field_name in ("custom_id", "id"):
                if field_name in record:
                    good_with_id.append((field_name, record[field_name]))
                    break
        else:
            data, spec = _bad_line(plan, rng, n, kind, text, good_with_id, specs)
        raw.append(data)
        specs.append(spec)
    newline = b"\r\n" if plan.crlf else b"\n"
    body = newline.join(raw) + (newline if plan.final_newline else b"")
    return body, specs


def _good_line(plan: Plan, rng: random.Random, n: int, text: str, shadow: int | None) -> tuple[dict[str, Any], LineSpec]:
    if plan.shape.startswith("plain"):
        record: dict[str, Any] = {}
        mode = plan.id_mode if plan.id_mode != "mixed" else rng.choice(("custom_id", "id_str", "id_int", "none"))
        if shadow is not None:
            record["id"] = shadow
        elif mode == "custom_id":
            record["custom_id"] = f"rec-{n}"
        elif mode == "id_str":
            record["id"] = f"id-{n:06d}"
        elif mode == "id_int":
            record["id"] = 1_000_000 + n
        topic = rng.choice(TOPICS)
        record.update({"topic": topic, "text": text, "meta": {"n": n, "seen": rng.random() < 0.5}})
        if rng.random() < 0.2:
            record["extra"] = {"nested": [1, 2, {"x": text[:5]}]}
        key = str(record.get("custom_id", record.get("id", n)))
        return record, LineSpec(n, key, text=f"Item {n} ({topic}): {text}")
    cid: Any = f"req-{n}" if plan.seed % 3 else 5_000_000 + n  # integer custom_ids in a third of the rounds
    if plan.shape == "openai-batch":
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}] if plan.system else []
        messages.append({"role": "user", "content": text})
        record = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 400}}
    else:
        content: Any = text if rng.random() < 0.7 else [{"type": "text", "text": text}]
        params: dict[str, Any] = {"model": "claude-3-5-haiku-latest", "max_tokens": 400,
                                  "messages": [{"role": "user", "content": content}]}
        if plan.system:
            params["system"] = SYSTEM
        record = {"custom_id": cid, "params": params}
    return record, LineSpec(n, str(cid), text=text)


def _bad_line(
    plan: Plan, rng: random.Random, n: int, kind: str, text: str,
    good_with_id: list[tuple[str, Any]], specs: list[LineSpec],
) -> tuple[bytes, LineSpec]:
    plain = plan.shape.startswith("plain")
    fallback = str(n)
    if kind == "invalid_json":
        data = rng.choice((b'{"custom_id": "bad-%d", "body": {' % n, b"{not json at all", b'{"text": "x",}', b"}{"))
        return data, LineSpec(n, fallback, kind, "invalid_json")
    if kind == "invalid_utf8":
        data = b'{"custom_id": "utf-%d", "text": "caf\xe9 \xff\xfe"}' % n
        return data, LineSpec(n, fallback, kind, "invalid_utf8")
    if kind == "blank":
        return rng.choice((b"", b"   ", b"\t")), LineSpec(n, fallback, kind, "blank")
    if kind == "not_an_object":
        return rng.choice((b"[1, 2, 3]", b'"just a string"', b"42", b"null", b"true")), LineSpec(n, fallback, kind, "not_an_object")
    if kind == "too_large":
        pad = "x" * (plan.max_line_bytes + rng.randint(1, 3000))
        data = orjson.dumps({"custom_id": f"big-{n}", "text": text, "pad": pad})
        return data, LineSpec(n, fallback, kind, "too_large")
    if kind == "bad_custom_id":
        value = rng.choice(({"x": 1}, True, [1], "", 1.5, None))
        field_name = "id" if plain and rng.random() < 0.5 else "custom_id"
        record: dict[str, Any] = {field_name: value, "topic": "bugs", "text": text, "meta": {"n": n}}
        if not plain:
            record = {field_name: value, "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": [{"role": "user", "content": text}]},
                      "params": {"max_tokens": 10, "messages": [{"role": "user", "content": text}]}}
            if plan.shape == "openai-batch":
                del record["params"]
            else:
                del record["body"], record["method"], record["url"]
        return orjson.dumps(record), LineSpec(n, fallback, kind, "bad_custom_id")
    if kind == "missing_field":
        own = f"miss-{n}"
        if plain:  # the template's {text} is missing
            return orjson.dumps({"custom_id": own, "topic": "bugs", "meta": {"n": n}}), LineSpec(n, own, kind, "missing_field")
        if plan.shape == "openai-batch":  # no body
            return orjson.dumps({"custom_id": own, "method": "POST", "url": "/v1/chat/completions"}), LineSpec(n, own, kind, "not_a_request")
        return orjson.dumps({"custom_id": own, "note": text}), LineSpec(n, own, kind, "not_a_request")
    assert kind == "duplicate_custom_id"
    if good_with_id:
        field_name, value = rng.choice(good_with_id)
    else:  # an earlier good line keyed by its line number: a custom_id of that number collides
        earlier = rng.choice([s for s in specs if s.bad is None])
        field_name, value = "custom_id", earlier.custom_id
    if plain:
        record = {field_name: value, "topic": "bugs", "text": "duplicate " + text, "meta": {"n": n}}
    elif plan.shape == "openai-batch":
        record = {field_name: value, "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "messages": [{"role": "user", "content": "duplicate " + text}], "max_tokens": 50}}
    else:
        record = {field_name: value, "params": {"model": "m", "max_tokens": 50,
                                                "messages": [{"role": "user", "content": "duplicate " + text}]}}
    return orjson.dumps(record), LineSpec(n, str(value), kind, "duplicate_custom_id")


def visible_lines(specs: list[LineSpec]) -> dict[str, LineSpec]:
    """custom_id -> the line the main export lists under it: every good line, and each rejected
    line whose key no good line and no earlier rejected line uses (the rest are only in the
    errors file)."""
    good = {s.custom_id for s in specs if s.bad is None}
    out = {s.custom_id: s for s in specs if s.bad is None}
    for s in specs:
        if s.bad is not None and s.custom_id not in good and s.custom_id not in out:
            out[s.custom_id] = s
    return out


def write_spec(plan: Plan, folder: Path, base_url: str, key_env: str) -> Path:
    """The round's job spec (and schema file)."""
    q = orjson.dumps
    out = [f'name = "chaos-{plan.seed}"', "", "[provider]", f'kind = "{plan.kind}"',
           f"base_url = {q(base_url).decode()}", 'model = "chaos-model"', f'api_key_env = "{key_env}"', ""]
    if plan.shape.startswith("plain"):
        out += ["[request]", f"template = {q(TEMPLATE).decode()}", "max_tokens = 400"]
        if plan.system:
            out.append(f"system = {q(SYSTEM).decode()}")
        out.append("")
    if plan.schema:
        (folder / "schema.json").write_bytes(orjson.dumps(SCHEMA, option=orjson.OPT_INDENT_2))
        out += ["[output]", 'schema = "schema.json"', f"validation_retries = {plan.validation_retries}", ""]
    out += [
        "[run]", f"concurrency = {plan.concurrency}", f"max_attempts = {plan.max_attempts}",
        f"timeout = {plan.timeout}", "connect_timeout = 2.0", f"lease_seconds = {plan.lease_seconds}",
        f"grace_seconds = {plan.grace_seconds}", f"max_line_bytes = {plan.max_line_bytes}",
        "outage_seconds = 60.0", f"stream = {'true' if plan.stream else 'false'}", "",
    ]
    path = folder / "job.toml"
    path.write_text("\n".join(out))
    return path


def expected_output(plan: Plan, spec: LineSpec) -> Any:
    """What the fake model answers this line (batchrun.testing): an instance of the schema
    derived from the request's key (its first user message), else "echo: " + the last user
    message — both are the line's one user message here."""
    assert spec.text is not None
    return schema_instance(SCHEMA, spec.text) if plan.schema else "echo: " + spec.text


# ---------------------------------------------------------------------------------- the ledger


class LedgerDb:
    """Read-only SQL on the round's ledger (SQLite file or PostgreSQL schema), for polling and checks."""

    def __init__(self, backend: str, sqlite_path: Path | None = None, pg_schema: str | None = None) -> None:
        self.backend = backend
        self.sqlite_path = sqlite_path
        self.pg_schema = pg_schema
        self._conn: Any = None
        self.seen = False  # batchrun has made the SQLite file: connecting cannot create it any more

    def _connect(self) -> Any:
        if self.backend == "sqlite":
            assert self.sqlite_path is not None
            # Only once batchrun made the file (and put it in WAL mode): never create it here.
            if not (self.sqlite_path.exists() and (self.seen or Path(f"{self.sqlite_path}-wal").exists())):
                return None
            self.seen = True
            conn = sqlite3.connect(self.sqlite_path, timeout=2.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA query_only = 1")
            return conn
        import psycopg

        return psycopg.connect(pg_conninfo(), options=f"-csearch_path={self.pg_schema}", autocommit=True)

    def rows(self, sql: str, *, strict: bool = False) -> list[tuple[Any, ...]] | None:
        """The rows, or None while the ledger (or its tables) do not exist yet; ``strict``
        (the checks, once every process has ended): any error is raised."""
        try:
            if self._conn is None:
                self._conn = self._connect()
                if self._conn is None:
                    if strict:
                        raise FileNotFoundError(f"no ledger at {self.sqlite_path}")
                    return None
            return list(self._conn.execute(sql).fetchall())
        except Exception as exc:
            if self.backend == "postgres":
                self.close()
                if strict and _pg_went_away(exc):  # a PostgreSQL restart (other tests do that): ride it out
                    return self._retry(sql)
            if strict:
                raise
            return None  # not created yet, locked for a moment, a table missing

    def _retry(self, sql: str) -> list[tuple[Any, ...]] | None:
        for _ in range(60):
            time.sleep(1.0)
            try:
                self._conn = self._connect()
                return list(self._conn.execute(sql).fetchall())
            except Exception as exc:
                self.close()
                if not _pg_went_away(exc):
                    raise
        raise TimeoutError("PostgreSQL unreachable for 60 s")

    def settle(self) -> None:
        """No batchrun process is running: a SQLite file that exists may be opened as it is."""
        if self.sqlite_path is not None and self.sqlite_path.exists():
            self.seen = True

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None


def _pg_went_away(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.OperationalError)


def pg_conninfo() -> str:
    assert PG_URL
    return PG_URL.replace("postgresql+psycopg://", "postgresql://", 1)


def pg_schema_url(schema: str) -> str:
    assert PG_URL
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options=-csearch_path%3D{schema}"


def pg_admin(sql: str) -> None:
    import psycopg

    for attempt in range(30):
        try:
            with psycopg.connect(pg_conninfo(), autocommit=True) as conn:
                conn.execute(sql)
            return
        except psycopg.OperationalError:  # restarting: try again
            if attempt == 29:
                raise
            time.sleep(1.0)


@dataclass
class Snapshot:
    states: dict[str, int]
    items: int
    ingest_done: bool
    lock_pid: int | None

    @property
    def finished(self) -> int:
        return sum(self.states.get(s, 0) for s in FINISHED_STATES)

    @property
    def open(self) -> int:
        return self.states.get("pending", 0) + self.states.get("running", 0)


# ---------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """One CLI process of a round; its stdout and stderr go to files in the round's folder."""

    name: str
    command: str
    popen: subprocess.Popen[bytes]
    started: float
    out: Path
    err: Path
    signals: list[str] = field(default_factory=list)
    signal_times: list[float] = field(default_factory=list)  # seconds after spawn

    @property
    def code(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: signal.Signals) -> bool:
        """Signal the process if it has not exited (a reaped pid is never signalled)."""
        if self.popen.poll() is not None:
            return False
        self.popen.send_signal(sig)
        self.signals.append(sig.name)
        self.signal_times.append(time.monotonic() - self.started)
        return True

    def wait(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def describe(self) -> str:
        sig = ", signals " + "/".join(f"{n}@{t:.2f}s" for n, t in zip(self.signals, self.signal_times)) if self.signals else ""
        return f"{self.name} {self.command} (pid {self.popen.pid}{sig}): exit {self.code}"

    def stderr_tail(self, lines: int = 4) -> str:
        text = self.err.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])[-600:]


# ---------------------------------------------------------------------------------- a round


@dataclass
class RoundResult:
    plan: Plan
    folder: Path
    problems: list[str] = field(default_factory=list)
    procs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    requests: int = 0
    disruptive: int = 0  # SIGKILL and SIGSTOP events that landed
    lost: int = 0  # clean answers the server gave that the ledger never recorded
    resent: int = 0  # valid answers beyond the first, per item
    takeovers: int = 0  # frozen runs whose job an overlapping run took over, and that then stopped

    @property
    def ok(self) -> bool:
        return not self.problems

    def event_summary(self) -> str:
        def one(e: Event) -> str:
            what = e.action + ("+overlap" if e.overlap_after is not None else "")
            return f"{what}@{e.moment}" + ("" if e.applied else " (missed)")

        return ", ".join(one(e) for e in self.plan.events)

    def replay(self) -> str:
        return (f"BATCHRUN_CHAOS_SEED={self.plan.seed} BATCHRUN_CHAOS_ROUNDS=1 BATCHRUN_CHAOS_BACKEND={self.plan.backend} "
                ".venv/bin/python -m pytest tests/chaos -k campaign -s")

    def report(self) -> str:
        head = "passed" if self.ok else f"FAILED ({len(self.problems)} problems)"
        out = [
            f"chaos round seed={self.plan.seed} backend={self.plan.backend}: {head} in {self.seconds:.1f}s; "
            f"{self.requests} requests, {self.disruptive} kill/stop events, {self.lost} answers lost, "
            f"{self.resent} re-sent (bound {self.plan.concurrency * self.disruptive}); "
            f"{self.takeovers} takeovers; events: {self.event_summary()}",
            f"  replay: {self.replay()}",
            f"  {self.plan.describe()}",
            "  events:",
            *(f"    {i}. {e.describe()}" for i, e in enumerate(self.plan.events, 1)),
            "  processes: " + "; ".join(self.procs),
            f"  folder: {self.folder}",
        ]
        if self.problems:
            out.append("  broke:")
            out += [f"    - {p}" for p in self.problems]
        return "\n".join(out)


def _examples(items: Iterable[Any], n: int = 5) -> str:
    items = list(items)
    shown = ", ".join(str(i) for i in items[:n])
    return shown + (f", ... ({len(items)} in all)" if len(items) > n else "")


class Round:
    """One seeded round: set up, run with its events, recover, check."""

    def __init__(self, plan: Plan, folder: Path) -> None:
        self.plan = plan
        self.folder = folder
        self.result = RoundResult(plan, folder)
        self.procs: list[Proc] = []
        self.api_key = "sk-chaos-" + uuid.uuid4().hex + uuid.uuid4().hex[:8]
        self.key_env = "CHAOS_KEY_" + uuid.uuid4().hex[:8].upper()
        self.pg_schema: str | None = None
        self.server: FakeProviderServer | None = None
        self.db: LedgerDb | None = None
        self.specs: list[LineSpec] = []
        self.server_log: list[RequestRecord] = []  # what the fake server answered, read once every run ended

    # -- helpers

    def problem(self, text: str) -> None:
        self.result.problems.append(text)

    @property
    def p(self) -> dict[str, Path]:
        f = self.folder
        return {
            "spec": f / "job.toml", "input": f / "input.jsonl", "db": f / "ledger.db", "out": f / "out.jsonl",
            "errors": f / "errors.jsonl", "final": f / "final.jsonl", "final_errors": f / "final-errors.jsonl",
            "log": f / "run-log.jsonl", "home": f / "home", "procs": f / "procs",
        }

    def db_arg(self) -> str:
        if self.plan.backend == "sqlite":
            return str(self.p["db"])
        assert self.pg_schema is not None
        return pg_schema_url(self.pg_schema)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("BATCHRUN_") and k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "XDG_DATA_HOME")}
        env["HOME"] = str(self.p["home"])
        env["BATCHRUN_TIKTOKEN"] = "0"
        env[self.key_env] = self.api_key
        return env

    def spawn(self, command: str, *args: str) -> Proc:
        name = f"p{len(self.procs) + 1}"
        out, err = self.p["procs"] / f"{name}-{command}.out", self.p["procs"] / f"{name}-{command}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen([sys.executable, "-m", "batchrun", command, *args], stdout=fo, stderr=fe,
                                     env=self.env(), cwd=self.folder)
        proc = Proc(name, command, popen, time.monotonic(), out, err)
        self.procs.append(proc)
        return proc

    def spawn_submit(self) -> Proc:
        p = self.p
        return self.spawn("submit", str(p["spec"]), "--input", str(p["input"]), "--db", self.db_arg(),
                          "--output", str(p["out"]), "--errors", str(p["errors"]), "--quiet",
                          "--log-file", str(p["log"]))

    def spawn_work(self) -> Proc:
        """``resume 1`` once the job exists, else the same ``submit`` again."""
        if not self.job_exists():
            return self.spawn_submit()
        p = self.p
        return self.spawn("resume", str(JOB_ID), "--db", self.db_arg(), "--output", str(p["out"]),
                          "--errors", str(p["errors"]), "--quiet", "--log-file", str(p["log"]))

    def reap(self) -> None:
        """Collect every process that has exited: an unreaped (zombie) pid still looks alive to
        the job lock's owner check."""
        for proc in self.procs:
            proc.popen.poll()

    def job_exists(self) -> bool:
        assert self.db is not None
        rows = self.db.rows(f"SELECT id FROM jobs WHERE id = {JOB_ID}")
        return bool(rows)

    def snapshot(self) -> Snapshot | None:
        assert self.db is not None
        job = self.db.rows(f"SELECT ingest_done, lock_pid FROM jobs WHERE id = {JOB_ID}")
        if not job:
            return None
        states = self.db.rows(f"SELECT state, COUNT(*) FROM items WHERE job_id = {JOB_ID} GROUP BY state")
        if states is None:
            return None
        counts = {s: int(n) for s, n in states}
        return Snapshot(counts, sum(counts.values()), bool(job[0][0]), job[0][1])

    def took_lock_before(self, taker: Proc, holder: Proc) -> bool:
        """Whether ``taker`` took the job lock (started a run) before ``holder``'s last run ended:
        a process still starting up when the frozen one woke took nothing over."""
        assert self.db is not None
        taken = self.db.rows(f"SELECT MIN(started_at) FROM runs WHERE job_id = {JOB_ID} AND pid = {taker.popen.pid}")
        ended = self.db.rows(f"SELECT MAX(ended_at) FROM runs WHERE job_id = {JOB_ID} AND pid = {holder.popen.pid}")
        if not taken or taken[0][0] is None:
            return False
        return not ended or ended[0][0] is None or float(taken[0][0]) < float(ended[0][0])

    def never_started(self, proc: Proc) -> bool:
        """Whether ``proc`` left no trace in the ledger (no run, no lock)."""
        assert self.db is not None
        runs = self.db.rows(f"SELECT COUNT(*) FROM runs WHERE pid = {proc.popen.pid}")
        return runs is not None and int(runs[0][0]) == 0

    def reask_count(self) -> int:
        assert self.db is not None
        classes = ", ".join(f"'{c}'" for c in REASK_CLASSES)
        rows = self.db.rows(f"SELECT COUNT(*) FROM attempts WHERE job_id = {JOB_ID} AND error_class IN ({classes})")
        return int(rows[0][0]) if rows else 0

    def clone(self, folder: Path) -> Round:
        """This finished SQLite round as found in ``folder`` (a copy of its own), for checking
        again: the harness's own tests corrupt such a copy and expect the checks to say so."""
        assert self.plan.backend == "sqlite"
        other = Round(self.plan, folder)
        other.api_key, other.key_env = self.api_key, self.key_env
        other.specs = list(self.specs)
        other.server_log = list(self.server_log)
        other.result.disruptive = self.result.disruptive
        other.db = LedgerDb("sqlite", sqlite_path=folder / "ledger.db")
        other.db.settle()
        return other

    # -- the round

    def run(self) -> RoundResult:
        started = time.monotonic()
        plan = self.plan
        for d in ("home", "procs"):
            self.p[d].mkdir(parents=True, exist_ok=True)
        try:
            data, self.specs = build_input(plan)
            self.p["input"].write_bytes(data)
            if plan.backend == "postgres":
                self.pg_schema = f"chaos_{plan.seed}_{uuid.uuid4().hex[:8]}"
                pg_admin(f"CREATE SCHEMA {self.pg_schema}")
                self.db = LedgerDb("postgres", pg_schema=self.pg_schema)
            else:
                self.db = LedgerDb("sqlite", sqlite_path=self.p["db"])
            self.server = FakeProviderServer(plan.faults, api_key=self.api_key, log_path=self.folder / "server.log")
            self.server.start()
            base = self.server.anthropic_base_url if plan.kind == "anthropic" else self.server.base_url
            write_spec(plan, self.folder, base, self.key_env)
            self.run_events()
            self.finish_processes()
            self.db.settle()
            self.recover()
            time.sleep(0.3)  # let the server log the requests of connections just closed
            self.server_log = self.server.log
            self.check()
        except Exception as exc:  # the harness itself broke: say so, with where
            import traceback

            self.problem(f"harness error: {exc!r}\n" + traceback.format_exc())
        finally:
            for proc in self.procs:
                if proc.alive():
                    proc.send(signal.SIGKILL)
                    proc.wait(10)
            if self.server is not None:
                self.server.stop()
            if self.db is not None:
                self.db.close()
            if self.pg_schema is not None and not os.environ.get("BATCHRUN_CHAOS_KEEP"):
                try:
                    pg_admin(f"DROP SCHEMA {self.pg_schema} CASCADE")
                except Exception as exc:
                    self.problem(f"harness: could not drop schema {self.pg_schema}: {exc!r}")
        self.result.procs = [p.describe() for p in self.procs]
        self.result.seconds = time.monotonic() - started
        return self.result

    def run_events(self) -> None:
        primary: Proc | None = self.spawn_submit()
        for event in self.plan.events:
            if time.monotonic() - self.procs[0].started > ROUND_DEADLINE_S / 2:
                event.outcome = "skipped: round too long"
                continue
            if primary is None or not primary.alive():
                if primary is not None and primary.code in (0, 1):
                    event.outcome = f"skipped: the job finished ({primary.name} exit {primary.code})"
                    continue
                primary = self.spawn_work()
            if not self.wait_moment(event, primary):
                continue
            primary = self.apply(event, primary)

    def wait_moment(self, event: Event, proc: Proc) -> bool:
        """Wait until ``event``'s moment in ``proc``'s work; False (and the event's outcome
        says why) when the process exited first or the moment never came."""
        deadline = time.monotonic() + 120
        n_good = sum(1 for s in self.specs if s.bad is None)
        target: float | None = None
        if event.moment == "reask":
            base = self.reask_count()
        while time.monotonic() < deadline:
            self.reap()
            if not proc.alive():
                event.outcome = f"missed: {proc.name} exited {proc.code} first"
                return False
            if time.monotonic() < proc.started + MIN_SIGNAL_AFTER_S:
                time.sleep(0.01)
                continue
            if event.moment == "start":
                if time.monotonic() >= proc.started + event.at:
                    return True
                time.sleep(0.01)
                continue
            snap = self.snapshot()
            if snap is not None:
                if event.moment == "ingest":
                    if snap.ingest_done or snap.items >= event.at * self.plan.lines:
                        if snap.ingest_done:
                            event.at = snap.items / self.plan.lines
                        return True
                elif event.moment == "run":
                    if target is None:
                        done0 = snap.finished
                        target = done0 + event.at * max(0, n_good - done0)
                    if snap.ingest_done and snap.finished >= target:
                        return True
                elif event.moment == "reask":
                    if self.reask_count() >= base + event.at:
                        return True
                elif event.moment == "export":
                    if snap.ingest_done and snap.items >= self.plan.lines and snap.open == 0:
                        return True
            time.sleep(0.01 if event.moment == "export" else 0.03)
        event.outcome = "missed: the moment did not come within 120 s"
        return False

    def apply(self, event: Event, proc: Proc) -> Proc | None:
        """Apply ``event`` to ``proc``; returns the process that carries the job on (None: none)."""
        plan = self.plan
        if event.action == "kill":
            if not proc.send(signal.SIGKILL):
                event.outcome = f"missed: {proc.name} exited {proc.code} first"
                return None
            proc.wait(10)
            event.applied = True
            self.result.disruptive += 1
            event.outcome = f"{proc.name} {proc.command} killed"
            return None
        if event.action == "term":
            if not proc.send(signal.SIGTERM):
                event.outcome = f"missed: {proc.name} exited {proc.code} first"
                return None
            event.applied = True
            t0 = time.monotonic()
            limit = plan.grace_seconds + 20
            if not proc.wait(limit):
                self.problem(f"{proc.name} {proc.command} still running {limit:.0f}s after SIGTERM "
                             f"(grace {plan.grace_seconds:g}s); killed")
                proc.send(signal.SIGKILL)
                proc.wait(10)
            event.outcome = f"{proc.name} {proc.command} exit {proc.code} {time.monotonic() - t0:.1f}s after SIGTERM"
            return None
        if event.action == "overlap":
            other = self.spawn_submit()
            event.applied = True
            event.outcome = f"{other.name} submit started beside {proc.name}"
            return proc
        assert event.action == "stop"
        if not proc.send(signal.SIGSTOP):
            event.outcome = f"missed: {proc.name} exited {proc.code} first"
            return None
        event.applied = True
        self.result.disruptive += 1
        t0 = time.monotonic()
        # Only a process frozen while it holds the job lock can be taken over (one frozen in its
        # export, after its run ended, has nothing to lose and finishes when woken).
        frozen_at = self.snapshot()
        held_lock = frozen_at is not None and frozen_at.lock_pid == proc.popen.pid
        other: Proc | None = None
        if event.overlap_after is not None:
            time.sleep(event.overlap_after)
            other = self.spawn_submit()
        while time.monotonic() < t0 + event.hold:
            self.reap()
            time.sleep(min(0.05, max(0.0, t0 + event.hold - time.monotonic())))
        proc.send(signal.SIGCONT)
        woke = time.monotonic()
        if other is None:
            event.outcome = f"{proc.name} {proc.command} frozen {woke - t0:.1f}s"
            return proc
        # A run frozen past its lock's stale time, with another run started meanwhile: once
        # woken it must notice within a heartbeat that it lost the job and stop (exit 75).
        window = plan.lease_seconds / 4 + plan.grace_seconds + 6
        while time.monotonic() < woke + window:
            self.reap()
            if not proc.alive() or not other.alive():
                break
            time.sleep(0.05)
        if not proc.alive():
            took = f"{proc.name} exit {proc.code} {time.monotonic() - woke:.1f}s after SIGCONT"
            if proc.code == 75:
                self.result.takeovers += 1
            if proc.code != 75 and held_lock and self.took_lock_before(other, proc):
                self.problem(f"{proc.name} {proc.command}, frozen {woke - t0:.1f}s while {other.name} submit took the job "
                             f"over, exited {proc.code} after SIGCONT (expected 75)")
        elif not other.alive():
            took = f"{other.name} exit {other.code} (no takeover); {proc.name} carries on"
        else:
            snap = self.snapshot()
            holder = snap.lock_pid if snap else None
            took = f"both {proc.name} and {other.name} still running {window:.0f}s after SIGCONT (lock pid {holder})"
            if holder == other.popen.pid and held_lock:
                self.problem(f"{proc.name} {proc.command} frozen {woke - t0:.1f}s, woken while {other.name} holds the "
                             f"job lock: still running {window:.0f}s later (expected exit 75 within a heartbeat)")
        event.outcome = f"{proc.name} frozen {woke - t0:.1f}s, {other.name} submit started at {event.overlap_after:.1f}s; {took}"
        return proc if proc.alive() else other if other.alive() else None

    def finish_processes(self) -> None:
        """Let every process still running end on its own."""
        deadline = time.monotonic() + max(60.0, ROUND_DEADLINE_S - (time.monotonic() - self.procs[0].started) - 60)
        for proc in self.procs:
            if not proc.wait(max(0.1, deadline - time.monotonic())):
                self.problem(f"{proc.name} {proc.command} still running at the round's deadline; killed")
                if proc.send(signal.SIGKILL):
                    self.result.disruptive += 1  # a kill like any other: the paid-work bounds count it
                proc.wait(10)

    def recover(self) -> None:
        """``resume`` until the job is finished, then ``export`` (and ``status --json``)."""
        last: Proc | None = None
        for _ in range(10):
            assert self.db is not None
            self.db.settle()
            last = self.spawn_work()
            if not last.wait(max(30.0, ROUND_DEADLINE_S - (time.monotonic() - self.procs[0].started))):
                self.problem(f"{last.name} {last.command} (recovery) did not finish; killed")
                if last.send(signal.SIGKILL):
                    self.result.disruptive += 1
                last.wait(10)
                return
            if last.code in (0, 1):
                break
            if last.code != 75:
                return  # reported by the exit-code check
            time.sleep(0.5)
        else:
            self.problem(f"job not finished after 10 recovery runs (last: {last.describe() if last else None})")
            return
        p = self.p
        export = self.spawn("export", str(JOB_ID), "--db", self.db_arg(), "--output", str(p["final"]),
                            "--errors", str(p["final_errors"]))
        export.wait(120)
        status = self.spawn("status", str(JOB_ID), "--db", self.db_arg(), "--json")
        status.wait(60)
        if status.code == 0:
            try:
                data = orjson.loads(status.out.read_bytes())
                if data.get("total") != self.plan.lines:
                    self.problem(f"status --json: total {data.get('total')}, expected {self.plan.lines} input lines")
                if data.get("done") is False:
                    self.problem("status --json: job not done after a finished resume")
            except orjson.JSONDecodeError as exc:
                self.problem(f"status --json printed no JSON object: {exc}")

    # -- the checks

    def check(self) -> None:
        assert self.db is not None
        self.db.settle()
        self.check_processes()
        items = self.check_ledger()
        final = self.p["final"]
        if final.exists():
            self.check_export(final, self.p["final_errors"], "export")
        else:
            self.problem("no final export written")
        if self.p["out"].exists():  # what the last finished submit/resume exported on its own
            self.check_export(self.p["out"], self.p["errors"], "run's --output")
        if items is not None:
            self.check_paid_work(items)
        self.check_key()
        leftovers = sorted(x.name for x in self.folder.glob(".*.tmp"))
        if leftovers:
            self.problem(f"temporary export files left behind after a finished export: {_examples(leftovers)}")

    def check_processes(self) -> None:
        for proc in self.procs:
            err = proc.err.read_text(errors="replace")
            if "Traceback" in err:
                tb = err[err.index("Traceback"):].strip().splitlines()
                self.problem(f"{proc.describe()}: traceback on stderr: {' | '.join(tb[-3:])[-500:]}")
            code = proc.code
            if code == -signal.SIGKILL and "SIGKILL" in proc.signals:
                continue
            if code == -signal.SIGTERM and "SIGTERM" in proc.signals and not err and self.never_started(proc):
                continue  # ended by the signal's default action before Python had started batchrun
            allowed = (0,) if proc.command in ("export", "status") else RUN_EXITS
            if code not in allowed:
                why = "undocumented exit code" if code not in DOCUMENTED_EXITS else "unexpected exit code"
                self.problem(f"{proc.describe()}: {why}; stderr: {proc.stderr_tail()}")

    def check_ledger(self) -> dict[int, tuple[str, str, str | None, int | None]] | None:
        """One row per input line, each as the input says; returns line -> (custom_id, state, error_class, id)."""
        assert self.db is not None
        self.db.close()  # a fresh connection sees every commit
        try:
            jobs = self.db.rows("SELECT id FROM jobs ORDER BY id", strict=True) or []
        except Exception as exc:
            self.problem(f"cannot read the ledger after the round: {exc!r}")
            return None
        if [j[0] for j in jobs] != [JOB_ID]:
            self.problem(f"the ledger holds jobs {[j[0] for j in jobs]}: one spec and one input must make one job")
        rows = self.db.rows(f"SELECT line, custom_id, state, error_class, id FROM items WHERE job_id = {JOB_ID}", strict=True) or []
        per_line: dict[int, list[tuple[str, str, str | None, int]]] = collections.defaultdict(list)
        for line, cid, state, error_class, item_id in rows:
            per_line[int(line)].append((cid, state, error_class, item_id))
        n = self.plan.lines
        if len(rows) != n:
            self.problem(f"ledger: {len(rows)} item rows for {n} input lines")
        twice = {ln: [r[1] for r in rs] for ln, rs in per_line.items() if len(rs) > 1}
        if twice:
            self.problem(f"ledger: lines stored more than once (line: states): {_examples(twice.items())}")
        missing = [s.number for s in self.specs if s.number not in per_line]
        if missing:
            self.problem(f"ledger: input lines never stored: {_examples(missing)}")
        strays = sorted(set(per_line) - {s.number for s in self.specs})
        if strays:
            self.problem(f"ledger: items for lines the input does not have: {_examples(strays)}")
        wrong: list[str] = []
        for s in self.specs:
            for cid, state, error_class, _ in per_line.get(s.number, []):
                if s.bad is not None:
                    if state != "rejected" or error_class != s.error_class or cid != s.custom_id:
                        wrong.append(f"line {s.number} ({s.bad}): {state}/{error_class}/{cid!r}, "
                                     f"expected rejected/{s.error_class}/{s.custom_id!r}")
                else:
                    allowed = ("succeeded", "invalid_output") if self.plan.schema else ("succeeded",)
                    if state not in allowed or cid != s.custom_id:
                        wrong.append(f"line {s.number} (good): {state}/{error_class}/{cid!r}, expected "
                                     f"{'/'.join(allowed)} under {s.custom_id!r}")
        if wrong:
            self.problem(f"ledger: items in the wrong state or under the wrong key: {_examples(wrong, 4)}")
        return {ln: rs[0] for ln, rs in per_line.items()}

    def check_export(self, main: Path, errors: Path, label: str) -> None:
        plan = self.plan
        lines: list[dict[str, Any]] = []
        for i, raw in enumerate(main.read_bytes().splitlines(), 1):
            try:
                lines.append(orjson.loads(raw))
            except orjson.JSONDecodeError:
                self.problem(f"{label} {main.name}: line {i} is not JSON (torn file?): {raw[:120]!r}")
                return
        expected = visible_lines(self.specs)
        ids = collections.Counter(line.get("custom_id") for line in lines)
        dupes = {cid: n for cid, n in ids.items() if n > 1}
        if dupes:
            self.problem(f"{label} {main.name}: custom_ids on more than one line: {_examples(dupes.items())}")
        lost = [cid for cid in expected if cid not in ids]
        if lost:
            self.problem(f"{label} {main.name}: {len(lost)} of {len(expected)} expected lines missing: {_examples(lost)}")
        extra = [cid for cid in ids if cid not in expected]
        if extra:
            self.problem(f"{label} {main.name}: lines for keys no input line should list: {_examples(extra)}")
        mismatched: list[str] = []
        failed: set[str] = set()
        for line in lines:
            spec = expected.get(line.get("custom_id"))  # type: ignore[arg-type]
            if spec is None:
                continue
            status = line.get("status")
            if spec.bad is not None:
                err = line.get("error") or {}
                if status != "rejected" or err.get("line") != spec.number:
                    mismatched.append(f"{spec.custom_id}: status {status}, error {err}, expected rejected line {spec.number}")
            elif status == "succeeded":
                want = expected_output(plan, spec)
                if line.get("output") != want:
                    mismatched.append(f"{spec.custom_id} (line {spec.number}): output {line.get('output')!r}, expected {want!r}")
            elif status == "invalid_output" and plan.schema:
                failed.add(spec.custom_id)
            else:
                mismatched.append(f"{spec.custom_id} (line {spec.number}): status {status}, error {line.get('error')}")
        if mismatched:
            self.problem(f"{label} {main.name}: lines that do not match their input: {_examples(mismatched, 3)}")
        if not errors.exists():
            self.problem(f"{label}: errors file {errors.name} missing")
            return
        try:
            erows = [orjson.loads(raw) for raw in errors.read_bytes().splitlines()]
        except orjson.JSONDecodeError as exc:
            self.problem(f"{label} {errors.name}: not JSON lines (torn file?): {exc}")
            return
        rejected = collections.Counter(r.get("line") for r in erows if r.get("status") == "rejected")
        bad_lines = {s.number: s for s in self.specs if s.bad is not None}
        missing = [n for n in bad_lines if rejected.get(n, 0) == 0]
        if missing:
            self.problem(f"{label} {errors.name}: bad lines not listed as rejected: {_examples(missing)}")
        twice = {n: k for n, k in rejected.items() if k > 1}
        if twice:
            self.problem(f"{label} {errors.name}: rejected lines listed more than once (line: times): {_examples(twice.items())}")
        not_bad = [n for n in rejected if n not in bad_lines]
        if not_bad:
            self.problem(f"{label} {errors.name}: good lines listed as rejected: {_examples(not_bad)}")
        wrong_class = [f"line {r['line']}: {r.get('error_class')} (expected {bad_lines[r['line']].error_class})"
                       for r in erows if r.get("status") == "rejected" and r.get("line") in bad_lines
                       and r.get("error_class") != bad_lines[r["line"]].error_class]
        if wrong_class:
            self.problem(f"{label} {errors.name}: rejections with the wrong class: {_examples(wrong_class, 3)}")
        other = {r.get("custom_id") for r in erows if r.get("status") != "rejected"}
        if other != failed:
            self.problem(f"{label} {errors.name}: failed/invalid items {_examples(sorted(map(str, other)))} "
                         f"but the main file has {_examples(sorted(failed))}")

    def check_paid_work(self, items: dict[int, tuple[str, str, str | None, int | None]]) -> None:
        """Compare what the server answered with what the ledger recorded."""
        assert self.db is not None
        plan = self.plan
        log = self.server_log
        self.result.requests = len(log)
        by_text = {s.text: s.number for s in self.specs if s.bad is None}
        received: collections.Counter[int] = collections.Counter()
        responded: collections.Counter[int] = collections.Counter()  # answered with an HTTP status
        ok: collections.Counter[int] = collections.Counter()
        valid_ok: collections.Counter[int] = collections.Counter()
        unknown: collections.Counter[str | None] = collections.Counter()
        for rec in log:
            line = by_text.get(rec.key)  # type: ignore[arg-type]
            if line is None:
                unknown[rec.key] += 1
                continue
            received[line] += 1
            if rec.status is not None:
                responded[line] += 1
            if rec.outcome == "ok":
                ok[line] += 1
                if not plan.schema or rec.output_fault in VALID_FAULTS:
                    valid_ok[line] += 1
        if unknown:
            self.problem(f"server: {sum(unknown.values())} requests for no good input line (rejected lines sent?): "
                         f"{_examples(list(unknown)[:5])}")
        rows = self.db.rows(
            "SELECT i.line, a.status_code, a.input_tokens, a.output_tokens, a.error_class FROM attempts a "
            f"JOIN items i ON a.item_id = i.id WHERE i.job_id = {JOB_ID}", strict=True
        ) or []
        recorded: collections.Counter[int] = collections.Counter()
        with_status: collections.Counter[int] = collections.Counter()
        clean: collections.Counter[int] = collections.Counter()
        valid_clean: collections.Counter[int] = collections.Counter()
        for line, status, tin, tout, error_class in rows:
            recorded[line] += 1
            if status is not None:
                with_status[line] += 1
            if status is not None and 200 <= status < 300 and (tin is not None or tout is not None):
                clean[line] += 1
                if error_class is None:
                    valid_clean[line] += 1
        # A request that never reached the server (the run froze or died with it queued) may
        # still be recorded, as a timeout or connection error without a status; a row with an
        # HTTP status stands for a response the server sent.
        more = {ln: (with_status[ln], responded[ln]) for ln in with_status if with_status[ln] > responded[ln]}
        if more:
            self.problem("ledger: more attempt rows with an HTTP status than responses the server sent (a replayed "
                         f"write?) (line: rows, responses): {_examples(more.items())}")
        more_clean = {ln: (clean[ln], ok[ln]) for ln in clean if clean[ln] > ok[ln]}
        if more_clean:
            self.problem("ledger: more answers recorded than the server gave (line: recorded, answered): "
                         f"{_examples(more_clean.items())}")
        lost = {ln: ok[ln] - clean[ln] for ln in ok if ok[ln] > clean[ln]}
        resent = {ln: valid_ok[ln] - 1 for ln in valid_ok if valid_ok[ln] > 1}
        self.result.lost = sum(lost.values())
        self.result.resent = sum(resent.values())
        bound = plan.concurrency * self.result.disruptive
        if self.result.lost > bound:
            self.problem(f"paid work lost: {self.result.lost} clean answers the server gave were never recorded, "
                         f"more than concurrency {plan.concurrency} x {self.result.disruptive} kill/stop events "
                         f"(line: answers lost): {_examples(sorted(lost.items()), 8)}")
        if self.result.resent > bound:
            twice = sorted(ln for ln in valid_clean if valid_clean[ln] > 1)
            self.problem(f"paid twice: {self.result.resent} valid answers re-sent after one was given, more than "
                         f"concurrency {plan.concurrency} x {self.result.disruptive} kill/stop events (line: extra "
                         f"answers): {_examples(sorted(resent.items()), 8)}; recorded twice in the ledger: {_examples(twice)}")
        unanswered = [ln for ln, (_, state, _, _) in items.items() if state == "succeeded" and ok[ln] == 0]
        if unanswered:
            self.problem(f"items succeeded without a clean answer from the server: {_examples(unanswered)}")

    def check_key(self) -> None:
        key = self.api_key.encode()
        leaks = []
        for path in sorted(self.folder.rglob("*")):
            if path.is_file() and key in path.read_bytes():
                leaks.append(str(path.relative_to(self.folder)))
        if self.plan.backend == "postgres" and self.db is not None:
            for table in ("jobs", "items", "attempts", "runs", "exports"):
                rows = self.db.rows(f"SELECT COUNT(*) FROM {table} x WHERE x::text LIKE '%{self.api_key}%'", strict=True)
                if rows and rows[0][0]:
                    leaks.append(f"PostgreSQL table {table} ({rows[0][0]} rows)")
        if leaks:
            self.problem(f"the API key is written in: {_examples(leaks)}")


def run_round(seed: int, backend: str, folder: Path, *, keep: bool = False) -> RoundResult:
    """Run one round in ``folder`` (made fresh); the folder is removed when it passed, unless ``keep``."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    result = Round(make_plan(seed, backend), folder).run()
    if result.ok and not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def backends() -> list[str]:
    """The backends rounds run on: BATCHRUN_CHAOS_BACKEND (sqlite, postgres or both), by default
    SQLite and, when BATCHRUN_TEST_PG is set, PostgreSQL."""
    wanted = os.environ.get("BATCHRUN_CHAOS_BACKEND", "both")
    have = ["sqlite"] + (["postgres"] if PG_URL else [])
    if wanted == "both":
        return have
    return [b for b in have if b == wanted]


def campaign(
    first_seed: int, rounds: int, folder: Path, *, on_round: Callable[[RoundResult], None] | None = None
) -> list[RoundResult]:
    """``rounds`` rounds from ``first_seed``, alternating backends by seed."""
    kinds = backends()
    results = []
    for seed in range(first_seed, first_seed + rounds):
        backend = kinds[seed % len(kinds)] if kinds else "sqlite"
        result = run_round(seed, backend, folder / f"round-{seed}-{backend}")
        results.append(result)
        if on_round is not None:
            on_round(result)
    return results
