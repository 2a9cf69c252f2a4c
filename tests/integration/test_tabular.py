"""CSV and Parquet (batchrun/tabular.py): rows in as records, with rejected rows and job identity by
content, and results out as flat columns, checked by reading the files back with csv and pyarrow."""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.errors import ExportError, InputError
from batchrun.export import export_job, table_columns
from batchrun.jobs import dry_run, prepare_job, run_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.spec import JobSpec, parse_spec
from batchrun.states import ItemState
from batchrun.tabular import read_csv
from batchrun.eventloop import run_sync
from batchrun.testing import FakeProviderServer

from .test_structured import FAST

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "confident": {"type": "boolean"},
        "status": {"type": "string"},  # the name of a column of ours: written as output.status
        "reasons": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["label", "score", "confident", "status", "reasons"],
    "additionalProperties": False,
}


def spec(base_url: str = "http://127.0.0.1:9/v1", *, schema: dict[str, Any] | None = None, **run: Any) -> JobSpec:
    data: dict[str, Any] = {
        "provider": {"base_url": base_url, "model": "m"},
        "request": {"template": "Say {text} ({lang})"},
        "run": {"concurrency": 4, **run},
    }
    if schema is not None:
        data["output"] = {"schema": schema}
    return parse_spec(data, where="test")


def stored(ledger: Ledger, job_id: int) -> list[Any]:
    return list(LedgerQueries(ledger.engine).iter_items(job_id))


def user_text(ledger: Ledger, job_id: int, custom_id: str) -> str:
    from sqlalchemy import text

    with ledger.engine.connect() as conn:
        body = conn.execute(
            text("select body from items where job_id = :j and custom_id = :c"), {"j": job_id, "c": custom_id}
        ).scalar()
    return str(orjson.loads(body)["messages"][-1]["content"])


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer() as srv:
        yield srv


# ---------------------------------------------------------------- CSV in


def test_csv_rows_are_records_and_bad_rows_are_rejected_with_their_row_number(ledger: Ledger, tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_bytes(
        "\ufeffid,text,lang\r\n"  # a BOM, as spreadsheets write it
        'a,"cats, and dogs",en\r\n'
        '"b","two\nlines",fr\r\n'
        "c,too,many,fields\r\n"
        "\r\n".encode()
        + b"d,\xff\xfe,de\r\n"
        + ("e," + "x" * 300 + ",en\r\n").encode()
        + b",no id,en\r\n"
        + b"a,dup,en"  # no final newline
    )
    job = prepare_job(ledger, spec(max_line_bytes=200), path).job_id
    rows = stored(ledger, job)
    assert [(r.line, r.custom_id, r.state, r.error_class) for r in rows] == [
        (1, "a", ItemState.PENDING, None),
        (2, "b", ItemState.PENDING, None),
        (3, "3", ItemState.REJECTED, "bad_row"),
        (4, "4", ItemState.REJECTED, "blank"),
        (5, "5", ItemState.REJECTED, "invalid_utf8"),
        (6, "6", ItemState.REJECTED, "too_large"),
        (7, "7", ItemState.REJECTED, "bad_custom_id"),
        (8, "a", ItemState.REJECTED, "duplicate_custom_id"),
    ]
    assert rows[2].error_message == "row has 4 fields, the header has 3"
    assert user_text(ledger, job, "a") == "Say cats, and dogs (en)"
    assert user_text(ledger, job, "b") == "Say two\nlines (fr)"


def test_a_csv_header_naming_a_column_twice_refuses_the_file(ledger: Ledger, tmp_path: Path) -> None:
    path = tmp_path / "twice.csv"
    path.write_text("id,text,text\n1,a,b\n")
    with pytest.raises(InputError, match="column 'text' appears twice in the header row"):
        prepare_job(ledger, spec(), path)


def test_an_empty_csv_file_has_no_records(tmp_path: Path) -> None:
    path = tmp_path / "empty.csv"
    path.write_text("")
    assert list(read_csv(path, 100)) == []


def test_a_csv_job_is_found_again_by_its_content_and_a_changed_file_is_a_new_job(ledger: Ledger, tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("id,text,lang\n1,a,en\n")
    first = prepare_job(ledger, spec(), path)
    again = prepare_job(ledger, spec(), path)
    assert (again.job_id, again.created) == (first.job_id, False)
    path.write_text("id,text,lang\n1,a,en\n2,b,en\n")
    changed = prepare_job(ledger, spec(), path)
    assert changed.created and changed.job_id != first.job_id


def test_strict_and_dry_run_read_csv_like_submit(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("id,text,lang\n1,a,en\n2,b\n")
    report = dry_run(spec(), path)
    assert (report.lines, report.to_send, report.rejected) == (2, 1, 1)
    assert report.rejections == [(2, "row has 2 fields, the header has 3")]
    with pytest.raises(InputError, match="1 of 2 lines are bad"):
        dry_run(spec(), path, strict=True)


# ---------------------------------------------------------------- Parquet in


def test_parquet_rows_are_records_with_their_types(ledger: Ledger, tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    table = pa.table({
        "id": pa.array([1, 2, 3], pa.int64()),
        "text": ["a", "b", "c"],
        "lang": pa.array([b"en", b"\xff", b"de"], pa.binary()),
        "price": pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("2.00")], pa.decimal128(5, 2)),
        "day": [datetime.date(2026, 1, 2)] * 3,
        "tags": [["x", "y"], [], None],
    })
    pq.write_table(table, path, row_group_size=2)  # two row groups
    templated = parse_spec(
        {"provider": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
         "request": {"template": "{text}/{lang}/{price}/{day}/{tags}"}},
        where="test",
    )
    job = prepare_job(ledger, templated, path).job_id
    rows = stored(ledger, job)
    assert [(r.line, r.custom_id, r.state, r.error_class) for r in rows] == [
        (1, "1", ItemState.PENDING, None),
        (2, "2", ItemState.REJECTED, "invalid_utf8"),
        (3, "3", ItemState.PENDING, None),
    ]
    assert rows[1].error_message == "binary column 'lang' is not UTF-8 text"
    assert user_text(ledger, job, "1") == 'a/en/1.50/"2026-01-02"/["x","y"]'
    assert user_text(ledger, job, "3") == "c/de/2.00/\"2026-01-02\"/null"


def test_a_file_that_is_not_parquet_is_refused_in_one_line(ledger: Ledger, tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    path.write_text("id,text\n")
    with pytest.raises(InputError, match=r"data.parquet: not a readable Parquet file"):
        prepare_job(ledger, spec(), path)


def test_without_pyarrow_a_parquet_input_says_which_extra_to_install(
    ledger: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["a"], "lang": ["en"]}), path)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import pyarrow.parquet now raises ImportError
    with pytest.raises(InputError) as info:
        prepare_job(ledger, spec(), path)
    assert info.value.message == f"reading {path} needs pyarrow: pip install 'batchrun[parquet]'"


# ---------------------------------------------------------------- CSV and Parquet out


def finished_job(ledger: Ledger, server: FakeProviderServer, tmp_path: Path, schema: dict[str, Any] | None) -> int:
    path = tmp_path / "in.csv"
    path.write_text("id,text,lang\n" + "".join(f"r{i},text {i},en\n" for i in range(25)) + "short,row\n")
    job = prepare_job(ledger, spec(server.base_url, schema=schema), path).job_id
    run_sync(run_job(ledger, job, options=FAST))
    return job


def test_a_structured_job_exports_one_column_per_answer_field_to_parquet_and_csv(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path
) -> None:
    job = finished_job(ledger, server, tmp_path, SCHEMA)
    columns = ["custom_id", "status", "label", "score", "confident", "output.status", "reasons", "input_tokens",
               "output_tokens", "cost_usd", "attempts", "latency_ms", "error_class", "error_message", "cached"]
    results = export_job(ledger, job, tmp_path / "out.jsonl")
    lines = [orjson.loads(line) for line in results.path.read_bytes().splitlines()]

    parquet = export_job(ledger, job, tmp_path / "out.parquet", fmt="parquet")
    table = pq.read_table(parquet.path)
    assert parquet.lines == table.num_rows == len(lines) == 26
    assert table.column_names == columns
    assert str(table.schema.field("score").type) == "int64" and str(table.schema.field("confident").type) == "bool"
    rows = table.to_pylist()
    for row, line in zip(rows, lines):
        assert row["custom_id"] == line["custom_id"] and row["status"] == line["status"]
        if line["status"] == ItemState.SUCCEEDED:
            answer = line["output"]
            assert (row["label"], row["score"], row["confident"], row["output.status"]) == (
                answer["label"], answer["score"], answer["confident"], answer["status"])
            assert orjson.loads(row["reasons"]) == answer["reasons"]
            assert row["input_tokens"] == line["usage"]["input_tokens"] and row["attempts"] == line["attempts"]
    assert rows[-1]["status"] == ItemState.REJECTED and rows[-1]["error_class"] == "bad_row"
    assert rows[-1]["label"] is None

    exported = export_job(ledger, job, tmp_path / "out.csv", fmt="csv")
    with open(exported.path, newline="") as f:
        read = list(csv.DictReader(f))
    assert exported.lines == len(read) == 26 and list(read[0]) == columns
    assert read[0]["score"] == str(rows[0]["score"]) and read[0]["confident"] in ("true", "false")
    assert orjson.loads(read[0]["reasons"]) == lines[0]["output"]["reasons"]
    assert read[-1]["label"] == "" and read[-1]["error_class"] == "bad_row"


def test_a_job_without_a_schema_exports_its_answer_text_as_one_output_column(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path
) -> None:
    job = finished_job(ledger, server, tmp_path, None)
    table = pq.read_table(export_job(ledger, job, tmp_path / "out.parquet", fmt="parquet").path)
    assert table.column_names[:3] == ["custom_id", "status", "output"]
    assert table.column("output")[0].as_py() == "echo: Say text 0 (en)"


def test_a_large_parquet_export_is_written_in_row_groups(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import batchrun.tabular

    monkeypatch.setattr(batchrun.tabular, "PARQUET_ROW_GROUP", 10)
    job = finished_job(ledger, server, tmp_path, None)
    parquet = pq.ParquetFile(export_job(ledger, job, tmp_path / "out.parquet", fmt="parquet").path)
    assert parquet.metadata.num_rows == 26 and parquet.metadata.num_row_groups == 3


def test_table_columns_type_scalar_fields_and_leave_the_rest_as_json_text() -> None:
    columns = table_columns({"type": "object", "properties": {
        "a": {"type": ["integer", "null"]}, "b": {"enum": ["x", "y"]}, "c": {"type": "object"}, "d": {"anyOf": []},
    }})
    assert [(c.name, c.kind) for c in columns[2:6]] == [("a", "integer"), ("b", "string"), ("c", None), ("d", None)]
    assert [c.name for c in table_columns({"type": "array"})][2] == "output"


def test_without_pyarrow_a_parquet_export_says_which_extra_to_install(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = finished_job(ledger, server, tmp_path, None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ExportError, match=r"^--format parquet needs pyarrow: pip install 'batchrun\[parquet\]'$"):
        export_job(ledger, job, tmp_path / "out.parquet", fmt="parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_an_export_to_a_stream_writes_the_same_bytes_and_records_nothing(
    ledger: Ledger, server: FakeProviderServer, tmp_path: Path
) -> None:
    job = finished_job(ledger, server, tmp_path, SCHEMA)
    for fmt in ("results", "csv", "parquet"):
        stream = io.BytesIO()
        result = export_job(ledger, job, stream, fmt=fmt)
        assert result.path == Path("-") and result.lines == 26
        assert exports(ledger, job) == 0  # only files are recorded: the next export checks those
        path = export_job(ledger, job, tmp_path / f"out.{fmt}", fmt=fmt).path
        assert stream.getvalue() == path.read_bytes()
        assert exports(ledger, job) == 1
        path.unlink()
        with ledger.engine.begin() as conn:
            from sqlalchemy import text

            conn.execute(text("delete from exports"))


def exports(ledger: Ledger, job_id: int) -> int:
    from sqlalchemy import text

    with ledger.engine.connect() as conn:
        return int(conn.execute(text("select count(*) from exports where job_id = :j"), {"j": job_id}).scalar() or 0)
