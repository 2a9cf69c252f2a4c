"""Export a job's items from the ledger to JSONL files, atomically.

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from batchrun import interrupt
from batchrun.errors import ExportError, ExportWriteError, StoppedError
from batchrun.ledger import ItemRow, Ledger, LedgerQueries
from batchrun.provider_registry import BATCH_FORMATS, kinds_of_format, provider_entry
from batchrun.providers.batch_formats import RESULTS_LINES
from batchrun.states import ERROR_STATES, OPEN_STATES, ItemState

FORMATS = ("results", *BATCH_FORMATS)  # ours, then each provider batch API's line shape
TEMP_SUFFIX = ".tmp"
_TEMP_STEM = 200  # of the target's name in a temporary name: room is left for the random part (255 in all)


@dataclass(frozen=True)
class ExportResult:
    path: Path
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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_target(ledger: Ledger, job_id: int, path: Path, *, force: bool) -> None:
    """Refuse a target that exists and is not this job's own earlier export (unless ``force``)."""
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
    output: str | os.PathLike[str],
    *,
    fmt: str = "results",
    errors: str | os.PathLike[str] | None = None,
    force: bool = False,
    should_stop: Callable[[], bool] | None = None,
    handle_signals: bool = False,
) -> ExportResult:
    """Write the job's items to ``output`` (one line per input record) and, if asked, the errors file.

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
            again = export_command(job_id, Path(output).absolute(), fmt, Path(errors).absolute() if errors else None)
            raise StoppedError(f"{interrupt.received() or 'signal'}: {exc.message}; write it with: {again}") from exc


def check_format(fmt: str) -> None:
    """ExportError for a format we cannot write."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")


def export_command(
    job_id: int, output: str | os.PathLike[str], fmt: str = "results", errors: str | os.PathLike[str] | None = None
) -> str:
    """The ``batchrun export`` command that writes this export (what a stopped export says to run)."""
    return (f"batchrun export {job_id} --output {output}" + (f" --format {fmt}" if fmt != "results" else "")
            + (f" --errors {errors}" if errors else ""))


def _export(
    ledger: Ledger,
    job_id: int,
    output: str | os.PathLike[str],
    *,
    fmt: str,
    errors: str | os.PathLike[str] | None,
    force: bool,
    should_stop: Callable[[], bool] | None,
) -> ExportResult:
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
    path = Path(output).absolute()
    errors_path = Path(errors).absolute() if errors else None
    if errors_path == path:
        raise ExportError("--errors must name a different file than --output")
    check_target(ledger, job_id, path, force=force)
    if errors_path:
        check_target(ledger, job_id, errors_path, force=force)

    queries = LedgerQueries(ledger.engine)
    shadowed = queries.shadowed_rejections(job_id)

    def main_lines() -> Iterable[dict[str, Any]]:
        for row in queries.iter_items(job_id):
            if row.item_id in shadowed:
                continue  # its custom_id belongs to another line; it is listed in the errors file
            if batch_line is None:
                yield results_line(row, structured=structured)
            else:
                yield batch_line(job_id, row, _error(row))

    def write(target: Path, kind: str, rows: Iterable[dict[str, Any]]) -> int:
        # The hash is recorded before the rename: a crash between the two must not leave this
        # job's own file looking foreign to the next export (a hash of a file that never
        # lands is harmless: it only lets this very content be replaced).
        def record(sha: str, count: int) -> None:
            ledger.record_export(job_id, str(target), kind, sha, count)

        try:
            return write_atomic(target, _json_lines(rows), should_stop=should_stop, before_rename=record)[0]
        except OSError as exc:
            raise ExportWriteError(
                f"{target}: cannot write: {exc.strerror or exc}; the results are safe in the ledger: "
                f"write them elsewhere with: batchrun export {job_id} --output OTHER"
            ) from exc

    lines = write(path, fmt, main_lines())
    error_lines = 0
    if errors_path:
        error_lines = write(errors_path, "errors", (errors_line(r) for r in queries.iter_items(job_id) if r.state in ERROR_STATES))
    return ExportResult(path, lines, errors_path, error_lines)
