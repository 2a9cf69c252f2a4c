"""Start-up and ``status``/``list`` times of the ``batchrun`` command (issue 18, items 3 and 4).

Each command runs in a fresh process, ``--repeat`` times, and the figures are wall time
(from fork to exit) and the child's CPU time (``wait4`` rusage)::

    .venv/bin/python bench/status_cli.py --db bench/out/status1m/t5.db            # --help, status, list
    .venv/bin/python bench/status_cli.py --db postgresql+psycopg://...  --repeat 9
    .venv/bin/python bench/status_cli.py --tree /tmp/before --db /abs/path.db    # another tree's code

Prints one JSON line per command: ``min_s``, ``median_s``, ``max_s``, ``cpu_median_s``. Build a
1,000,000-item ledger first: ``bench/run.py t5 --keep-big`` (all pending) or ``t6 --keep-big``
(990,000 succeeded, an attempt row each), or ``bench/ingest_driver.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMANDS = (("--help",), ("status", "1"), ("status", "1", "--json"), ("list",), ("list", "--json"))


def timed(argv: list[str], tree: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``argv`` (its output discarded; a failure raises).

    ``python -m`` puts the working directory first on ``sys.path``: run in ``tree`` (a checkout
    holding ``batchrun/`` and ``migrations/``) to measure that tree's code.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tree)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else b""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {err.decode()[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--tree", default=None, help="run this checkout's batchrun (default: this one); --db then absolute")
    args = p.parse_args()
    for command in COMMANDS:
        argv = [sys.executable, "-m", "batchrun", *command, *([] if command == ("--help",) else ["--db", args.db])]
        timed(argv, args.tree)  # warm the page cache (and the database's buffers)
        runs = [timed(argv, args.tree) for _ in range(args.repeat)]
        walls = sorted(w for w, _ in runs)
        print(json.dumps({
            "command": " ".join(command), "db": args.db.split("?")[0], "tree": args.tree or ".", "runs": len(runs),
            "min_s": round(walls[0], 3), "median_s": round(statistics.median(walls), 3), "max_s": round(walls[-1], 3),
            "cpu_median_s": round(statistics.median(c for _, c in runs), 3),
            "load_avg_1m": os.getloadavg()[0],
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
