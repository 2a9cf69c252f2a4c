"""batchrun beside the OpenAI cookbook's parallel processor, interleaved, on the same fake server and input.

The peer is not in this repository: take ``examples/api_request_parallel_processor.py`` from
``openai/openai-cookbook`` and, so it can call a local server, let its ``api_endpoint_from_url``
accept ``http://`` (``^https://`` → ``^https?://``). It runs with ``bench/peer_stub`` first on its
path (an offline ``tiktoken``), unpaced (``--max_requests_per_minute 1000000000``) and without
per-request log lines::

    OPENAI_API_KEY=sk-dummy .venv/bin/python bench/peers.py --cookbook /tmp/peers/cookbook.py t1 3
    # t1: 20,000 at 0 ms (batchrun c100); t2: 20,000 at 200 ms (c200); t5: 1,000,000 lines, killed at 30 s

Prints one JSON line per run: wall and CPU seconds (``wait4``), the server's requests and ``ok``
answers, the first request after exec, items/s and CPU per 1,000 (t1, t2) or the answers in the
first 30 s (t5). Results: bench/RESULTS.md, 2026-12-03.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import run as bench  # bench/run.py: the fake server, the measured child, the inputs

SHAPES = {"t1": (20_000, 0.0, 100, None), "t2": (20_000, 0.2, 200, None), "t5": (1_000_000, 0.0, 100, 30.0)}
STUB = bench.BENCH / "peer_stub"


def write_bodies(batch: Path, out: Path) -> None:
    """The batch lines' bodies, with each line's custom_id as the cookbook's metadata."""
    with open(batch) as src, open(out, "w") as dst:
        for line in src:
            rec = json.loads(line)
            dst.write(json.dumps({**rec["body"], "metadata": {"custom_id": rec["custom_id"]}}) + "\n")


def measure(tool: str, wd: Path, shape: str, cookbook: Path) -> dict[str, Any]:
    _, latency, concurrency, kill_at = SHAPES[shape]
    srv = bench.Server(wd, f"server-{tool}", latency=latency)
    env = None  # batchrun: this process's environment, PYTHONPATH included (an A/B's other tree)
    try:
        if tool == "batchrun":
            for p in wd.glob("ledger.db*"):
                p.unlink()
            cmd = bench.submit_cmd(wd / "input.jsonl", wd / "ledger.db", srv.base_url, concurrency)
        else:
            (wd / "cookbook-results.jsonl").unlink(missing_ok=True)
            cmd = [bench.PY, str(cookbook), "--requests_filepath", str(wd / "bodies.jsonl"),
                   "--save_filepath", str(wd / "cookbook-results.jsonl"),
                   "--request_url", srv.base_url + "/chat/completions",
                   "--max_requests_per_minute", "1000000000", "--max_tokens_per_minute", "100000000000",
                   "--logging_level", "40"]
            env = {**os.environ, "PYTHONPATH": str(STUB)}
        child = bench.Child(cmd, wd, tool, env=env)
        res = child.run(kill_at or 900)
    finally:
        srv.stop()
    recs = srv.records()
    ok = [r for r in recs if r.get("outcome") == "ok"]
    first = min((r["received_at"] for r in recs), default=None)
    res.update(tool=tool, shape=shape, server_requests=len(recs), server_ok=len(ok),
               first_request_s=round(first - child.t_start, 3) if first else None,
               load=round(os.getloadavg()[0], 2))
    if kill_at:
        res["ok_in_window"] = sum(1 for r in ok if r["finished_at"] - child.t_start <= kill_at)
    else:
        res["items_per_s"] = round(len(ok) / res["wall_s"], 1)
        res["cpu_s_per_1000"] = round(1000 * res["cpu_s"] / max(1, len(ok)), 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cookbook", type=Path, required=True, help="the cookbook's script, changed as above")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("rounds", type=int, nargs="?", default=1)
    args = ap.parse_args()
    wd = bench.BENCH / "out" / f"peers-{args.shape}"
    wd.mkdir(parents=True, exist_ok=True)
    if not (wd / "bodies.jsonl").exists():
        bench.write_batch_input(wd / "input.jsonl", SHAPES[args.shape][0])
        write_bodies(wd / "input.jsonl", wd / "bodies.jsonl")
    bench.precompile()
    for r in range(args.rounds):
        for tool in ("batchrun", "cookbook") if r % 2 == 0 else ("cookbook", "batchrun"):
            print(json.dumps({"round": r, **measure(tool, wd, args.shape, args.cookbook)}), flush=True)


if __name__ == "__main__":
    main()
