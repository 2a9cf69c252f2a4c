"""Inputs that are not files yet, written to one first: records from Python, and standard input.

A job is a spec and an input file's *content* (its SHA-256), and an interrupted ingest is
carried on by reading that file again. So records given as a Python iterable, and
``--input -``, are spooled to a file named by its content hash, in the ledger's folder
(``batchrun-inputs/`` beside a SQLite file; for any other ledger the user's cache folder,
``$XDG_CACHE_HOME/batchrun/inputs``). The same records spool to the same file, so a second
submit finds the same job, and resume finds its input. A spooled file is written to a
temporary name, fsynced and renamed, so it is whole or absent; it can be deleted once its
job's input is stored (``status`` no longer shows the job reading it).
"""

from __future__ import annotations

import decimal
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import orjson

from batchrun.errors import InputError
from batchrun.tabular import FORMAT_SUFFIX

SPOOL_FOLDER = "batchrun-inputs"
_CHUNK = 1 << 20
_JSON_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def spool_dir(db_url: str) -> Path:
    """Where inputs for the ledger at ``db_url`` (a SQLAlchemy URL) are spooled."""
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        return Path(url.database).absolute().parent / SPOOL_FOLDER
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchrun" / "inputs"


def spool_records(folder: Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``records`` as JSONL (keys sorted, so key order does not change the content) to a file in ``folder``.

    InputError names the record (1 for the first) that is not a mapping or holds a value JSON cannot
    hold. Numbers of numpy, decimals (as text) and Pydantic models are written as JSON values.
    """
    return _spool(folder, FORMAT_SUFFIX["jsonl"], _record_lines(records))


def spool_stream(folder: Path, stream: IO[bytes], fmt: str = "jsonl") -> Path:
    """Write what ``stream`` holds (standard input), as it is, to a file in ``folder`` named for ``fmt``."""
    return _spool(folder, FORMAT_SUFFIX[fmt], iter(lambda: stream.read(_CHUNK), b""))


def _record_lines(records: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    if isinstance(records, Mapping):
        raise InputError("records: expected an iterable of dicts (one per record), got a single mapping")
    for number, record in enumerate(records, 1):
        if not isinstance(record, Mapping):
            hint = " (for a pandas DataFrame, pass df.to_dict('records'))" if isinstance(record, str) else ""
            raise InputError(f"record {number}: expected a dict, got {type(record).__name__}{hint}")
        try:
            yield orjson.dumps(dict(record), default=_json_value, option=_JSON_OPTIONS) + b"\n"
        except orjson.JSONEncodeError as exc:
            raise InputError(f"record {number}: {exc}") from None


def _json_value(value: Any) -> Any:
    """What orjson does not write itself: decimals (their exact text), Pydantic models, numpy scalars."""
    if isinstance(value, decimal.Decimal):
        return str(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _spool(folder: Path, suffix: str, chunks: Iterable[bytes]) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".spool-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"{folder}: cannot write the input there: {exc.strerror or exc}") from exc
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        path = folder / f"{digest.hexdigest()}{suffix}"
        os.replace(tmp_name, path)  # the same content again: the same file, replaced by its twin
    except BaseException as exc:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"{folder}: cannot write the input there: {exc.strerror or exc}") from exc
        raise
    return path
