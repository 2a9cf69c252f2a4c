"""The command in pipelines and with tables: ``--input -`` spooled by content, ``export --output -`` with
nothing but the data on stdout (``| jq``, ``| head``), CSV in and Parquet out."""

from __future__ import annotations

import csv
import hashlib
import io
import subprocess
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import batchrun_cmd, cli_env, run_cli
from .test_cli import write_records, write_spec


def piped(tmp_path: Path, stdin: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(batchrun_cmd(*args), input=stdin, capture_output=True, env=cli_env(tmp_path), timeout=120)


@pytest.mark.slow
def test_input_from_stdin_is_spooled_by_content_and_found_again(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db, out = write_spec(tmp_path, server), tmp_path / "l.db", tmp_path / "out.jsonl"
    data = write_records(tmp_path, 12).read_bytes()
    first = piped(tmp_path, data, "submit", str(spec), "--input", "-", "--db", str(db), "--output", str(out))
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == b"1"
    assert len(out.read_bytes().splitlines()) == 12
    spooled = tmp_path / "batchrun-inputs" / f"{hashlib.sha256(data).hexdigest()}.jsonl"
    assert spooled.read_bytes() == data
    again = piped(tmp_path, data, "submit", str(spec), "--input", "-", "--db", str(db))
    assert again.returncode == 0 and again.stdout.splitlines()[0] == b"1"
    assert b"carrying on job 1 (same spec and input)" in again.stderr
    assert len(server.log) == 12  # nothing sent twice
    other = piped(tmp_path, data + b'{"id": "new", "text": "x"}\n', "submit", str(spec), "--input", "-", "--db", str(db))
    assert other.returncode == 0 and other.stdout.splitlines()[0] == b"2"


@pytest.mark.slow
def test_csv_from_stdin_needs_its_format_named(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db = write_spec(tmp_path, server), tmp_path / "l.db"
    rows = b"id,text\n" + b"".join(b"c%d,hello %d\n" % (i, i) for i in range(5))
    proc = piped(tmp_path, rows, "submit", str(spec), "--input", "-", "--input-format", "csv", "--db", str(db), "--json")
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["counts"]["succeeded"] == 5
    wrong = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 1)), "--input-format", "csv")
    assert wrong.returncode == 2 and "--input-format is for --input -" in wrong.stderr


@pytest.mark.slow
def test_export_to_stdout_is_the_data_only_and_pipes_into_jq(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db, out = write_spec(tmp_path, server), tmp_path / "l.db", tmp_path / "out.jsonl"
    records = write_records(tmp_path, 10, [b"{broken"])
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out)).returncode == 1
    proc = subprocess.run(batchrun_cmd("export", "1", "--db", str(db), "--output", "-"), capture_output=True,
                          env=cli_env(tmp_path), timeout=60)
    assert proc.returncode == 0 and proc.stderr == b""
    assert proc.stdout == out.read_bytes()  # the same lines as the file export
    jq = subprocess.run(
        ["sh", "-c", f"{' '.join(batchrun_cmd('export', '1', '--db', str(db), '--output', '-'))} | jq -r .custom_id"],
        capture_output=True, text=True, env=cli_env(tmp_path), timeout=60,
    )
    assert jq.returncode == 0, jq.stderr
    assert jq.stdout.split() == [f"r{i}" for i in range(10)] + ["11"]

    as_csv = run_cli(tmp_path, "export", "1", "--db", str(db), "--output", "-", "--format", "csv")
    table = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert as_csv.returncode == 0 and len(table) == 11 and table[0]["output"] == "echo: Say hello 0"

    missing = run_cli(tmp_path, "export", "7", "--db", str(db), "--output", "-")
    assert missing.returncode == 2 and missing.stdout == "" and "no job 7" in missing.stderr
    refused = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", "-")
    assert refused.returncode == 2 and "batchrun export JOB --output -" in refused.stderr


@pytest.mark.slow
def test_a_reader_that_leaves_early_ends_the_export_quietly(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db = write_spec(tmp_path, server), tmp_path / "l.db"
    records = write_records(tmp_path, 3000)
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--no-run").returncode == 0
    proc = subprocess.Popen(batchrun_cmd("export", "1", "--db", str(db), "--output", "-"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env(tmp_path))
    assert proc.stdout is not None and proc.stderr is not None
    assert orjson.loads(proc.stdout.readline())["custom_id"] == "r0"
    proc.stdout.close()  # as `| head -n 1` does
    assert proc.wait(timeout=60) == 141
    with proc.stderr:
        assert proc.stderr.read() == b""  # no traceback, no "Exception ignored"


@pytest.mark.slow
def test_csv_in_and_parquet_out(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db = write_spec(tmp_path, server), tmp_path / "l.db"
    data = tmp_path / "data.csv"
    data.write_text("id,text\n" + "".join(f"c{i},hello {i}\n" for i in range(200)) + "bad\n")
    out = tmp_path / "out.parquet"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(data), "--db", str(db), "--output", str(out),
                   "--format", "parquet")
    assert proc.returncode == 1, proc.stderr  # one bad row
    assert f"{data}:201: row has 1 fields, the header has 2" in proc.stderr
    table = pq.read_table(out)
    assert table.num_rows == 201 and table.column_names[:3] == ["custom_id", "status", "output"]
    assert table.column("output")[5].as_py() == "echo: Say hello 5"
    assert table.column("status")[200].as_py() == "rejected"
