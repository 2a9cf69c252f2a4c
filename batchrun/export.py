"""Export a job's items from the ledger to JSONL files, atomically.

A file is written to a temporary name in the same folder, fsynced and renamed
over the target, so a reader sees the old file or the new one, never half of
one. An existing file is only replaced when its content is one of this job's
own earlier exports (their hashes are in the ledger), or with ``force``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from batchrun.errors import ExportError
from batchrun.ledger import ItemRow, ItemState, Ledger
from batchrun.jsonutil import json_or_none

FORMATS = ("results", "openai-batch", "anthropic-batch")
# The batch formats carry the provider's own answer bodies, so each fits its provider's jobs.
_FORMAT_KINDS = {"openai-batch": ("openai", "openai-responses"), "anthropic-batch": ("anthropic",)}
ERROR_STATES = (ItemState.FAILED, ItemState.INVALID_OUTPUT, ItemState.REJECTED)


@dataclass(frozen=True)
class ExportResult:
    path: Path
    lines: int
    errors_path: Path | None
    error_lines: int


def _error(row: ItemRow) -> dict[str, Any] | None:
    if row.error_class is None and row.state not in (ItemState.PENDING, ItemState.RUNNING, ItemState.CANCELLED):
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


def openai_batch_line(job_id: int, row: ItemRow) -> dict[str, Any]:
    """The OpenAI Batch API output line shape."""
    response = None
    error = None
    body = json_or_none(row.response.encode()) if row.response else None
    if row.state == ItemState.SUCCEEDED or (row.status_code is not None and body is not None):
        response = {"status_code": row.status_code, "request_id": row.request_id or "", "body": body}
    else:
        err = _error(row) or {"class": row.state, "message": f"item is {row.state}"}
        error = {"code": err["class"], "message": err["message"]}
    return {"id": f"batch_req_{job_id}_{row.line}", "custom_id": row.custom_id, "response": response, "error": error}


def anthropic_batch_line(row: ItemRow) -> dict[str, Any]:
    """The Anthropic Message Batches results line shape (``result.type``: succeeded, errored, canceled)."""
    result: dict[str, Any]
    if row.state == ItemState.SUCCEEDED:
        result = {"type": "succeeded", "message": json_or_none(row.response.encode()) if row.response else None}
    elif row.state == ItemState.CANCELLED:
        result = {"type": "canceled"}
    else:
        err = _error(row) or {"class": row.state, "message": f"item is {row.state}"}
        body = json_or_none(row.response.encode()) if row.response else None
        if not (isinstance(body, dict) and body.get("type") == "error"):
            body = {"type": "error", "error": {"type": err["class"], "message": err["message"]}}
        result = {"type": "errored", "error": body}
    return {"custom_id": row.custom_id, "result": result}


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
    if not ledger.is_export_of(job_id, file_sha256(path)):
        raise ExportError(
            f"{path} already exists and is not an earlier export of job {job_id}; "
            "choose another --output or pass --force to replace it"
        )


def write_atomic(path: Path, lines: Iterable[dict[str, Any]]) -> tuple[int, str]:
    """Write JSON lines to ``path`` via a temporary file, fsync and rename; return (lines, sha256)."""
    digest = hashlib.sha256()
    count = 0
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes 0600; give the file the mode a plain create would (or the one it replaces).
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            count = _write_lines(f, lines, digest.update)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return count, digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_lines(f: BinaryIO, lines: Iterable[dict[str, Any]], update: Callable[[bytes], None]) -> int:
    count = 0
    for line in lines:
        data = orjson.dumps(line) + b"\n"
        f.write(data)
        update(data)
        count += 1
    return count


def export_job(
    ledger: Ledger,
    job_id: int,
    output: str | os.PathLike[str],
    *,
    fmt: str = "results",
    errors: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> ExportResult:
    """Write the job's items to ``output`` (one line per input record) and, if asked, the errors file."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    spec = ledger.get_job(job_id).spec
    structured = spec.output.schema is not None
    if fmt in _FORMAT_KINDS and spec.provider.kind not in _FORMAT_KINDS[fmt]:
        raise ExportError(
            f"--format {fmt} holds {' or '.join(_FORMAT_KINDS[fmt])} answers, but job {job_id} is a "
            f"{spec.provider.kind} job; use --format results"
            + (" or anthropic-batch" if spec.provider.kind == "anthropic" else " or openai-batch")
        )
    path = Path(output).absolute()
    errors_path = Path(errors).absolute() if errors else None
    if errors_path == path:
        raise ExportError("--errors must name a different file than --output")
    check_target(ledger, job_id, path, force=force)
    if errors_path:
        check_target(ledger, job_id, errors_path, force=force)

    shadowed = ledger.shadowed_rejections(job_id)

    def main_lines() -> Iterable[dict[str, Any]]:
        for row in ledger.iter_items(job_id):
            if row.item_id in shadowed:
                continue  # its custom_id belongs to another line; it is listed in the errors file
            if fmt == "results":
                yield results_line(row, structured=structured)
            elif fmt == "openai-batch":
                yield openai_batch_line(job_id, row)
            else:
                yield anthropic_batch_line(row)

    lines, sha = write_atomic(path, main_lines())
    ledger.record_export(job_id, str(path), fmt, sha, lines)
    error_lines = 0
    if errors_path:
        error_lines, esha = write_atomic(
            errors_path, (errors_line(r) for r in ledger.iter_items(job_id) if r.state in ERROR_STATES)
        )
        ledger.record_export(job_id, str(errors_path), "errors", esha, error_lines)
    return ExportResult(path, lines, errors_path, error_lines)
