"""Ingest a JSONL file into a fresh ledger with ``batchrun.jobs.prepare_job`` and report the cost.

Run in its own process by ``bench/run.py`` (T5, and to build T6's ledger), so that wall time
and peak RSS are those of an ingest alone:

    .venv/bin/python bench/ingest_driver.py --db out/x.db --input out/x.jsonl

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

T_PROCESS = time.perf_counter()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--base-url", default="http://127.0.0.1:9/v1")
    p.add_argument("--model", default="m")
    args = p.parse_args()

    t_imp = time.perf_counter()
    from batchrun.jobs import prepare_job
    from batchrun.ledger import Ledger
    from batchrun.spec import Overrides, spec_for_batch_input

    t_open = time.perf_counter()
    rss_after_import = _status_kb("VmRSS")
    spec = spec_for_batch_input(Overrides(base_url=args.base_url, model=args.model))
    ledger = Ledger.open(args.db)
    try:
        t_prep = time.perf_counter()
        prepared = prepare_job(ledger, spec, args.input, new=True)
        t_end = time.perf_counter()
    finally:
        ledger.close()
    st = prepared.ingest
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "job_id": prepared.job_id,
        "lines": st.lines if st else None,
        "accepted": st.accepted if st else None,
        "rejected": st.rejected if st else None,
        "import_s": round(t_open - t_imp, 3),
        "open_ledger_s": round(t_prep - t_open, 3),
        "prepare_job_s": round(t_end - t_prep, 3),
        "in_process_total_s": round(t_end - T_PROCESS, 3),
        "rss_after_import_mb": round(rss_after_import / 1024, 1),
        "vm_hwm_mb": round(_status_kb("VmHWM") / 1024, 1),
        "ru_maxrss_mb": round(ru.ru_maxrss / 1024, 1),
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
