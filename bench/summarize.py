#!/usr/bin/env python3
"""Medians of the key figures in bench/out/results.jsonl, as a Markdown table.

    python bench/summarize.py [--results bench/out/results.jsonl] [--since 2026-11-29T22:00]

Profiled runs and runs that raised are left out (errors are listed below the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

KEY_FIGURES = {
    "t1": ["items_per_s_e2e", "items_per_s_run", "cpu_s_per_1000_e2e", "cpu_s_per_1000_run", "wall_s",
           "startup_ingest_s"],
    "t2": ["pct_of_ideal_e2e", "pct_of_ideal_run", "items_per_s_e2e", "wall_s", "cpu_s_per_1000_e2e"],
    "t3": ["pct_of_limit", "server_429", "pct_429", "wall_s"],
    "t3s": ["pct_of_limit", "server_429", "pct_429", "wall_s"],
    "t4": ["resent_keys", "in_flight_at_kill", "extra_ok_answers", "resume_wall_s", "kill_delay_s"],
    "t5": ["process_wall_s", "driver_prepare_job_s", "peak_rss_mb", "process_cpu_s"],
    "t6": ["time_to_first_request_s", "resume_wall_s", "cpu_s_before_first_request"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "out" / "results.jsonl")
    ap.add_argument("--since", default="", help="only runs started at or after this ISO time")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = defaultdict(list)
    errors = []
    for raw in args.results.read_text().splitlines():
        r = json.loads(raw)
        if r.get("started", "") < args.since or r.get("profiled"):
            continue
        if "error" in r:
            errors.append(r)
            continue
        name = r["scenario"]
        if r.get("kill_delay_s"):
            name += f" kill+{r['kill_delay_s']:g}s"
        if r.get("extra_args"):
            name += f" [{r['extra_args']}]"
        runs[name].append(r)
    print("| scenario | runs | figure | median | min – max | met |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rs in sorted(runs.items()):
        figures = KEY_FIGURES.get(name.split()[0], [])
        met = sum(1 for r in rs if r.get("met"))
        for i, fig in enumerate(figures):
            vals = [r[fig] for r in rs if isinstance(r.get(fig), (int, float))]
            if not vals:
                continue
            med = statistics.median(vals)
            cells = [name if i == 0 else "", str(len(rs)) if i == 0 else "", fig, f"{med:g}",
                     f"{min(vals):g} – {max(vals):g}", f"{met}/{len(rs)}" if i == 0 else ""]
            print("| " + " | ".join(cells) + " |")
    for r in errors:
        print(f"\n{r['scenario']} {r['started']}: {r['error']}")
    srcs = sorted({(r["machine"].get("batchrun_src_sha256"), r["machine"].get("git_head"))
                   for rs in runs.values() for r in rs})
    print(f"\ncode measured (batchrun_src_sha256, git_head): {srcs}")


if __name__ == "__main__":
    main()
