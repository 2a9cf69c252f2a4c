"""How long ``report``'s latency split (LedgerQueries.answer_split) takes over a job of N clean answers
on SQLite, for the tree on PYTHONPATH. Makes the ledger at PATH if it does not exist (the attempts
written straight into the table, random latencies and TTFBs).

    PYTHONPATH=TREE .venv/bin/python bench/report_split.py N PATH
"""

from __future__ import annotations

import random
import sqlite3
import sys
import time
from pathlib import Path
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ItemState

N = int(sys.argv[1])
path = Path(sys.argv[2])
if not path.exists():
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))
    with Ledger.open(path) as ledger:
        job = ledger.create_job(spec, input_path="in.jsonl", input_hash="h")
        for s in range(0, N, 50000):
            ledger.insert_items(job, [{"line": i, "custom_id": f"c{i}", "url": None, "body": "{}", "state": ItemState.SUCCEEDED}
                                      for i in range(s + 1, min(N, s + 50000) + 1)])
    con = sqlite3.connect(path)
    rnd = random.Random(1)
    rows = []
    for i in range(1, N + 1):
        lat = rnd.uniform(50, 500)
        rows.append((1, i, "r", 1, 1000.0 + i, rnd.uniform(0, 100), lat, 200, i, lat * rnd.uniform(0.3, 1.0)))
    con.executemany("INSERT INTO attempts (job_id, item_id, run_id, number, started_at, queue_wait_ms, latency_ms, "
                    "status_code, seq, ttfb_ms) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
    con.commit()
    con.close()
with Ledger.open(path) as ledger:
    q = LedgerQueries(ledger.engine)
    for _ in range(2):
        t = time.perf_counter()
        split = q.answer_split(1, (50, 99))
        print(f"answer_split over {split['ttfb_ms'].count:,}: {time.perf_counter() - t:.2f} s",
              {m: d.percentiles for m, d in split.items()})
