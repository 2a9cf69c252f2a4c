"""The input half of a job's identity: the SHA-256 of the input file's bytes.

Hashing a large input takes about a second per GB, and ``submit`` needs the hash before it can
find its job. So ``submit`` starts it (:func:`start_hashing`) on a thread of its own before it
imports the run machinery: file reads and hashlib let go of the GIL, so on a second core the
hash is mostly done when the job is looked up. :func:`hash_input` takes that hash if the file
is unchanged since it was started, and otherwise hashes the file itself.

Imports only the standard library: it runs before the rest of the command is loaded.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading

from batchrun.errors import InputError

# Large reads, so that the thread asks for the GIL seldom: each time it may wait for the
# importing main thread's switch interval (5 ms), which 1 MiB reads would pay 1,000 times per GB.
EARLY_CHUNK = 16 << 20
CHUNK = 1 << 20

_FileKey = tuple[int, int, int, int]


class _EarlyHash:
    """One hash being computed on its thread; ``digest`` None when it failed (hash_input then says why)."""

    def __init__(self, path: str, key: _FileKey) -> None:
        self.path = path
        self.key = key
        self.digest: str | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="batchrun-input-hash", daemon=True).start()

    def _run(self) -> None:
        try:
            self.digest = _sha256(self.path, EARLY_CHUNK)
        except Exception:  # noqa: BLE001 - hash_input hashes again and reports the cause
            self.digest = None
        finally:
            self.done.set()


_early: dict[str, _EarlyHash] = {}


def _sha256(path: str | os.PathLike[str], chunk: int) -> str:
    digest = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _file_key(path: str | os.PathLike[str]) -> _FileKey | None:
    """What tells a regular file's content changed, short of reading it; None for anything else."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def start_hashing(path: str | os.PathLike[str]) -> None:
    """Begin hashing ``path`` in the background (a no-op for anything but a regular file)."""
    key = _file_key(path)
    if key is not None:
        _early[os.path.abspath(path)] = _EarlyHash(os.fspath(path), key)


def hash_input(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the input file's bytes: the input half of a job's identity."""
    early = _early.pop(os.path.abspath(path), None)  # however the path is spelt (./x, a//b)
    if early is not None:
        early.done.wait()
        if early.digest is not None and _file_key(path) == early.key:
            return early.digest
    try:
        return _sha256(path, CHUNK)
    except FileNotFoundError:
        raise InputError(f"{path}: no such input file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a JSONL file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read input: {exc.strerror or exc}") from exc
