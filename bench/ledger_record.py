"""The run's ledger writer alone: Ledger.record of N clean answers (an outcome and an attempt row each) in
batches of 100 on a fresh SQLite ledger, for the tree on PYTHONPATH. Prints µs per answer (wall and CPU).

    PYTHONPATH=TREE .venv/bin/python bench/ledger_record.py [N]
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from batchrun.ledger import AttemptRecord, Ledger, Outcome
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ItemState

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
has = {f.name for f in dataclasses.fields(AttemptRecord)}
spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))
_tmp = tempfile.TemporaryDirectory()  # removed at exit
d = _tmp.name
with Ledger.open(Path(d) / "l.db") as ledger:
    job = ledger.create_job(spec, input_path="in.jsonl", input_hash="h")
    ledger.insert_items(job, [{"line": i, "custom_id": f"c{i}", "url": None, "body": "{}", "state": ItemState.PENDING}
                              for i in range(1, N + 1)])
    ledger.finish_ingest(job)
    run = ledger.start_run(job, "bench", exclusive=True)
    claimed = ledger.claim(job, run, N, 600)
    extra = {"ttfb_ms": 1.5} if "ttfb_ms" in has else {}
    w0, c0 = time.perf_counter(), time.process_time()
    seq = 0
    for start in range(0, N, 100):
        part = claimed[start:start + 100]
        outcomes, attempts = [], []
        for c in part:
            seq += 1
            outcomes.append(Outcome(c.id, ItemState.SUCCEEDED, 1, status_code=200, response='{"x":1}', output="ok",
                                    input_tokens=10, output_tokens=5, latency_ms=2.0, finished_at=time.time(),
                                    claim=c.claim))
            attempts.append(AttemptRecord(job, c.id, run, 1, time.time(), 0.5, 2.0, 200, None, 10, 5, 0, 0.0001,
                                          seq=seq, **extra))
        ledger.record(run, outcomes, attempts)
    w, c = time.perf_counter() - w0, time.process_time() - c0
    print(f"{N} answers: {w * 1e6 / N:.1f} us wall, {c * 1e6 / N:.1f} us cpu per answer")
