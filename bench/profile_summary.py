#!/usr/bin/env python3
"""Summarise a py-spy ``--format raw --threads`` profile (collapsed stacks) into shares of samples.

    python bench/profile_summary.py bench/out/t1-.../profile.txt [--top 25] [--phase run]

py-spy (without --idle) samples only threads that are running, so a share of samples is
roughly a share of the process's CPU time. Prints:

- samples per thread;
- self time by package (the leaf frame's package: httpx, aiohttp, sqlalchemy, asyncio, ...,
  batchrun.<module>), i.e. where the CPU is actually spent;
- inclusive time of batchrun's own functions (what to optimise, with callees);
- the top leaf functions and the top inclusive functions overall.

``--phase run`` keeps only stacks under ``asyncio.run`` / the ledger thread (the request
loop), ``--phase ingest`` only those under ``prepare_job``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(frame: str) -> tuple[str, str]:
    """('func', 'path/file.py') of a py-spy frame 'func (path/file.py:123)'."""
    m = _FRAME.match(frame)
    if not m:
        return frame, ""
    return m.group("func"), m.group("file")


def package(file: str) -> str:
    if not file:
        return "?"
    f = file
    for marker in ("site-packages/", "/lib/python3.11/", "/lib/python3.12/", "/lib/python3.13/"):
        if marker in f:
            f = f.split(marker, 1)[1]
    if f.startswith("batchrun/"):
        return "batchrun." + f[len("batchrun/"):].removesuffix(".py").replace("/", ".")
    head = f.split("/", 1)[0]
    if head.endswith(".py"):
        head = head[:-3]
    return head


# (category, markers): a sample goes to the first category with a marker in any of its frames.
BREAKDOWN = [
    ("ledger: Ledger.record (commit outcomes + attempts)", ["Ledger.record ("]),
    ("ledger: Ledger.claim", ["Ledger.claim ("]),
    ("ledger: other Ledger calls (ingest, counts, ...)", ["(batchrun/ledger/"]),
    ("ledger thread: waiting in the executor (_worker, idle or GIL wait)", ["#thread:batchrun-ledger"]),
    ("imports", ["_find_and_load ("]),
    ("httpx: build_request (URL parse, headers, cookies)", ["BaseClient.build_request ("]),
    ("httpx: cookie extraction from responses", ["Cookies.extract_cookies ("]),
    ("aiohttp transport: send request, read response head", ["AiohttpTransport.handle_async_request ("]),
    ("httpx: send() bookkeeping (auth/redirect/hooks)", ["AsyncClient.send ("]),
    ("httpx: Response.aread / aclose", ["Response.aread (", "Response.aclose ("]),
    ("aiohttp: protocol data_received (response parsing)", ["data_received ("]),
    ("batchrun: OpenAIProvider.parse / prepare", ["OpenAIProvider."]),
    ("tenacity (per-item AsyncRetrying)", ["(tenacity/"]),
    ("asyncio.timeout", ["(asyncio/timeouts.py"]),
    ("batchrun: rate limiting (ratelimit.py)", ["(batchrun/ratelimit.py"]),
    ("batchrun: scheduler code (incl. asyncio calls it makes)", ["(batchrun/scheduler.py"]),
    ("asyncio: event loop, selector, tasks", ["(asyncio/", "(selectors.py"]),
    ("other", [""]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--phase", choices=["all", "run", "ingest"], default="all")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print a one-category-per-sample breakdown of the request loop")
    ap.add_argument("--focus", action="append", default=[],
                    help="also print the inclusive share of functions containing this text (repeatable)")
    args = ap.parse_args()

    threads: Counter[str] = Counter()
    breakdown: Counter[str] = Counter()
    self_pkg: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    total = 0
    for raw in args.profile.read_text().splitlines():
        stack, _, count = raw.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith("thread ") else "?"
        if thread != "?":
            frames = frames[1:]
            thread = re.sub(r"^thread \(\d+\): ?", "", thread) or "?"
        if args.phase == "run":
            # the event loop (item tasks start at Handle._run, not under JobRunner.run) + ledger thread
            if not (thread.startswith("batchrun-ledger")
                    or any(f.startswith("Runner.run (asyncio/runners.py") for f in frames)):
                continue
        elif args.phase == "ingest":
            if not any(f.startswith("prepare_job ") for f in frames):
                continue
        total += n
        threads[thread] += n
        tagged = frames + [f"#thread:{thread}"]
        for cat, markers in BREAKDOWN:
            if any(m in fr for fr in tagged for m in markers):
                breakdown[cat] += n
                break
        if frames:
            func, file = parse_frame(frames[-1])
            self_pkg[package(file)] += n
            self_fn[f"{func} ({file})"] += n
        seen: set[str] = set()
        for fr in frames:
            func, file = parse_frame(fr)
            key = f"{func} ({file})"
            if key not in seen:
                seen.add(key)
                incl_fn[key] += n
    if not total:
        print("no samples")
        return

    def show(title: str, counter: Counter[str], top: int, pred=lambda k: True) -> None:
        print(f"\n## {title}")
        for k, v in [kv for kv in counter.most_common() if pred(kv[0])][:top]:
            print(f"{100 * v / total:6.1f}%  {k}")

    print(f"{args.profile}: {total} samples (phase={args.phase})")
    show("samples by thread", threads, 10)
    show("self time by package (leaf frame)", self_pkg, args.top)
    show("inclusive time of batchrun functions", incl_fn, args.top, lambda k: "(batchrun/" in k)
    show("self time by function (leaf frame)", self_fn, args.top)
    show("inclusive time, all functions", incl_fn, args.top)
    if args.breakdown:
        show("breakdown (each sample counted once, first matching category)", breakdown, 100)
    if args.focus:
        show("inclusive time of --focus functions", incl_fn, 1000,
             lambda k: any(f in k for f in args.focus))


if __name__ == "__main__":
    main()
