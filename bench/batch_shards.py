"""T7: a large batch-mode job sharded and uploaded: wall time, peak RSS, shards and bytes.

    .venv/bin/python bench/batch_shards.py --records 1000000 [--kind openai|anthropic]

Writes N plain records, stores them (`submit --no-run`), then runs `batchrun resume JOB
--mode batch --no-wait` against the bundled fake server in its own process (batches that
take an hour, so every shard is created and none collected), and prints one JSON line:
the resume's wall time and peak RSS (``ru_maxrss`` of the child), its exit code, the
shards the ledger holds and the bytes the server stored. Issue 16's target: peak RSS
<= 200 MB for 1,000,000 records.
"""

from __future__ import annotations

import argparse
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

SPEC = """
[provider]
kind = "{kind}"
base_url = "{base_url}"
model = "gpt-4o-mini"
api_key_env = ""
[request]
system = "You summarise customer reviews in one neutral sentence."
template = "Product: {{product}}\\nReview: {{review}}"
max_tokens = 60
[batch]
poll_interval = 1
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--kind", choices=["openai", "anthropic"], default="openai")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batchrun-t7-"))
    data = work / "in.jsonl"
    with data.open("wb") as f:
        for i in range(args.records):
            f.write(orjson.dumps({"id": f"r{i}", "product": f"product {i % 997}",
                                  "review": f"Review number {i}: it works, mostly, and arrived on time."}) + b"\n")
    state = work / "batches"
    server = subprocess.Popen(
        [sys.executable, "-m", "batchrun.testing", "serve", "--port", "0", "--batch-state", str(state),
         "--batch-turnaround", "3600"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = server.stdout.readline() if server.stdout else ""
        base = line.strip().removeprefix("listening on ")
        if args.kind == "anthropic":
            base = base.removesuffix("/v1")
        spec = work / "job.toml"
        spec.write_text(SPEC.format(kind=args.kind, base_url=base))
        db = str(work / "ledger.db")
        batchrun = [sys.executable, "-m", "batchrun"]
        stored = subprocess.run([*batchrun, "submit", str(spec), "--input", str(data), "--db", db, "--no-run",
                                 "--quiet"], capture_output=True, text=True)
        if stored.returncode != 0:
            print(stored.stderr, file=sys.stderr)
            return 1
        started = time.monotonic()
        err = work / "resume.err"
        with err.open("w") as stderr:
            child = subprocess.Popen([*batchrun, "resume", "1", "--db", db, "--mode", "batch", "--no-wait", "--quiet"],
                                     stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the ingest's
        wall = time.monotonic() - started
        code = os.waitstatus_to_exitcode(status)
        peak_kb = usage.ru_maxrss
        conn = sqlite3.connect(db)
        shards = conn.execute("select count(*), sum(requests), sum(bytes), max(requests) from shards").fetchone()
        states = dict(conn.execute("select state, count(*) from items group by state").fetchall())
        conn.close()
        stored_bytes = sum(p.stat().st_size for p in state.rglob("*") if p.is_file())
        print(orjson.dumps({
            "scenario": "t7", "records": args.records, "kind": args.kind, "exit_code": code,
            "wall_s": round(wall, 1), "peak_rss_mb": round(peak_kb / 1024, 1),
            "shards": shards[0], "requests_in_shards": shards[1], "shard_bytes": shards[2],
            "largest_shard": shards[3], "item_states": states, "server_stored_bytes": stored_bytes,
            "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                        "load": os.getloadavg()[0]},
            "stderr_tail": err.read_text().strip().splitlines()[-2:],
        }).decode())
        return 0 if code == 75 else 1
    finally:
        server.terminate()
        server.wait(timeout=30)
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
