#!/usr/bin/env python3
"""Instructions per item of a T1-shaped run, counted by valgrind's callgrind (load-independent).

Seconds on a shared 2-core machine swing by ±20 % between runs; instruction counts do not.
This runs ``batchrun submit`` under ``valgrind --tool=callgrind`` twice per tree (``--small`` and
``--large`` items, zero latency and concurrency 100 unless told, the fake server in its own process, not
counted) and reports (Ir(large) - Ir(small)) / (large - small): the instructions one more
item costs, with start-up and ingest of the fixed part cancelled out.

    .venv/bin/python bench/instructions.py TREE [TREE ...] [--small 500 --large 2500]

TREE is a checkout whose ``batchrun`` package is put first on PYTHONPATH (the children use
``.venv``'s Python and dependencies).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402  (bench/run.py: the fake server process and the input writer)


def instructions(tree: Path, n: int, base_url: str, work: Path, concurrency: int) -> int:
    """Instructions the ``batchrun submit`` process of ``n`` items executed (all threads)."""
    inp, db, out = work / f"in-{n}.jsonl", work / f"l-{tree.name}-{n}.db", work / f"cg-{tree.name}-{n}.out"
    if not inp.exists():
        bench.write_batch_input(inp, n)
    db.unlink(missing_ok=True)
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no",
           bench.PY, "-m", "batchrun", "submit", "--input", str(inp), "--base-url", base_url,
           "--model", bench.MODEL, "--db", str(db), "--quiet", "--concurrency", str(concurrency)]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: batchrun exited {done.returncode}: {done.stderr[-2000:]}")
    total = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
    if total is None:
        raise SystemExit(f"{out}: no summary line")
    return int(total.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--small", type=int, default=500)
    ap.add_argument("--large", type=int, default=2500)
    ap.add_argument("--latency", type=float, default=0.0, help="the server's answer latency, s (T2: 0.2)")
    ap.add_argument("--concurrency", type=int, default=100, help="batchrun's --concurrency (T2: 200)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="instr-") as tmp:
        work = Path(tmp)
        srv = bench.Server(work, latency=args.latency)
        try:
            for tree in args.trees:
                small = instructions(tree.resolve(), args.small, srv.base_url, work, args.concurrency)
                large = instructions(tree.resolve(), args.large, srv.base_url, work, args.concurrency)
                per_item = (large - small) / (args.large - args.small)
                print(f"{tree}: Ir({args.small})={small:,} Ir({args.large})={large:,} "
                      f"per item={per_item:,.0f}", flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
