"""Ingest into PostgreSQL (issue 6): rows/s of ``Ledger.insert_items`` and of a whole submit.

    BATCHRUN_TEST_PG=postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        .venv/bin/python bench/pg_ingest.py --rows 200000

Each measurement runs in a fresh schema (dropped afterwards) and prints one JSON line:

- ``ledger``: ``insert_items`` alone, batches of ``INSERT_BATCH`` rows as ingest sends them
  (OpenAI Batch API bodies of ~200 bytes) — the database path (COPY + INSERT ... SELECT);
- ``multirow``: the same rows through SQLAlchemy's ``insert().on_conflict_do_nothing()``
  with a list of parameters (what the PostgreSQL path was before COPY), for comparison;
- ``submit``: ``prepare_job`` on a JSONL file, i.e. reading, parsing, hashing and checking
  each line as ``batchrun submit`` does, plus the inserts;
- ``export``: ``export_job`` of the ingested job to a file (server-side cursor), with the
  process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
from sqlalchemy import create_engine, text
from sqlalchemy.dialects import postgresql


def rows_for(n: int, start: int = 1) -> list[dict[str, object]]:
    return [
        {
            "line": i,
            "custom_id": f"rec-{i}",
            "url": "/v1/chat/completions",
            "body": orjson.dumps({"model": "m", "max_tokens": 32,
                                  "messages": [{"role": "user", "content": f"record {i} " + "x" * 120}]}).decode(),
            "state": "pending",
        }
        for i in range(start, start + n)
    ]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--db", default=os.environ.get("BATCHRUN_TEST_PG"))
    p.add_argument("--only", choices=["ledger", "multirow", "submit", "export"], action="append")
    args = p.parse_args()
    if not args.db:
        print("set --db or BATCHRUN_TEST_PG to a PostgreSQL URL", file=sys.stderr)
        return 2

    from batchrun.export import export_job
    from batchrun.ingest import INSERT_BATCH
    from batchrun.jobs import prepare_job
    from batchrun.ledger import Ledger
    from batchrun.ledger.store import items_t
    from batchrun.spec import Overrides, spec_for_batch_input

    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))
    admin = create_engine(args.db)
    wanted = args.only or ["ledger", "multirow", "submit", "export"]
    for what in wanted:
        schema = f"bench_{uuid.uuid4().hex[:10]}"
        with admin.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        sep = "&" if "?" in args.db else "?"
        ledger = Ledger.open(f"{args.db}{sep}options=-csearch_path%3D{schema}")
        try:
            n = args.rows
            batches = [rows_for(INSERT_BATCH, start) for start in range(1, n + 1, INSERT_BATCH)]
            job_id = ledger.create_job(spec, input_path="bench", input_hash=uuid.uuid4().hex)
            figures: dict[str, object] = {"what": what, "rows": n, "batch": INSERT_BATCH}
            if what == "ledger":
                t0 = time.perf_counter()
                for batch in batches:
                    ledger.insert_items(job_id, batch)
                dt = time.perf_counter() - t0
                figures.update(seconds=round(dt, 3), rows_per_s=round(n / dt))
            elif what == "multirow":
                t0 = time.perf_counter()
                for batch in batches:
                    with ledger.engine.begin() as conn:
                        conn.execute(postgresql.insert(items_t).on_conflict_do_nothing(),
                                     [dict(r, job_id=job_id, attempts=0) for r in batch])
                dt = time.perf_counter() - t0
                figures.update(seconds=round(dt, 3), rows_per_s=round(n / dt))
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    src = Path(tmp) / "in.jsonl"
                    with open(src, "wb") as f:
                        for batch in batches:
                            for r in batch:
                                f.write(orjson.dumps({"custom_id": r["custom_id"], "method": "POST",
                                                      "url": r["url"], "body": orjson.loads(str(r["body"]))}) + b"\n")
                    del batches
                    t0 = time.perf_counter()
                    prepared = prepare_job(ledger, spec, src, new=True)
                    dt = time.perf_counter() - t0
                    if what == "submit":
                        figures.update(seconds=round(dt, 3), rows_per_s=round(n / dt))
                    else:
                        t0 = time.perf_counter()
                        result = export_job(ledger, prepared.job_id, Path(tmp) / "out.jsonl")
                        dt = time.perf_counter() - t0
                        figures.update(seconds=round(dt, 3), rows_per_s=round(result.lines / dt))
            figures["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
            figures["loadavg_1m"] = os.getloadavg()[0]
            print(json.dumps(figures), flush=True)
        finally:
            ledger.close()
            with admin.begin() as conn:
                conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
