"""Export a job's items from the ledger to files, atomically, or to a stream (standard output).

Formats: ``results`` and the providers' batch line shapes (JSONL), and ``csv`` / ``parquet``:
the ``results`` fields as flat columns (:func:`table_columns`), one per top-level field of a
structured answer, written a chunk at a time by :mod:`batchrun.tabular`.

A file is written to a temporary name in the same folder, fsynced and renamed
over the target, so a reader sees the old file or the new one, never half of
one. An existing file is only replaced when its content is one of this job's
own earlier exports (their hashes are in the ledger), or with ``force``; the
hash is recorded before the rename, so a crash between the two never leaves
the job's own file looking foreign.

A write holds an exclusive ``flock`` on its temporary file until the rename.
The temporary files of a killed write (``.NAME.*.tmp``) are removed by the next
write of that file: those whose lock is free, never one a live write holds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from batchrun import interrupt
from batchrun.errors import ExportError, ExportWriteError, StoppedError
from batchrun.formats import FORMATS, TABLE_FORMATS
from batchrun.hints import command
from batchrun.provider_registry import kinds_of_format, provider_entry
from batchrun.states import ERROR_STATES, OPEN_STATES, ItemState
from batchrun.tabular import Column, csv_chunks, parquet_chunks

if TYPE_CHECKING:
    from batchrun.ledger import ItemRow, Ledger

STREAM_NAME = "-"  # an export to a stream (``--output -``) has this as its path
TEMP_SUFFIX = ".tmp"
_TEMP_STEM = 200  # of the target's name in a temporary name: room is left for the random part (255 in all)


@dataclass(frozen=True)
class ExportResult:
    path: Path  # Path("-") for an export to a stream
    lines: int
    errors_path: Path | None
    error_lines: int


def _error(row: ItemRow) -> dict[str, Any] | None:
    if row.error_class is None and row.state not in (*OPEN_STATES, ItemState.CANCELLED):
        return None
    error: dict[str, Any] = {
        "class": row.error_class or row.state,
        "message": row.error_message or f"item is {row.state}",
    }
    if row.status_code is not None:
        error["status_code"] = row.status_code
    if row.state == ItemState.REJECTED:
        error["line"] = row.line
    if row.validation_errors:
        error["errors"] = orjson.loads(row.validation_errors)
    return error


def _usage(row: ItemRow) -> dict[str, Any] | None:
    if row.input_tokens is None and row.output_tokens is None:
        return None
    usage: dict[str, Any] = {"input_tokens": row.input_tokens or 0, "output_tokens": row.output_tokens or 0}
    if row.cost_usd is not None:
        usage["cost_usd"] = round(row.cost_usd, 8)
    return usage


def results_line(row: ItemRow, *, structured: bool = False) -> dict[str, Any]:
    """The ``results`` format: one object per item; ``output`` is parsed JSON for a job with a schema.

    A line whose answer was reused from an earlier request (the response cache) also has ``"cached": true``.
    """
    output: Any = None
    if row.state == ItemState.SUCCEEDED:
        output = orjson.loads(row.parsed) if structured and row.parsed is not None else row.output
    line = {
        "custom_id": row.custom_id,
        "status": row.state,
        "output": output,
        "usage": _usage(row),
        "attempts": row.attempts,
        "latency_ms": round(row.latency_ms, 3) if row.latency_ms is not None else None,
        "error": None if row.state == ItemState.SUCCEEDED else _error(row),
    }
    if row.cached_from is not None and row.state == ItemState.SUCCEEDED:
        # A reused answer (the response cache): usage is the answer's, its cost_usd 0.
        line["cached"] = True
    return line


def errors_line(row: ItemRow) -> dict[str, Any]:
    """One line of the errors file: a failed, invalid or rejected item."""
    return {
        "custom_id": row.custom_id,
        "line": row.line,
        "status": row.state,
        "error_class": row.error_class,
        "error_message": row.error_message,
        "status_code": row.status_code,
        "attempts": row.attempts,
        "validation_errors": orjson.loads(row.validation_errors) if row.validation_errors else None,
        "raw": row.output if row.state == ItemState.INVALID_OUTPUT else row.response,
    }


# The columns of a flat results file besides the answer's: (name, JSON Schema type).
_LEAD_COLUMNS = (Column("custom_id", "string"), Column("status", "string"))
_TAIL_COLUMNS = (
    Column("input_tokens", "integer"), Column("output_tokens", "integer"), Column("cost_usd", "number"),
    Column("attempts", "integer"), Column("latency_ms", "number"), Column("error_class", "string"),
    Column("error_message", "string"), Column("cached", "boolean"),
)
_SIMPLE_TYPES = ("string", "integer", "number", "boolean")


def table_columns(schema: Mapping[str, Any] | None) -> tuple[Column, ...]:
    """The columns of a ``csv`` / ``parquet`` export for a job with this output schema (None: none).

    ``custom_id``, ``status``, then one column per top-level property of an object schema (named
    ``output.NAME`` if NAME is one of the other columns; a nested value is its JSON text), or one
    ``output`` column, then the usage, cost, attempts, latency, error and cached columns.
    """
    answer = [Column("output", "string" if schema is None else None)]
    properties = schema.get("properties") if schema is not None else None
    if isinstance(properties, Mapping) and properties:
        taken = {c.name for c in (*_LEAD_COLUMNS, *_TAIL_COLUMNS)}
        answer = [Column(f"output.{name}" if name in taken else name, _simple_type(sub), name)
                  for name, sub in properties.items()]
    return (*_LEAD_COLUMNS, *answer, *_TAIL_COLUMNS)


def _simple_type(schema: Any) -> str | None:
    """The one scalar JSON type a property's values have (null aside), else None (written as JSON text)."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if k != "null"]
    if len(kinds) == 1 and kinds[0] in _SIMPLE_TYPES:
        return str(kinds[0])
    if kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "string"
    return None


def table_row(line: Mapping[str, Any], columns: Iterable[Column]) -> dict[str, Any]:
    """A ``results`` line (:func:`results_line`) as one flat row of ``columns``."""
    usage = line["usage"] or {}
    error = line["error"] or {}
    output = line["output"]
    row: dict[str, Any] = {
        "custom_id": line["custom_id"], "status": line["status"],
        "input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens"),
        "cost_usd": usage.get("cost_usd"), "attempts": line["attempts"], "latency_ms": line["latency_ms"],
        "error_class": error.get("class"), "error_message": error.get("message"), "cached": line.get("cached", False),
    }
    for column in columns:
        if column.field is not None:
            row[column.name] = output.get(column.field) if isinstance(output, Mapping) else None
        elif column.name == "output":
            row["output"] = output
    return row


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def refuse_input(path: str | os.PathLike[str], input_path: str | os.PathLike[str]) -> None:
    """ExportError when ``path`` is the job's input file: writing it would destroy the input (even with --force)."""
    if Path(path).resolve() == Path(input_path).resolve():
        raise ExportError(f"{path}: is the job's input file; writing the output there would destroy the input "
                          "(--force does not allow it): name another file")


def check_target(ledger: Ledger, job_id: int, path: Path, *, force: bool) -> None:
    """Refuse the job's input file, and a target that exists and is not this job's own earlier export
    (unless ``force``)."""
    refuse_input(path, ledger.get_job(job_id).input_path)
    if path.is_dir():
        raise ExportError(f"{path}: is a directory; give a file name for the output")
    if not path.parent.is_dir():
        raise ExportError(f"{path}: folder {path.parent} does not exist")
    if force or not path.exists():
        return
    try:
        sha = file_sha256(path)
    except OSError as exc:
        raise ExportError(
            f"{path}: cannot read it to check it is an earlier export of job {job_id}: {exc.strerror or exc}"
        ) from exc
    if not ledger.is_export_of(job_id, sha):
        raise ExportError(
            f"{path} already exists and is not an earlier export of job {job_id}; "
            "choose another --output or pass --force to replace it"
        )


def write_atomic(
    path: Path,
    chunks: Iterable[bytes],
    *,
    should_stop: Callable[[], bool] | None = None,
    before_rename: Callable[[str, int], None] | None = None,
) -> tuple[int, str]:
    """Write ``chunks`` to ``path`` via a locked temporary file, fsync and rename; (chunks, sha256).

    ``should_stop`` is asked before each chunk: True stops the write (StoppedError)
    and removes the temporary file; ``path`` is untouched. ``before_rename`` gets
    (sha256, chunks) once the file is on disk, before it replaces ``path``.
    OSError (after the temporary file is removed) when the folder refuses the file.
    """
    digest = hashlib.sha256()
    count = 0
    if should_stop and should_stop():
        raise StoppedError(f"stopped before writing {path}")
    remove_stale_temps(path)
    fd, tmp_name = _locked_temp(path)
    f = os.fdopen(fd, "wb", buffering=1 << 20)  # closing it releases the lock: only after the rename
    try:
        # mkstemp makes 0600; give the file the mode a plain create would (or the one it replaces).
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        for chunk in chunks:
            if should_stop and should_stop():
                raise StoppedError(f"stopped while writing {path}; nothing was written there")
            f.write(chunk)
            digest.update(chunk)
            count += 1
        f.flush()
        os.fsync(fd)
        if before_rename is not None:
            before_rename(digest.hexdigest(), count)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    finally:
        try:
            f.close()
        except OSError:
            pass  # the data was fsynced or the write is failing anyway: its own error is the one to tell
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return count, digest.hexdigest()


def _locked_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path``, under our exclusive lock.

    A cleaner may lock and delete the file between its creation and our lock:
    then it is gone from the folder once we hold the lock, and we make another.
    """
    while True:
        fd, name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, name):
                return fd, name
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def remove_stale_temps(path: Path) -> int:
    """Delete the temporary files earlier writes of ``path`` left (a killed export); how many.

    Only those whose lock can be taken: a write in progress holds its own.
    Best effort: a file that cannot be opened or locked is left alone.
    """
    prefix = _temp_prefix(path)
    removed = 0
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        # .NAME.<random>.tmp exactly: not the leftover of a longer name sharing this prefix
        if not (name.startswith(prefix) and name.endswith(TEMP_SUFFIX)) or "." in name[len(prefix) : -len(TEMP_SUFFIX)]:
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, entry.path) and stat.S_ISREG(os.fstat(fd).st_mode):
                os.unlink(entry.path)
                removed += 1
        except OSError:
            pass  # locked: a live write's (or not ours to delete)
        finally:
            os.close(fd)
    return removed


def _temp_prefix(path: Path) -> str:
    return f".{path.name[:_TEMP_STEM]}."


def _same_file(fd: int, name: str) -> bool:
    """Whether ``name`` still names the open file ``fd``."""
    try:
        named = os.stat(name, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _json_lines(lines: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    for line in lines:
        yield orjson.dumps(line) + b"\n"


def export_job(
    ledger: Ledger,
    job_id: int,
    output: str | os.PathLike[str] | IO[bytes],
    *,
    fmt: str = "results",
    errors: str | os.PathLike[str] | None = None,
    force: bool = False,
    should_stop: Callable[[], bool] | None = None,
    handle_signals: bool = False,
) -> ExportResult:
    """Write the job's items to ``output`` (one line per input record) and, if asked, the errors file.

    ``output`` is a file name, or a binary stream (``sys.stdout.buffer`` for ``--output -``):
    written as it is read, not atomically and not recorded as an export of the job.
    ``should_stop`` is asked between lines: True stops with StoppedError, and the
    file being written is left as it was. With ``handle_signals``, SIGINT/SIGTERM
    do that (:func:`batchrun.interrupt.holding`), and the StoppedError names the
    command that writes the file. ExportWriteError (exit 75) when the folder
    refuses the file.
    """
    if not handle_signals:
        return _export(ledger, job_id, output, fmt=fmt, errors=errors, force=force, should_stop=should_stop)
    with interrupt.holding() as stop_requested:
        try:
            return _export(ledger, job_id, output, fmt=fmt, errors=errors, force=force, should_stop=stop_requested)
        except StoppedError as exc:
            target = STREAM_NAME if _is_stream(output) else Path(output).absolute()  # type: ignore[arg-type]
            again = export_command(job_id, target, fmt, Path(errors).absolute() if errors else None,
                                   ledger_url=ledger.url)
            raise StoppedError(f"{interrupt.received() or 'signal'}: {exc.message}; write it with: {again}") from exc


def check_format(fmt: str) -> None:
    """ExportError for a format we cannot write."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")


def export_command(
    job_id: int, output: str | os.PathLike[str], fmt: str = "results", errors: str | os.PathLike[str] | None = None,
    *, ledger_url: str = "",
) -> str:
    """The ``batchrun export`` command that writes this export (what a stopped export says to run), with
    ``--db`` when ``ledger_url`` is not the default ledger's."""
    args: list[object] = ["export", job_id, "--output", output]
    args += ["--format", fmt] if fmt != "results" else []
    args += ["--errors", errors] if errors else []
    return command(ledger_url, *args) if ledger_url else " ".join(["batchrun", *map(str, args)])


def _is_stream(output: object) -> bool:
    return hasattr(output, "write")


def _export(
    ledger: Ledger,
    job_id: int,
    output: str | os.PathLike[str] | IO[bytes],
    *,
    fmt: str,
    errors: str | os.PathLike[str] | None,
    force: bool,
    should_stop: Callable[[], bool] | None,
) -> ExportResult:
    # Here, not above: the ledger's queries (SQLAlchemy) load only when an export runs.
    from batchrun.ledger.queries import LedgerQueries
    from batchrun.providers.batch_formats import RESULTS_LINES

    check_format(fmt)
    spec = ledger.get_job(job_id).spec
    structured = spec.output.schema is not None
    # A batch format carries the provider's own answer bodies, so it fits only its providers' jobs.
    batch_line = RESULTS_LINES.get(fmt)
    kind = spec.provider.kind
    if batch_line is not None and kind not in kinds_of_format(fmt):
        raise ExportError(
            f"--format {fmt} holds {' or '.join(kinds_of_format(fmt))} answers, but job {job_id} is a "
            f"{kind} job; use --format results or {provider_entry(kind).batch_format}"
        )
    stream: IO[bytes] | None = output if _is_stream(output) else None  # type: ignore[assignment]
    path = Path(STREAM_NAME) if stream is not None else Path(output).absolute()  # type: ignore[arg-type]
    errors_path = Path(errors).absolute() if errors else None
    if errors_path == path:
        raise ExportError("--errors must name a different file than --output")
    if stream is None:
        check_target(ledger, job_id, path, force=force)
    if errors_path:
        check_target(ledger, job_id, errors_path, force=force)
    columns = table_columns(spec.output.schema) if fmt in TABLE_FORMATS else ()

    queries = LedgerQueries(ledger.engine)
    shadowed = queries.shadowed_rejections(job_id)

    def main_lines() -> Iterable[dict[str, Any]]:
        for row in queries.iter_items(job_id):
            if row.item_id in shadowed:
                continue  # its custom_id belongs to another line; it is listed in the errors file
            if batch_line is not None:
                yield batch_line(job_id, row, _error(row))
            elif columns:
                yield table_row(results_line(row, structured=structured), columns)
            else:
                yield results_line(row, structured=structured)

    def main_chunks(rows: _Counted) -> Iterator[bytes]:
        if fmt == "csv":
            return csv_chunks(columns, rows)
        if fmt == "parquet":
            return parquet_chunks(columns, rows)
        return _json_lines(rows)

    def write(target: Path, kind: str, chunks: Iterable[bytes], rows: _Counted) -> int:
        # The hash is recorded before the rename: a crash between the two must not leave this
        # job's own file looking foreign to the next export (a hash of a file that never
        # lands is harmless: it only lets this very content be replaced).
        def record(sha: str, _chunks: int) -> None:
            ledger.record_export(job_id, str(target), kind, sha, rows.count)

        try:
            write_atomic(target, chunks, should_stop=should_stop, before_rename=record)
        except OSError as exc:
            raise ExportWriteError(
                f"{target}: cannot write: {exc.strerror or exc}; the results are safe in the ledger: "
                f"write them elsewhere with: {command(ledger.url, 'export', job_id, '--output', 'OTHER')}"
            ) from exc
        return rows.count

    main = _Counted(main_lines())
    if stream is not None:
        write_stream(stream, main_chunks(main), should_stop=should_stop)
        lines = main.count
    else:
        lines = write(path, fmt, main_chunks(main), main)
    error_lines = 0
    if errors_path:
        failed = _Counted(errors_line(r) for r in queries.iter_items(job_id) if r.state in ERROR_STATES)
        error_lines = write(errors_path, "errors", _json_lines(failed), failed)
    return ExportResult(path, lines, errors_path, error_lines)


class _Counted:
    """The rows of a file being written, counted as they are taken (lines or table rows)."""

    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        self._rows = iter(rows)
        self.count = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        row = next(self._rows)
        self.count += 1
        return row


def write_stream(stream: IO[bytes], chunks: Iterable[bytes], *, should_stop: Callable[[], bool] | None = None) -> None:
    """Write ``chunks`` to ``stream`` as they come, then flush it; ``should_stop`` is asked before each chunk.

    A reader that goes away (a closed pipe) raises BrokenPipeError here.
    """
    for chunk in chunks:
        if should_stop and should_stop():
            raise StoppedError("stopped while writing to standard output; what was written is incomplete")
        stream.write(chunk)
    stream.flush()
