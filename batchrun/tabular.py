"""CSV and Parquet, both ways: input rows as records, and flat result rows written in chunks.

- Reading: each row is one record for the template. CSV through the ``csv`` module (a header
  row names the fields; every value is a string), Parquet through pyarrow (the ``parquet``
  extra), one batch of rows at a time, so a file of any length is read in bounded memory.
  A row that cannot be a record is a :class:`RowProblem` with its row number (1: the first
  row after a CSV header), which ingest turns into a rejected item as it does a bad JSONL line.
- Writing: :func:`csv_chunks` and :func:`parquet_chunks` turn flat rows (dicts with the same
  keys) into the bytes of one file, a chunk at a time (a Parquet chunk is one row group), for
  :func:`batchrun.export.write_atomic`.

The format of an input file is its suffix (:func:`input_format`): ``.csv``, ``.parquet`` / ``.pq``,
anything else JSONL.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from batchrun.errors import ExportError, InputError

if TYPE_CHECKING:
    import pyarrow

_SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
FORMAT_SUFFIX = {"jsonl": ".jsonl", "csv": ".csv", "parquet": ".parquet"}
PARQUET_READ_BATCH = 1024  # rows turned into records at a time
PARQUET_READ_BUFFER = 1 << 20  # bytes of a column chunk read at a time
PARQUET_ROW_GROUP = 10_000  # rows per row group written
CSV_CHUNK_ROWS = 1000  # rows per chunk of CSV text handed to the writer
_CSV_READ_BUFFER = 1 << 20


class RowProblem(NamedTuple):
    """Why a row is not a record: the error class and reason of its rejected item."""

    error_class: str
    reason: str


Row = dict[str, Any] | RowProblem


def input_format(path: str | os.PathLike[str]) -> str:
    """``jsonl``, ``csv`` or ``parquet``, from the file's suffix (case does not matter)."""
    return _SUFFIXES.get(Path(path).suffix.lower(), "jsonl")


def pyarrow_parquet(purpose: str, error: type[InputError] | type[ExportError] = InputError) -> Any:
    """``pyarrow.parquet``, or ``error`` saying how to install it (``purpose``: what needed it)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise error(f"{purpose} needs pyarrow: pip install 'batchrun[parquet]'") from None
    return pq


# -- reading --------------------------------------------------------------------------------


def read_csv(path: str | os.PathLike[str], max_bytes: int) -> Iterator[tuple[int, Row]]:
    """(row number, record or problem) for each row after the header of a UTF-8 CSV file.

    A row with more or fewer fields than the header, with bytes that are not UTF-8, or
    longer than ``max_bytes`` is a problem; a blank row too (as a blank JSONL line is).
    """
    if csv.field_size_limit() <= max_bytes:
        # A field over csv's own limit raises mid-row and leaves the reader inside that row; ours is checked per row.
        csv.field_size_limit(max_bytes + 1)
    try:
        f = open(path, encoding="utf-8-sig", errors="surrogateescape", newline="", buffering=_CSV_READ_BUFFER)
    except FileNotFoundError:
        raise InputError(f"{path}: no such input file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read input: {exc.strerror or exc}") from exc
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
        except csv.Error as exc:
            raise InputError(f"{path}: the header row is not CSV: {exc}") from None
        if header is None:
            return
        try:
            "".join(header).encode()
        except UnicodeEncodeError:
            raise InputError(f"{path}: the header row is not valid UTF-8") from None
        seen: set[str] = set()
        for name in header:
            if name in seen:
                raise InputError(f"{path}: column {name!r} appears twice in the header row")
            seen.add(name)
        width = len(header)
        number = 0
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                number += 1
                yield number, RowProblem("invalid_csv", f"not valid CSV: {exc}")
                continue
            number += 1
            yield number, _csv_record(header, width, fields, max_bytes)


def _csv_record(header: list[str], width: int, fields: list[str], max_bytes: int) -> Row:
    if not fields:
        return RowProblem("blank", "blank row")
    try:
        size = len("".join(fields).encode())
    except UnicodeEncodeError:
        return RowProblem("invalid_utf8", "not valid UTF-8")
    if size > max_bytes:
        return RowProblem("too_large", f"row is longer than the limit of {max_bytes} bytes ([run] max_line_bytes)")
    if len(fields) != width:
        return RowProblem("bad_row", f"row has {len(fields)} fields, the header has {width}")
    return dict(zip(header, fields))


def read_parquet(path: str | os.PathLike[str]) -> Iterator[tuple[int, Row]]:
    """(row number, record) for each row of a Parquet file, read one batch of rows at a time.

    Values are what pyarrow gives (numbers, strings, lists, nested dicts, dates and times),
    with decimals as their exact text, durations in seconds and binary values as UTF-8 text;
    a binary value that is not UTF-8 makes its row a problem.
    """
    pq = pyarrow_parquet(f"reading {path}")
    import pyarrow as pa

    try:
        # Read in bounded buffers, on this thread: pyarrow's defaults (pre-buffered column chunks,
        # a reader thread pool) held ~60 % more memory on 1,000,000 rows (bench/RESULTS.md).
        parquet = pq.ParquetFile(path, buffer_size=PARQUET_READ_BUFFER, pre_buffer=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such input file") from None
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable Parquet file: {exc}") from exc
    with parquet:
        fix = [f.name for f in parquet.schema_arrow if _needs_plain_values(f.type)]
        number = 0
        batches = parquet.iter_batches(batch_size=PARQUET_READ_BATCH, use_threads=False)
        pool = pa.default_memory_pool()
        while True:
            try:
                batch = next(batches, None)
            except (OSError, pa.ArrowException) as exc:
                raise InputError(f"{path}: cannot read the rows after row {number}: {exc}") from exc
            if batch is None:
                return
            if number % (PARQUET_READ_BATCH * 64) == 0:
                pool.release_unused()  # the allocator keeps freed pages unless asked: memory stays flat
            for record in batch.to_pylist():
                number += 1
                if fix:
                    try:
                        for name in fix:
                            record[name] = _plain(record[name])
                    except UnicodeDecodeError:
                        yield number, RowProblem("invalid_utf8", f"binary column {name!r} is not UTF-8 text")
                        continue
                yield number, record


def _needs_plain_values(kind: pyarrow.DataType) -> bool:
    """Whether values of this Arrow type are not JSON values as pyarrow gives them (decimals, bytes, durations)."""
    import pyarrow.types as t

    if t.is_decimal(kind) or t.is_binary(kind) or t.is_large_binary(kind) or t.is_fixed_size_binary(kind):
        return True
    if t.is_duration(kind):
        return True
    if t.is_list(kind) or t.is_large_list(kind) or t.is_fixed_size_list(kind):
        return _needs_plain_values(kind.value_type)
    if t.is_struct(kind):
        return any(_needs_plain_values(kind.field(i).type) for i in range(kind.num_fields))
    if t.is_map(kind):
        return _needs_plain_values(kind.key_type) or _needs_plain_values(kind.item_type)
    return False


def _plain(value: Any) -> Any:
    import datetime
    import decimal

    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- writing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column of a flat results file: its name and JSON Schema type (None: any JSON value)."""

    name: str
    kind: str | None  # "string", "integer", "number", "boolean", or None (nested or unknown: JSON text)
    field: str | None = None  # the top-level field of a structured answer it holds


def _cell(value: Any) -> str:
    """A CSV cell: text as it is, null empty, anything else as JSON (true, 3, {"a": 1})."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def csv_chunks(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    """A header row, then one CSV row per row (RFC 4180 quoting, ``\\r\\n``), in chunks of UTF-8 bytes."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    names = [c.name for c in columns]
    writer.writerow(names)
    count = 0
    for row in rows:
        writer.writerow([_cell(row.get(name)) for name in names])
        count += 1
        if count % CSV_CHUNK_ROWS == 0:
            yield _drain(buffer).encode()
    yield _drain(buffer).encode()


def _drain(buffer: io.StringIO) -> str:
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


class _Sink:
    """A write-only file for pyarrow that keeps what it is given until :meth:`drain`."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._written = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        self._written += len(data)
        return len(data)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def drain(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


def parquet_chunks(columns: Sequence[Column], rows: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    """The bytes of one Parquet file of these rows, a row group (:data:`PARQUET_ROW_GROUP` rows) a chunk.

    A column's Arrow type follows its JSON Schema type; a nested or untyped value is its JSON text.
    """
    pq = pyarrow_parquet("--format parquet", ExportError)
    import pyarrow as pa

    schema = pa.schema([pa.field(c.name, _arrow_type(c.kind)) for c in columns])
    sink = _Sink()
    writer = pq.ParquetWriter(sink, schema)
    try:
        group: list[Mapping[str, Any]] = []
        for row in rows:
            group.append(row)
            if len(group) >= PARQUET_ROW_GROUP:
                writer.write_table(_table(pa, schema, columns, group))
                group.clear()
                pa.default_memory_pool().release_unused()
                yield sink.drain()
        if group:
            writer.write_table(_table(pa, schema, columns, group))
    finally:
        writer.close()
    yield sink.drain()


def _arrow_type(kind: str | None) -> pyarrow.DataType:
    import pyarrow as pa

    return {"integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}.get(kind or "", pa.string())


def _table(
    pa: Any, schema: pyarrow.Schema, columns: Sequence[Column], group: Sequence[Mapping[str, Any]]
) -> pyarrow.Table:
    arrays = []
    for column, field in zip(columns, schema):
        values = [row.get(column.name) for row in group]
        if column.kind not in ("string", "integer", "number", "boolean"):
            values = [None if v is None else v if isinstance(v, str) else orjson.dumps(v).decode() for v in values]
        arrays.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)
