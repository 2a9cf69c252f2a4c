#!/usr/bin/env python3
"""Benchmark harness for issue 7's six scenarios (T1-T6), run against the real ``batchrun`` CLI.

Each scenario generates its input under ``bench/out/<scenario>-<stamp>/``, starts the fake
server (``python -m batchrun.testing serve``) as its own process on an ephemeral 127.0.0.1
port, runs ``batchrun`` (or, for ingest, ``bench/ingest_driver.py``) as a subprocess with a
fresh SQLite ledger, and measures it. Each run prints one JSON line and appends it to
``bench/out/results.jsonl``.

    .venv/bin/python bench/run.py t1            # or t2 ... t6, all; t2l; T3's limiter shapes t3s t3f t3b t3x ...
    .venv/bin/python bench/run.py t1 t2 --repeat 3
    .venv/bin/python bench/run.py t1 --profile  # py-spy record of the batchrun process

Only the standard library is needed by the harness itself (run it with any Python >= 3.11);
the children use ``.venv`` (override with BENCH_PYTHON / BENCH_BATCHRUN).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import selectors
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PY = os.environ.get("BENCH_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BATCHRUN = os.environ.get("BENCH_BATCHRUN", str(ROOT / ".venv" / "bin" / "batchrun"))
PYSPY = os.environ.get("BENCH_PYSPY", shutil.which("py-spy") or "/tmp/prof/bin/py-spy")
PROFILE_RATE = 100  # py-spy samples per second
PROFILE_SECONDS = 0  # --profile-seconds: py-spy --duration (0: the whole process)
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
MODEL = "m"
PROMPT = ("Summarise this review in one neutral sentence. The grinder arrived on time, feels "
          "solid and gives an even grind, but it is loud and the lid does not sit well.")

# ---------------------------------------------------------------------------- helpers


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the harness dies, so no server outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def write_batch_input(path: Path, n: int, prefix: str = "item") -> None:
    """n OpenAI Batch API lines; the user message (the server's log key) is unique per line."""
    line = ('{"custom_id":"%s-%%07d","method":"POST","url":"/v1/chat/completions","body":'
            '{"model":"%s","messages":[{"role":"user","content":"%s-%%07d: %s"}],"max_tokens":32}}\n'
            % (prefix, MODEL, prefix, PROMPT))
    with open(path, "w", buffering=1 << 20) as f:
        for start in range(0, n, 10_000):
            f.writelines(line % (i, i) for i in range(start, min(n, start + 10_000)))


def key_id(key: str | None) -> str | None:
    """custom_id of a server-log key ("item-0000001: Summarise...")."""
    return key.split(":", 1)[0] if key else None


def read_server_log(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    with open(path, "rb") as f:
        for raw in f:
            try:
                out.append(json.loads(raw))
            except ValueError:  # a torn last line
                pass
    return out


def sql(db: Path, query: str, *args: Any, ro: bool = False) -> list[tuple[Any, ...]]:
    uri = f"file:{db}?mode=ro" if ro else f"file:{db}"
    con = sqlite3.connect(uri, uri=True, timeout=30)
    try:
        return con.execute(query, args).fetchall()
    finally:
        con.close()


def ledger_counts(db: Path) -> dict[str, int]:
    return dict(sql(db, "select state, count(*) from items group by state"))


def code_fingerprint() -> dict[str, str]:
    """What code was measured: HEAD (read from .git, git is not run) and a hash of batchrun/."""
    h = hashlib.sha256()
    for p in sorted((ROOT / "batchrun").rglob("*.py")):
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes())
    head = "?"
    try:
        git = ROOT / ".git"
        if git.is_file():  # a worktree: "gitdir: <dir>", whose refs live in the common dir
            git = Path(git.read_text().split(":", 1)[1].strip())
        common = git / "commondir"
        common_dir = (git / common.read_text().strip()).resolve() if common.exists() else git
        ref = (git / "HEAD").read_text().strip()
        if ref.startswith("ref: "):
            name = ref[5:]
            for d in (git, common_dir):
                if (d / name).exists():
                    head = (d / name).read_text().strip()[:12]
                    break
            else:
                for line in (common_dir / "packed-refs").read_text().splitlines():
                    if line.endswith(" " + name):
                        head = line[:12]
        else:
            head = ref[:12]
    except OSError:
        pass
    return {"git_head": head, "batchrun_src_sha256": h.hexdigest()[:12]}


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    pyv = subprocess.run([PY, "-V"], capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": pyv, "kernel": platform.release()}


def cli_supports(command: str, flag: str) -> bool:
    out = subprocess.run([BATCHRUN, command, "--help"], capture_output=True, text=True).stdout
    return flag in out


# ---------------------------------------------------------------------------- processes


class Child:
    """A measured subprocess: reaped with wait4 (its exact rusage), CPU sampled via /proc."""

    def __init__(self, cmd: list[str], workdir: Path, name: str, *, profile: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.stdout_path = workdir / f"{name}.out"
        self.stderr_path = workdir / f"{name}.err"
        if profile is not None:  # py-spy becomes the parent; figures are then not comparable
            cmd = [PYSPY, "record", "--format", "raw", "--threads", "--rate", str(PROFILE_RATE),
                   *(["--duration", str(PROFILE_SECONDS)] if PROFILE_SECONDS else []),
                   "-o", str(profile), "--"] + cmd
        self.cmd = [str(c) for c in cmd]
        self.samples: list[tuple[float, float, float]] = []  # (wall, cpu_s, rss_mb)
        self.timed_out = False
        self.killed_at: float | None = None
        self._res: tuple[int, Any] | None = None
        self.t_end: float | None = None
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.t_start = time.time()
            self.p = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                      cwd=ROOT, preexec_fn=_die_with_parent)
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        _, status, ru = os.wait4(self.p.pid, 0)
        self.t_end = time.time()
        self._res = (status, ru)

    def alive(self) -> bool:
        return self._waiter.is_alive()

    def sample(self) -> None:
        try:
            with open(f"/proc/{self.p.pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return
        cpu = (int(rest[11]) + int(rest[12])) / CLK_TCK
        self.samples.append((time.time(), cpu, int(rest[21]) * PAGE_KB / 1024))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            try:
                os.kill(self.p.pid, sig)
                if self.killed_at is None:
                    self.killed_at = time.time()
            except ProcessLookupError:
                pass

    def run(self, timeout: float, poll: Callable[[Child], None] | None = None,
            interval: float = 0.05) -> dict[str, Any]:
        deadline = self.t_start + timeout
        while self.alive():
            self.sample()
            if poll is not None:
                poll(self)
            if time.time() > deadline:
                self.timed_out = True
                self.kill()
                break
            self._waiter.join(interval)
        self._waiter.join(30)
        return self.result()

    def result(self) -> dict[str, Any]:
        if self._res is None:
            raise RuntimeError(f"{self.name}: could not reap pid {self.p.pid}")
        status, ru = self._res
        self.p.returncode = os.waitstatus_to_exitcode(status)
        assert self.t_end is not None
        return {
            "rc": self.p.returncode,
            "wall_s": round(self.t_end - self.t_start, 3),
            "cpu_user_s": round(ru.ru_utime, 3),
            "cpu_sys_s": round(ru.ru_stime, 3),
            "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "maxrss_mb": round(ru.ru_maxrss / 1024, 1),
            "timed_out": self.timed_out,
        }

    def cpu_at(self, t: float) -> float:
        """CPU seconds used by the child at wall time t (last /proc sample not after t)."""
        best = 0.0
        for wall, cpu, _ in self.samples:
            if wall > t:
                break
            best = cpu
        return best

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr_tail(self, n: int = 600) -> str:
        return self.stderr_path.read_text(errors="replace")[-n:]

    def ensure_dead(self) -> None:
        if self.alive():
            self.kill()
            self._waiter.join(10)


class Server:
    """The fake OpenAI server in its own process, on an ephemeral 127.0.0.1 port."""

    def __init__(self, workdir: Path, name: str = "server", *, latency: float, rpm: int | None = None,
                 window: float | None = None, extra: list[str] = (), command: list[str] | None = None) -> None:
        self.log_path = workdir / f"{name}.jsonl"
        self.log_path.unlink(missing_ok=True)
        if command is not None:  # another server (bench/limiter_server.py) that speaks the same log
            cmd = [*command, "--port", "0", "--latency", str(latency), "--log", str(self.log_path)]
        else:
            cmd = [PY, "-m", "batchrun.testing", "serve", "--port", "0", "--latency", str(latency),
                   "--log", str(self.log_path)]
            if rpm is not None:
                cmd += ["--rpm", str(rpm)]
            if window is not None:
                cmd += ["--rpm-window", str(window)]  # the per-minute limit enforced over a shorter window
        cmd += list(extra)
        self.cmd = cmd
        self.cpu_s: float | None = None
        with open(workdir / f"{name}.err", "wb") as err:
            self.p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                      cwd=ROOT, preexec_fn=_die_with_parent)
        try:
            self.base_url = self._await_listening(30.0)
        except BaseException:
            self.stop()
            raise
        if not self.base_url.startswith("http://127.0.0.1:"):
            self.stop()
            raise RuntimeError(f"server is not on 127.0.0.1: {self.base_url}")

    def _await_listening(self, timeout: float) -> str:
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        buf = b""
        deadline = time.monotonic() + timeout
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError("fake server did not say 'listening on' in time")
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"fake server exited: rc={self.p.poll()}")
                buf += chunk
        finally:
            sel.close()
        line = buf.split(b"\n", 1)[0].decode()
        if not line.startswith("listening on "):
            raise RuntimeError(f"unexpected first line from the fake server: {line!r}")
        return line.split()[-1]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; records the server's CPU seconds."""
        if self.p.returncode is not None:
            return
        try:
            self.p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while True:
            pid, status, ru = os.wait4(self.p.pid, os.WNOHANG)
            if pid:
                self.p.returncode = os.waitstatus_to_exitcode(status)
                self.cpu_s = round(ru.ru_utime + ru.ru_stime, 2)
                break
            if time.monotonic() > deadline:
                self.p.kill()
                deadline = time.monotonic() + 10
            time.sleep(0.02)
        if self.p.stdout:
            self.p.stdout.close()

    def records(self) -> list[dict[str, Any]]:
        return read_server_log(self.log_path)


# ---------------------------------------------------------------------------- scenarios


class Ctx:
    def __init__(self, out: Path, profile: bool, keep_big: bool, kill_delay: float = 0.0) -> None:
        self.kill_delay = kill_delay
        self.out = out
        self.profile = profile
        self.keep_big = keep_big

    def workdir(self, name: str) -> Path:
        stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for i in range(100):
            d = self.out / (stem if i == 0 else f"{stem}-{i}")
            try:
                d.mkdir(parents=True, exist_ok=False)
                return d
            except FileExistsError:
                continue
        raise RuntimeError(f"cannot make a work dir for {stem}")


EXTRA_ARGS: list[str] = []  # --extra-args: appended to every batchrun submit/resume command line


def submit_cmd(inp: Path, db: Path, base_url: str, concurrency: int, extra: list[str] = ()) -> list[str]:
    return [BATCHRUN, "submit", "--input", str(inp), "--base-url", base_url, "--model", MODEL,
            "--db", str(db), "--quiet", "--concurrency", str(concurrency), *extra, *EXTRA_ARGS]


def _submit_to_server(wd: Path, inp: Path, db: Path, latency: float, concurrency: int, timeout: float,
                      prof: Path | None) -> tuple[dict[str, Any], Child, Server]:
    """``batchrun submit`` of ``inp`` against a fresh fake server, killed after ``timeout`` s."""
    srv = Server(wd, latency=latency)
    child: Child | None = None
    try:
        child = Child(submit_cmd(inp, db, srv.base_url, concurrency), wd, "submit", profile=prof)
        res = child.run(timeout)
    finally:
        if child is not None:
            child.ensure_dead()
        srv.stop()
    return res, child, srv


def _throughput(ctx: Ctx, name: str, n: int, latency: float, concurrency: int,
                timeout: float) -> tuple[dict[str, Any], Path]:
    wd = ctx.workdir(name)
    inp, db = wd / "input.jsonl", wd / "ledger.db"
    write_batch_input(inp, n)
    prof = wd / "profile.txt" if ctx.profile else None
    res, child, srv = _submit_to_server(wd, inp, db, latency, concurrency, timeout, prof)
    recs = srv.records()
    counts = ledger_counts(db) if db.exists() else {}
    ok = sum(1 for r in recs if r["outcome"] == "ok")
    first_rx = min((r["received_at"] for r in recs), default=None)
    last_fin = max((r["finished_at"] for r in recs), default=None)
    (a0,), = sql(db, "select min(started_at) from attempts")
    (f1,), = sql(db, "select max(finished_at) from items")
    run_s = (f1 - a0) if a0 and f1 else None
    srv_span = (last_fin - first_rx) if recs else None
    f: dict[str, Any] = {
        "n": n, "latency_s": latency, "concurrency": concurrency, **res,
        "succeeded": counts.get("succeeded", 0), "counts": counts,
        "server_requests": len(recs), "server_ok": ok,
        "server_outcomes": dict(Counter(r["outcome"] for r in recs)),
        "server_cpu_s": srv.cpu_s,
        "items_per_s_e2e": round(n / res["wall_s"], 1),
        "run_phase_s": round(run_s, 3) if run_s else None,
        "items_per_s_run": round(n / run_s, 1) if run_s else None,
        "server_span_s": round(srv_span, 3) if srv_span else None,
        "startup_ingest_s": round(first_rx - child.t_start, 3) if first_rx else None,
        "after_last_answer_s": round(child.t_end - last_fin, 3) if last_fin and child.t_end else None,
        "cpu_s_per_1000_e2e": round(res["cpu_s"] / n * 1000, 3),
    }
    if first_rx and not ctx.profile:
        cpu_run = res["cpu_s"] - child.cpu_at(first_rx)
        f["cpu_s_before_first_request"] = round(child.cpu_at(first_rx), 2)
        f["cpu_s_per_1000_run"] = round(cpu_run / n * 1000, 3)
    if prof is not None:
        f["profile"] = str(prof)
    if res["rc"] != 0 or f["succeeded"] != n:
        f["problem"] = f"rc={res['rc']} succeeded={f['succeeded']}/{n}: {child.stderr_tail()}"
    return f, wd


def t1(ctx: Ctx) -> dict[str, Any]:
    f, _ = _throughput(ctx, "t1", 20_000, 0.0, 100, timeout=600)
    f["target"] = ">= 800 items/s end to end, <= 0.6 CPU-s per 1,000 items"
    f["met"] = f["items_per_s_e2e"] >= 800 and f["cpu_s_per_1000_e2e"] <= 0.6
    return f


def _t2(ctx: Ctx, name: str, n: int) -> dict[str, Any]:
    f, _ = _throughput(ctx, name, n, 0.2, 200, timeout=300)
    ideal = 200 / 0.2
    f["ideal_items_per_s"] = ideal
    f["ideal_s"] = n / ideal
    f["pct_of_ideal_e2e"] = round(100 * f["items_per_s_e2e"] / ideal, 1)
    f["pct_of_ideal_run"] = round(100 * f["items_per_s_run"] / ideal, 1) if f["items_per_s_run"] else None
    f["target"] = ">= 90% of ideal (1,000 items/s)"
    f["met"] = f["pct_of_ideal_e2e"] >= 90
    return f


def t2(ctx: Ctx) -> dict[str, Any]:
    return _t2(ctx, "t2", 5_000)


def t2l(ctx: Ctx) -> dict[str, Any]:
    """T2 where start-up is amortised (issue 18): 20,000 items, ideal 20 s."""
    return _t2(ctx, "t2l", 20_000)


LIMITER_SERVER = [sys.executable, str(BENCH / "limiter_server.py")]  # stdlib only, any Python

# T3's limiter shapes: (what the server enforces, its command-line, whether batchrun gets --rpm, target).
# "ours" is python -m batchrun.testing serve; "indep" is bench/limiter_server.py, written apart from it.
T3_VARIANTS: dict[str, dict[str, Any]] = {
    "t3": {"limiter": "ours: 3000 per sliding 60 s", "serve": ["--rpm", "3000"], "rpm": True,
           "target": (98.0, 0.0)},
    "t3s": {"limiter": "ours: 50 per sliding 1 s", "serve": ["--rpm", "3000", "--rpm-window", "1"], "rpm": True,
            "target": (95.0, 0.5)},
    "t3f": {"limiter": "ours: 50 per fixed 1 s window, integer Retry-After",
            "serve": ["--rpm", "3000", "--rpm-window", "1", "--rpm-shape", "fixed", "--retry-after-integer"],
            "rpm": True, "target": (95.0, 0.5)},
    "t3b": {"limiter": "ours: token bucket 50/s, burst 1, integer Retry-After",
            "serve": ["--rpm", "3000", "--rpm-window", "1", "--rpm-shape", "bucket", "--rpm-burst", "1",
                      "--retry-after-integer"], "rpm": True, "target": (95.0, 0.5)},
    "t3x": {"limiter": "independent: 50 per fixed 1 s window, integer Retry-After, headers",
            "command": ["--shape", "fixed", "--limit", "50", "--period", "1", "--headers"], "rpm": True,
            "target": (95.0, 0.5)},
    "t3xb": {"limiter": "independent: token bucket 50/s, burst 1, integer Retry-After, no headers",
             "command": ["--shape", "bucket", "--rate", "50", "--burst", "1"], "rpm": True, "target": (95.0, 0.5)},
    "t3u": {"limiter": "ours, limit unknown (no --rpm): 50 per fixed 1 s window, headers, integer Retry-After",
            "serve": ["--rpm", "3000", "--rpm-window", "1", "--rpm-shape", "fixed", "--retry-after-integer"],
            "rpm": False, "target": (90.0, 2.0)},
    "t3xu": {"limiter": "independent, limit unknown (no --rpm): 50 per fixed 1 s window, headers, "
                        "integer Retry-After",
             "command": ["--shape", "fixed", "--limit", "50", "--period", "1", "--headers"], "rpm": False,
             "target": (90.0, 2.0)},
    "t3xnu": {"limiter": "independent, limit unknown (no --rpm): 50 per fixed 1 s window, no headers, "
                         "integer Retry-After", "command": ["--shape", "fixed", "--limit", "50", "--period", "1"],
              "rpm": False, "target": (90.0, 2.0)},
    "t3xbu": {"limiter": "independent, limit unknown (no --rpm): token bucket 50/s, burst 1, no headers",
              "command": ["--shape", "bucket", "--rate", "50", "--burst", "1"], "rpm": False,
              "target": (90.0, 2.0)},
}


def _t3(ctx: Ctx, name: str) -> dict[str, Any]:
    variant = T3_VARIANTS[name]
    n, limit_per_min, concurrency, latency = 4_500, 3_000, 100, 0.2
    wd = ctx.workdir(name)
    inp, db = wd / "input.jsonl", wd / "ledger.db"
    write_batch_input(inp, n)
    client_rpm = variant["rpm"]
    extra = ["--rpm", str(limit_per_min)] if client_rpm else []
    if "command" in variant:
        srv = Server(wd, latency=latency, command=[*LIMITER_SERVER, *variant["command"]])
    else:
        srv = Server(wd, latency=latency, extra=variant["serve"])
    child: Child | None = None
    try:
        child = Child(submit_cmd(inp, db, srv.base_url, concurrency, extra), wd, "submit")
        res = child.run(600)
    finally:
        if child is not None:
            child.ensure_dead()
        srv.stop()
    recs = srv.records()
    counts = ledger_counts(db) if db.exists() else {}
    oks = sorted(r["finished_at"] for r in recs if r["outcome"] == "ok")
    n429 = sum(1 for r in recs if r["status"] == 429)
    first_rx = min(r["received_at"] for r in recs) if recs else None
    span = (oks[-1] - first_rx) if oks else None
    rate = len(oks) / span * 60 if span else None
    # Accepted requests per whole wall-clock second (the fixed windows), first and last seconds left out.
    per_second = Counter(int(r["received_at"]) for r in recs if r["outcome"] == "ok")
    full = sorted(per_second)[1:-1]
    f: dict[str, Any] = {
        "n": n, "latency_s": latency, "concurrency": concurrency,
        "server_limit": variant["limiter"], "client_rpm_configured": client_rpm, **res,
        "succeeded": counts.get("succeeded", 0), "counts": counts,
        "server_requests": len(recs), "server_ok": len(oks), "server_429": n429,
        "pct_429": round(100 * n429 / len(recs), 2) if recs else None,
        "span_first_request_to_last_ok_s": round(span, 2) if span else None,
        "achieved_rpm": round(rate, 1) if rate else None,
        "pct_of_limit": round(100 * rate / limit_per_min, 1) if rate else None,
        "paced_ideal_s": n / (limit_per_min / 60),
        "max_ok_per_wall_second": max((per_second[s] for s in full), default=None),
        "server_outcomes": dict(Counter(r["outcome"] for r in recs)),
    }
    pct, p429 = variant["target"]
    f["target"] = f">= {pct:g}% of the limit, <= {p429:g}% of requests answered 429"
    f["met"] = bool(rate) and f["pct_of_limit"] >= pct and f["pct_429"] <= p429
    if res["rc"] != 0 or f["succeeded"] != n:
        f["problem"] = f"rc={res['rc']} succeeded={f['succeeded']}/{n}: {child.stderr_tail() if child else ''}"
    return f


def _t3_variant(name: str) -> Callable[[Ctx], dict[str, Any]]:
    def run(ctx: Ctx) -> dict[str, Any]:
        return _t3(ctx, name)
    run.__name__ = name
    return run


def t4(ctx: Ctx) -> dict[str, Any]:
    n, latency, concurrency = 10_000, 0.05, 100
    wd = ctx.workdir("t4")
    inp, db = wd / "input.jsonl", wd / "ledger.db"
    write_batch_input(inp, n)
    srv = Server(wd, latency=latency)
    sub: Child | None = None
    res_child: Child | None = None
    seen: dict[str, Any] = {"polled_succeeded": 0, "reached_at": None}

    def poll(c: Child) -> None:
        if c.killed_at is not None or not db.exists():
            return
        if seen["reached_at"] is None:
            try:
                (k,), = sql(db, "select count(*) from items where state='succeeded'", ro=True)
            except sqlite3.Error:
                return
            seen["polled_succeeded"] = k
            if k >= n // 2:
                seen["reached_at"] = time.time()
        if seen["reached_at"] is not None and time.time() >= seen["reached_at"] + ctx.kill_delay:
            c.kill(signal.SIGKILL)

    try:
        sub = Child(submit_cmd(inp, db, srv.base_url, concurrency), wd, "submit")
        sub_res = sub.run(300, poll=poll, interval=0.01)
        kill_t = sub.killed_at
        time.sleep(max(1.0, 4 * latency))  # let the server finish what was in flight
        (job_id,), = sql(db, "select max(id) from jobs")
        (committed,), = sql(db, "select count(*) from items where state='succeeded'")
        committed_ids = {r[0] for r in sql(db, "select custom_id from items where state='succeeded'")}
        res_child = Child([BATCHRUN, "resume", str(job_id), "--db", str(db), "--quiet",
                           "--concurrency", str(concurrency), *EXTRA_ARGS], wd, "resume")
        res = res_child.run(300)
    finally:
        for c in (sub, res_child):
            if c is not None:
                c.ensure_dead()
        srv.stop()
    recs = srv.records()
    counts = ledger_counts(db)
    f: dict[str, Any] = {"n": n, "latency_s": latency, "concurrency": concurrency,
                         "submit_rc": sub_res["rc"], "killed": kill_t is not None}
    if kill_t is None:
        f["problem"] = f"submit was not killed at 50% (rc={sub_res['rc']}): {sub.stderr_tail() if sub else ''}"
        f["met"] = False
        return f
    before = [r for r in recs if r["received_at"] < kill_t]
    after = [r for r in recs if r["received_at"] >= res_child.t_start]
    stray = len(recs) - len(before) - len(after)  # received between the kill and the resume
    keys_before = {r["key"] for r in before}
    keys_after = {r["key"] for r in after}
    ok_per_key = Counter(r["key"] for r in recs if r["outcome"] == "ok")
    ok_before = {r["key"] for r in before if r["outcome"] == "ok"}
    resent = keys_before & keys_after
    f.update({
        "kill_delay_s": ctx.kill_delay,
        "submit_wall_s": sub_res["wall_s"],
        "polled_succeeded_at_50pct": seen["polled_succeeded"],
        "in_flight_at_kill": sum(1 for r in before if r["finished_at"] > kill_t),
        "committed_succeeded_at_kill": committed,
        "requests_before_kill": len(before), "requests_after_resume": len(after),
        "requests_between_kill_and_resume": stray,
        "ok_before_kill_not_committed": sum(1 for k in ok_before if key_id(k) not in committed_ids),
        "resent_keys": len(resent),
        "resent_keys_answered_ok_before": len(resent & ok_before),
        "keys_answered_ok_twice": sum(1 for v in ok_per_key.values() if v > 1),
        "extra_ok_answers": sum(v - 1 for v in ok_per_key.values() if v > 1),
        "resume_rc": res["rc"], "resume_wall_s": res["wall_s"], "resume_cpu_s": res["cpu_s"],
        "final_succeeded": counts.get("succeeded", 0), "counts": counts,
        "server_requests": len(recs),
    })
    f["target"] = "re-sent <= the concurrency (100)"
    f["met"] = f["resent_keys"] <= concurrency and f["final_succeeded"] == n
    if res["rc"] != 0 or f["final_succeeded"] != n:
        f["problem"] = f"resume rc={res['rc']} succeeded={f['final_succeeded']}/{n}: {res_child.stderr_tail()}"
    return f


def _ingest(wd: Path, inp: Path, db: Path, profile: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    child = Child([PY, str(BENCH / "ingest_driver.py"), "--db", str(db), "--input", str(inp)], wd, "ingest",
                  profile=profile)
    try:
        res = child.run(900)
    finally:
        child.ensure_dead()
    if res["rc"] != 0:
        raise RuntimeError(f"ingest driver failed rc={res['rc']}: {child.stderr_tail()}")
    # the last JSON line (under --profile, py-spy writes its own lines to stdout too)
    driver = json.loads([ln for ln in child.stdout().splitlines() if ln.startswith("{")][-1])
    res["peak_rss_sampled_mb"] = round(max((s[2] for s in child.samples), default=0.0), 1)
    return res, driver


def t5(ctx: Ctx) -> dict[str, Any]:
    n = 1_000_000
    wd = ctx.workdir("t5")
    inp, db = wd / "input.jsonl", wd / "ledger.db"
    t = time.time()
    write_batch_input(inp, n)
    gen_s = time.time() - t
    prof = wd / "profile.txt" if ctx.profile else None
    res, driver = _ingest(wd, inp, db, prof)
    f: dict[str, Any] = {
        "n": n, "input_mb": round(inp.stat().st_size / 2**20, 1), "input_gen_s": round(gen_s, 1),
        "process_wall_s": res["wall_s"], "process_cpu_s": res["cpu_s"],
        "peak_rss_mb": res["maxrss_mb"], **{f"driver_{k}": v for k, v in driver.items()},
        "db_mb": round(sum(p.stat().st_size for p in wd.glob("ledger.db*")) / 2**20, 1),
    }
    if prof is not None:
        f["profile"] = str(prof)
    f["target"] = "<= 15 s, <= 150 MB peak RSS"
    f["met"] = f["process_wall_s"] <= 15 and f["peak_rss_mb"] <= 150 and driver["accepted"] == n
    if not ctx.keep_big:
        inp.unlink(missing_ok=True)
        for p in wd.glob("ledger.db*"):
            p.unlink()
    return f


def t5s(ctx: Ctx) -> dict[str, Any]:
    """Issue 18's T5: submit 1,000,000 lines at 0 ms latency; the first request's time after exec,
    the requests answered in the first 30 s, peak RSS. The submit is SIGKILLed at 30 s."""
    n, window, concurrency = 1_000_000, 30.0, 100
    wd = ctx.workdir("t5s")
    inp, db = wd / "input.jsonl", wd / "ledger.db"
    write_batch_input(inp, n)
    prof = wd / "profile.txt" if ctx.profile else None
    res, child, srv = _submit_to_server(wd, inp, db, 0.0, concurrency, window, prof)
    recs = srv.records()
    first_rx = min((r["received_at"] for r in recs), default=None)
    cut = child.t_start + window
    ok_in_window = sum(1 for r in recs if r["outcome"] == "ok" and r["finished_at"] <= cut)
    lines_in = sql(db, "select count(*) from items")[0][0] if db.exists() else 0
    f: dict[str, Any] = {
        "n": n, "latency_s": 0.0, "concurrency": concurrency, "window_s": window,
        "time_to_first_request_s": round(first_rx - child.t_start, 3) if first_rx else None,
        "cpu_s_before_first_request": round(child.cpu_at(first_rx), 2) if first_rx else None,
        "requests_ok_in_window": ok_in_window, "server_requests": len(recs),
        "lines_stored_at_kill": lines_in, "peak_rss_mb": res["maxrss_mb"],
        "peak_rss_sampled_mb": round(max((s[2] for s in child.samples), default=0.0), 1),
        "cpu_s": res["cpu_s"],
    }
    if prof is not None:
        f["profile"] = str(prof)
    f["target"] = "first request <= 1 s after exec, peak RSS <= 150 MB (requests in 30 s: vs the cookbook)"
    ttfr = f["time_to_first_request_s"]
    f["met"] = ttfr is not None and ttfr <= 1.0 and f["peak_rss_mb"] <= 150
    if not ctx.keep_big:
        inp.unlink(missing_ok=True)
        for p in wd.glob("ledger.db*"):
            p.unlink()
    return f


SUCCEEDED_RESPONSE = json.dumps({
    "id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "echo: " + PROMPT},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 32, "total_tokens": 72},
})


def mark_done(db: Path, job_id: int, done: int) -> None:
    """Make the first `done` items look worked: succeeded with a response, one attempt row each."""
    now = time.time()
    con = sqlite3.connect(db, timeout=60)
    try:
        con.execute("pragma journal_mode=wal")
        (cut,), = con.execute("select id from items where job_id=? order by id limit 1 offset ?",
                              (job_id, done - 1)).fetchall()
        con.execute("begin immediate")
        con.execute(
            "update items set state='succeeded', attempts=1, status_code=200, response=?, "
            "output='echo', request_id='req_seed', input_tokens=40, output_tokens=32, latency_ms=50.0, "
            "finished_at=? where job_id=? and id<=?", (SUCCEEDED_RESPONSE, now, job_id, cut))
        con.execute(
            "insert into attempts(job_id, item_id, run_id, number, started_at, queue_wait_ms, latency_ms, "
            "status_code, error_class, input_tokens, output_tokens) "
            "select job_id, id, 'benchseed', 1, finished_at - 0.05, 0.0, 50.0, 200, null, 40, 32 "
            "from items where job_id=? and id<=?", (job_id, cut))
        con.execute("commit")
        con.execute("pragma wal_checkpoint(truncate)")
    finally:
        con.close()


def t6(ctx: Ctx) -> dict[str, Any]:
    n, done, latency, concurrency = 1_000_000, 990_000, 0.05, 100
    wd = ctx.workdir("t6")
    inp, db = wd / "input.jsonl", wd / "ledger.db"
    t = time.time()
    write_batch_input(inp, n)
    _, driver = _ingest(wd, inp, db)
    mark_done(db, driver["job_id"], done)
    setup_s = time.time() - t
    counts0 = ledger_counts(db)
    prof = wd / "profile.txt" if ctx.profile else None
    srv = Server(wd, latency=latency)
    child: Child | None = None
    try:
        # The job was ingested with a dummy base URL: point the resume at the fake server.
        child = Child([BATCHRUN, "resume", str(driver["job_id"]), "--db", str(db), "--quiet",
                       "--base-url", srv.base_url, "--concurrency", str(concurrency), *EXTRA_ARGS],
                      wd, "resume", profile=prof)
        res = child.run(600)
    finally:
        if child is not None:
            child.ensure_dead()
        srv.stop()
    recs = srv.records()
    counts = ledger_counts(db)
    first_rx = min((r["received_at"] for r in recs), default=None)
    f: dict[str, Any] = {
        "n": n, "done_before": counts0.get("succeeded", 0), "setup_s": round(setup_s, 1),
        "db_mb": round(sum(p.stat().st_size for p in wd.glob("ledger.db*")) / 2**20, 1),
        "time_to_first_request_s": round(first_rx - child.t_start, 3) if first_rx else None,
        "cpu_s_before_first_request": round(child.cpu_at(first_rx), 2) if first_rx else None,
        "resume_rc": res["rc"], "resume_wall_s": res["wall_s"], "resume_cpu_s": res["cpu_s"],
        "resume_maxrss_mb": res["maxrss_mb"], "server_requests": len(recs),
        "final_succeeded": counts.get("succeeded", 0), "counts": counts,
    }
    if prof is not None:
        f["profile"] = str(prof)
    f["target"] = "<= 2 s from resume start to first request"
    f["met"] = f["time_to_first_request_s"] is not None and f["time_to_first_request_s"] <= 2
    if res["rc"] != 0 or f["final_succeeded"] != n:
        f["problem"] = f"resume rc={res['rc']} succeeded={f['final_succeeded']}/{n}: {child.stderr_tail()}"
    if not ctx.keep_big:
        inp.unlink(missing_ok=True)
        for p in wd.glob("ledger.db*"):
            p.unlink()
    return f


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "t1": t1, "t2": t2, "t2l": t2l, **{name: _t3_variant(name) for name in T3_VARIANTS},
    "t4": t4, "t5": t5, "t5s": t5s, "t6": t6,
}
PROFILABLE = {"t1", "t2", "t2l", "t5", "t5s", "t6"}


def precompile() -> None:
    """Byte-compile the batchrun that will run, as a regular (non-editable) install does.

    With PYTHONDONTWRITEBYTECODE set (it is, on this machine) an editable install
    compiles batchrun's modules from source on every start: ~0.15 s of each
    end-to-end figure that a user's ``pip install batchrun`` never pays.
    """
    python = str(Path(BATCHRUN).parent / "python")
    subprocess.run([python, "-c", "import batchrun, compileall, os; from batchrun.bundled import bundled_dir; "
                    "compileall.compile_dir(os.path.dirname(batchrun.__file__), quiet=1); "
                    "compileall.compile_dir(str(bundled_dir('migrations')), quiet=1)"], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="+", choices=[*SCENARIOS, "all"])
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times")
    ap.add_argument("--out", type=Path, default=BENCH / "out", help="work dir (default bench/out)")
    ap.add_argument("--profile", action="store_true",
                    help=f"run the measured process under py-spy ({', '.join(sorted(PROFILABLE))}); "
                         "figures of a profiled run are not comparable")
    ap.add_argument("--profile-seconds", type=int, default=0,
                    help="with --profile: sample only the first S seconds (py-spy --duration), "
                         "e.g. t6's start-up")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--kill-delay", type=float, default=0.0,
                    help="t4: SIGKILL this many seconds after 50%% are seen succeeded (default 0)")
    ap.add_argument("--extra-args", default="",
                    help="extra arguments for every batchrun submit/resume, e.g. '--transport httpx'")
    ap.add_argument("--keep-big", action="store_true", help="keep T5/T6 inputs and ledgers (~0.5 GB each)")
    args = ap.parse_args()
    names = list(SCENARIOS) if "all" in args.scenarios else args.scenarios
    if args.profile:
        if not Path(PYSPY).exists():
            ap.error(f"py-spy not found at {PYSPY} (set BENCH_PYSPY)")
        bad = [s for s in names if s not in PROFILABLE]
        if bad:
            ap.error(f"--profile supports {sorted(PROFILABLE)}, not {bad}")
    EXTRA_ARGS.extend(shlex.split(args.extra_args))
    global PROFILE_SECONDS, PROFILE_RATE
    PROFILE_SECONDS, PROFILE_RATE = args.profile_seconds, args.profile_rate
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args.out, args.profile, args.keep_big, args.kill_delay)
    precompile()
    static = machine()
    failures = 0
    for _ in range(args.repeat):
        for name in names:
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            # per run: other people may be changing the code (and loading the machine) meanwhile
            meta = {**static, "loadavg_at_start": os.getloadavg()[0], **code_fingerprint()}
            try:
                figures = SCENARIOS[name](ctx)
            except Exception as exc:  # record the failure, go on with the next scenario
                figures = {"error": f"{type(exc).__name__}: {exc}", "met": False}
                failures += 1
            if figures.get("problem"):  # a run that did not finish its items meets nothing
                figures["met"] = False
            line = {"scenario": name, "started": started, "profiled": args.profile,
                    "extra_args": args.extra_args, **figures, "machine": meta}
            text = json.dumps(line, sort_keys=False)
            print(text, flush=True)
            with open(args.out / "results.jsonl", "a") as f:
                f.write(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
