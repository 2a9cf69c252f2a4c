"""Shared fixtures: ledgers on real SQLite files and (when BATCHRUN_TEST_PG is set) real PostgreSQL."""

from __future__ import annotations

import gc
import getpass
import os
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from batchrun.ledger import Ledger

PG_URL = os.environ.get("BATCHRUN_TEST_PG")
# Prompt estimates by request size, as without the tiktoken extra: whether tiktoken could
# fetch its tables must not change the figures tests assert. tests/unit/test_tokens.py
# gives tiktoken's counting its own encodings.
os.environ["BATCHRUN_TIKTOKEN"] = "0"
# Where PYTHONDONTWRITEBYTECODE is set (this machine kind sets it), every `batchrun` the tests
# start would compile batchrun's sources again (~0.4 s a command) and each collection would
# rewrite every test module's asserts again (~10 s): the bytecode goes to a cache outside the
# tree instead, for the tests' own subprocesses and for the test modules collected after this.
# The cache is a folder of this user's alone (mode 0700, checked), as pytest keeps its own
# temporary folders, so no other user of a shared /tmp can plant bytecode in it.


def _own_bytecode_cache() -> str | None:
    """A folder under the temporary directory that only this user can write, or None."""
    try:
        user = str(os.getuid()) if hasattr(os, "getuid") else getpass.getuser()
        folder = Path(tempfile.gettempdir()) / f"batchrun-tests-pycache-{user}"
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            return None
        if hasattr(os, "getuid"):
            if st.st_uid != os.getuid():
                return None
            if stat.S_IMODE(st.st_mode) & 0o077:
                folder.chmod(0o700)  # ours, made by an earlier version with the umask's mode
    except (OSError, KeyError):  # getuser: no name for this user
        return None
    return str(folder)


if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
    _cache = _own_bytecode_cache()
    if _cache is not None:
        del os.environ["PYTHONDONTWRITEBYTECODE"]
        os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = _cache
        sys.dont_write_bytecode = False


def pg_schema_url(schema: str) -> str:
    assert PG_URL
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options=-csearch_path%3D{schema}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    if not PG_URL:
        pytest.skip("set BATCHRUN_TEST_PG to a PostgreSQL URL to run PostgreSQL tests")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, pool_pre_ping=True)  # survives a PostgreSQL restart in a test
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield pg_schema_url(schema)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ledger URL on each backend."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def ledger(db_url: str) -> Iterator[Ledger]:
    led = Ledger.open(db_url)
    try:
        yield led
    finally:
        led.close()


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Write lines (dicts as JSON, str/bytes as they are) to a file; returns its path."""
    import orjson

    def write(lines: list[object], name: str = "input.jsonl", *, newline: bytes = b"\n", final_newline: bool = True) -> Path:
        parts = [
            line if isinstance(line, bytes) else line.encode() if isinstance(line, str) else orjson.dumps(line)
            for line in lines
        ]
        data = newline.join(parts) + (newline if final_newline and parts else b"")
        path = tmp_path / name
        path.write_bytes(data)
        return path

    return write


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """For a test that times a run: what earlier tests left on the heap is frozen, so no full
    garbage collection of it (seen at 90-195 ms late in the suite) pauses the run being timed.
    The CLI freezes its start-up objects the same way before a run."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# `slow` marks what `pytest -m "not slow"` (the fast subset, README) leaves out: these whole
# files (campaigns that kill processes or run many rounds) and, with @pytest.mark.slow, each
# test that takes more than about 2 s on a busy 2-core machine (a kill, a stall, a limiter
# held for seconds, a big input). Together they are most of the full suite's time.
SLOW_FILES = frozenset({
    "tests/chaos/test_chaos.py",
    "tests/acceptance/test_kill_resume.py",
    "tests/acceptance/test_batch_kill.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    for item in items:
        if item.path.resolve().relative_to(root).as_posix() in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
