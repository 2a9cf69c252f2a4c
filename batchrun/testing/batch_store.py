"""The batch APIs' state on disk: uploaded and output files, batches, and each batch's journal
of answered lines; what survives a restart of the fake server on the same directory.

Layout of the state directory::

    files/<file id>.json         the file object (FileRecord)
    files/<file id>.data         its bytes
    batches/<batch id>/batch.json     the batch (BatchRecord), replaced atomically on each change
    batches/<batch id>/requests.jsonl its lines: OpenAI, a hard link to the input file; Anthropic,
                                      one {"custom_id", "params"} line per request
    batches/<batch id>/index          the byte offset of each line (array of int64), and the end
    batches/<batch id>/answered.jsonl the journal: one line per answered line, appended when it
                                      is answered: {"r": its RequestRecord, "o": its result line}
    batches/<batch id>/results.jsonl  Anthropic: the results, written when the batch ends
    created.jsonl                     one line per batch created, appended when it is made:
                                      {"id", "kind", "created_at", "input_file_id", "metadata",
                                      "total", "custom_ids", "keys"} (the custom_id and the log
                                      key of each of its requests, in order); see
                                      :func:`read_created`
    spool/                            bodies being received (emptied at start)

The journal is the one record of progress: a line is answered (and billed) when its journal
line is written, so after a crash or a restart every line in it stays answered and no other is.
A torn last line (a kill mid-write) is cut off at load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import shutil
import string
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

_BASE62 = string.ascii_letters + string.digits


def new_id(prefix: str, n: int, alphabet: str = _BASE62) -> str:
    """A random id shaped as the providers' (``file-`` + 22 base62, ``batch_`` + 32 hex...)."""
    return prefix + "".join(secrets.choice(alphabet) for _ in range(n))


def derived_id(prefix: str, n: int, seed: str) -> str:
    """An id shaped as :func:`new_id`'s, the same each time for the same ``seed``."""
    number = int.from_bytes(hashlib.sha256(seed.encode()).digest(), "big")
    chars = []
    for _ in range(n):
        number, digit = divmod(number, len(_BASE62))
        chars.append(_BASE62[digit])
    return prefix + "".join(chars)


def new_hex_id(prefix: str) -> str:
    """``prefix`` + 32 hex digits (OpenAI batch, batch request and request ids)."""
    return prefix + secrets.token_hex(16)


@dataclass
class FileRecord:
    """An OpenAI file: an upload, or a batch's output or error file."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    order: int  # creation order, for listing
    expires_at: int | None = None

    def to_api(self) -> dict[str, Any]:
        """The File object (openai-python ``types/file_object.py``)."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


@dataclass
class BatchRecord:
    """A provider batch as stored; its progress is its journal (:class:`BatchStore`)."""

    id: str
    kind: str  # "openai" | "anthropic"
    api: str  # what answers its lines: "chat" | "responses" | "messages"
    order: int  # creation order, for listing
    created_at: float
    answer_from: float  # lines are answered evenly from here...
    answer_until: float  # ...to here (planned, wall clock)
    ends_at: float  # and the batch ends here (planned)
    expires_at: float
    cancel_s: float
    seed: int
    shuffle: bool
    status: str  # OpenAI's words: validating, failed, in_progress, finalizing, completed,
    #              expired, cancelling, cancelled (Anthropic's are derived from them)
    endpoint: str = ""
    input_file_id: str | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    total: int = 0  # lines (known once validated)
    tokens: int = 0  # estimated prompt tokens of all its lines (OpenAI's enqueued tokens)
    clean_error_file_id: str = "null"
    errors: list[dict[str, Any]] | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    unanswered: int = 0  # lines ended expired or cancelled, never answered

    @property
    def ended_at(self) -> float | None:
        return self.completed_at or self.failed_at or self.expired_at or self.cancelled_at


_BATCH_FIELDS = {f.name for f in dataclasses.fields(BatchRecord)}


class BatchStore:
    """The files and batches of the batch APIs, in a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files = root / "files"
        self._batches = root / "batches"
        self._spool = root / "spool"
        for d in (self._files, self._batches, self._spool):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self._spool.iterdir():  # bodies a stopped server was still receiving
            leftover.unlink()

    # ---------------------------------------------------------------- spool

    def spool(self) -> tuple[Path, IO[bytes]]:
        """A new temporary file for a body being received (its caller closes and moves it)."""
        path = self._spool / new_id("body-", 16)
        return path, open(path, "wb")  # noqa: SIM115 - the caller closes it

    # ---------------------------------------------------------------- files

    def load_files(self) -> list[FileRecord]:
        out = []
        for meta in self._files.glob("*.json"):
            if (self._files / (meta.stem + ".data")).exists():
                out.append(FileRecord(**orjson.loads(meta.read_bytes())))
        return out

    def file_path(self, file_id: str) -> Path:
        return self._files / (file_id + ".data")

    def save_file(self, rec: FileRecord, data: Path) -> None:
        """Move ``data`` into place as the bytes of ``rec``, then write ``rec``."""
        os.replace(data, self.file_path(rec.id))
        _write_atomic(self._files / (rec.id + ".json"), orjson.dumps(dataclasses.asdict(rec)))

    def delete_file(self, file_id: str) -> None:
        (self._files / (file_id + ".json")).unlink(missing_ok=True)
        self.file_path(file_id).unlink(missing_ok=True)

    # ---------------------------------------------------------------- batches

    def load_batches(self) -> list[BatchRecord]:
        out = []
        for meta in self._batches.glob("*/batch.json"):
            raw = orjson.loads(meta.read_bytes())
            out.append(BatchRecord(**{k: v for k, v in raw.items() if k in _BATCH_FIELDS}))
        return out

    def save_batch(self, rec: BatchRecord) -> None:
        d = self._batches / rec.id
        d.mkdir(exist_ok=True)
        _write_atomic(d / "batch.json", orjson.dumps(dataclasses.asdict(rec)))

    def delete_batch(self, batch_id: str) -> None:
        shutil.rmtree(self._batches / batch_id, ignore_errors=True)

    def requests_path(self, batch_id: str) -> Path:
        d = self._batches / batch_id
        d.mkdir(exist_ok=True)
        return d / "requests.jsonl"

    def results_path(self, batch_id: str) -> Path:
        return self._batches / batch_id / "results.jsonl"

    def link_requests(self, batch_id: str, source: Path) -> Path:
        """Make ``source`` (an input file) the batch's lines: deleting the file later leaves them."""
        target = self.requests_path(batch_id)
        target.unlink(missing_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        return target

    def write_index(self, batch_id: str, offsets: array[int]) -> None:
        tmp = self._batches / batch_id / "index.tmp"
        with open(tmp, "wb") as f:
            offsets.tofile(f)
        os.replace(tmp, self._batches / batch_id / "index")

    def read_index(self, batch_id: str) -> array[int]:
        offsets: array[int] = array("q")
        path = self._batches / batch_id / "index"
        with open(path, "rb") as f:
            offsets.frombytes(f.read())
        return offsets

    def append_created(self, entry: dict[str, Any]) -> None:
        """Log a batch just made (created.jsonl: kept when the batch is deleted)."""
        with open(self.root / "created.jsonl", "ab") as f:
            f.write(orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))

    def append_answered(self, batch_id: str, lines: bytes) -> None:
        """Append journal lines (each ending in a newline) in one write."""
        with open(self._batches / batch_id / "answered.jsonl", "ab") as f:
            f.write(lines)

    def read_answered(self, batch_id: str) -> Iterator[Any]:
        """The journal's entries, in order; a torn last line is cut off the file first."""
        path = self._batches / batch_id / "answered.jsonl"
        if not path.exists():
            return
        good = 0
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                good += len(line)
        if good != path.stat().st_size:
            os.truncate(path, good)
        with open(path, "rb") as f:
            for line in f:
                yield orjson.loads(line)


def read_created(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every batch a state directory's server created (across restarts), oldest first; a torn last
    line (a kill mid-write) is left out."""
    path = Path(root) / "created.jsonl"
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                out.append(orjson.loads(line))
    return out


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
