"""Set-up for the CSV / Parquet memory figures (issue 19): inputs of N rows, and a ledger whose items are answered.

    python bench/tables.py make DIR --rows 1000000   # DIR/data.jsonl, data.csv, data.parquet (the same records),
                                                     # DIR/job.toml with a JSON Schema, DIR/label.schema.json
    python bench/tables.py records DIR DB --rows N   # batchrun.submit(..., run=False) of N records from a Python
                                                     # generator (spooled, then ingested), with DIR/job.toml
    python bench/tables.py answer DB [--job 1]       # every pending item (of job 1) in the SQLite ledger DB:
                                                     # succeeded, with a schema-valid answer (one SQL UPDATE; nothing sent)

The measured commands are the real CLI (RESULTS.md, "issue 19"): an ingest is
``batchrun submit DIR/job.toml --input DIR/data.csv --db DB --no-run --new``, an export
``batchrun export 1 --db DB --output DIR/out.parquet --format parquet --force``; their peak RSS is
taken from outside the process (``/usr/bin/time -v``: "Maximum resident set size").
"""

from __future__ import annotations

import argparse
import csv
import sqlite3
from pathlib import Path

import orjson

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "reasons": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["label", "score", "reasons", "summary"],
    "additionalProperties": False,
}
SPEC = """name = "tables-bench"
[provider]
base_url = "http://127.0.0.1:9/v1"
model = "gpt-4o-mini"
[request]
system = "Label the message as spam or ham, score it 0-9, give reasons and a one-line summary."
template = "From {sender}, subject {subject}:\\n{text}"
max_tokens = 100
[output]
schema = "label.schema.json"
"""
PARQUET_ROW_GROUP = 50_000


def record(i: int) -> dict[str, str]:
    return {
        "id": f"m{i:07d}",
        "sender": f"user{i % 977}@example.com",
        "subject": f"Offer number {i} for you",
        "text": f"Dear customer, message {i} says hello and asks for nothing in particular. " * 2,
    }


def make(folder: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "label.schema.json").write_bytes(orjson.dumps(SCHEMA))
    (folder / "job.toml").write_text(SPEC)
    names = list(record(0))
    with open(folder / "data.jsonl", "wb") as jsonl, open(folder / "data.csv", "w", newline="") as table:
        writer = csv.DictWriter(table, names)
        writer.writeheader()
        schema = pa.schema([(name, pa.string()) for name in names])
        with pq.ParquetWriter(folder / "data.parquet", schema) as parquet:
            for start in range(0, rows, PARQUET_ROW_GROUP):
                group = [record(i) for i in range(start, min(rows, start + PARQUET_ROW_GROUP))]
                for r in group:
                    jsonl.write(orjson.dumps(r) + b"\n")
                writer.writerows(group)
                parquet.write_table(pa.Table.from_pylist(group, schema=schema))


def answer(db: Path, job: int | None = None) -> None:
    conn = sqlite3.connect(db)
    answer_sql = (
        "'{\"label\":\"' || (CASE WHEN line % 2 = 0 THEN 'spam' ELSE 'ham' END) || '\",\"score\":' || (line % 10) "
        "|| ',\"reasons\":[\"reason ' || line || '\",\"another\"],\"summary\":\"summary of ' || custom_id || '\"}'"
    )
    with conn:
        conn.execute(
            f"UPDATE items SET state = 'succeeded', output = {answer_sql}, parsed = {answer_sql}, status_code = 200, "
            "attempts = 1, input_tokens = 60, output_tokens = 40, cost_usd = 0.0000330, latency_ms = 812.5, "
            "finished_at = 1.0 WHERE state = 'pending'" + ("" if job is None else " AND job_id = ?"),
            () if job is None else (job,),
        )
    conn.close()


def submit_records(folder: Path, db: Path, rows: int) -> None:
    import batchrun

    with batchrun.Ledger.open(db) as ledger:
        result = batchrun.submit(ledger, batchrun.load_spec(folder / "job.toml"), (record(i) for i in range(rows)),
                                 run=False, new=True)
    print(result.job_id, result.total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    made = sub.add_parser("make")
    made.add_argument("folder", type=Path)
    made.add_argument("--rows", type=int, default=1_000_000)
    answered = sub.add_parser("answer")
    answered.add_argument("db", type=Path)
    answered.add_argument("--job", type=int, default=None, help="only this job's items (default: every job's)")
    from_python = sub.add_parser("records")
    from_python.add_argument("folder", type=Path)
    from_python.add_argument("db", type=Path)
    from_python.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.step == "make":
        make(args.folder, args.rows)
    elif args.step == "records":
        submit_records(args.folder, args.db, args.rows)
    else:
        answer(args.db, args.job)


if __name__ == "__main__":
    main()
