"""The input's hash, started on a thread before the imports (batchrun/input_hash.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from batchrun import input_hash
from batchrun.errors import InputError
from batchrun.input_hash import hash_input, start_hashing


@pytest.fixture(autouse=True)
def _no_early_hashes() -> None:
    input_hash._early.clear()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wait_started(path: Path) -> None:
    assert input_hash._early[os.path.abspath(path)].done.wait(10)


def test_the_early_hash_is_the_files_and_is_taken_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_hash, "EARLY_CHUNK", 7)  # many reads, a short last one
    path = tmp_path / "in.jsonl"
    data = b"".join(b'{"n": %d}\n' % i for i in range(1000))
    path.write_bytes(data)
    start_hashing(path)
    _wait_started(path)
    assert hash_input(path) == _sha(data)
    assert not input_hash._early


def test_the_early_hash_is_taken_however_the_path_is_spelt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("in.jsonl").write_bytes(b"x\n")
    start_hashing("./in.jsonl")  # as typed on the command line; the job code hands on Path("./in.jsonl")
    assert input_hash._early[str(tmp_path / "in.jsonl")].done.wait(10)
    assert hash_input(Path("./in.jsonl")) == _sha(b"x\n")
    assert not input_hash._early


def test_the_early_hash_is_what_hash_input_returns_while_the_file_is_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a" * 100)
    start_hashing(path)
    _wait_started(path)
    # Same size, same mtime, same inode: only a reader of the bytes could tell. That hash_input
    # then answers the early digest shows it took the thread's work instead of reading again.
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"b" * 100)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert hash_input(path) == _sha(b"a" * 100)
    assert hash_input(path) == _sha(b"b" * 100)  # taken once: the next call reads the file


def test_a_file_changed_since_the_early_hash_is_hashed_again(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"first\n")
    start_hashing(path)
    _wait_started(path)
    path.write_bytes(b"first\nsecond\n")
    assert hash_input(path) == _sha(b"first\nsecond\n")


def test_a_file_replaced_by_another_of_the_same_size_is_hashed_again(tmp_path: Path) -> None:
    path, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    path.write_bytes(b"one\n")
    start_hashing(path)
    _wait_started(path)
    other.write_bytes(b"two\n")
    st = os.stat(path)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)  # a new inode under the same name
    assert hash_input(path) == _sha(b"two\n")


def test_a_missing_or_unreadable_input_is_reported_by_hash_input(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    start_hashing(missing)  # nothing to start
    assert not input_hash._early
    with pytest.raises(InputError, match="nope.jsonl: no such input file"):
        hash_input(missing)
    start_hashing(tmp_path)  # a directory: not a regular file
    with pytest.raises(InputError, match="is a directory"):
        hash_input(tmp_path)


def test_an_input_deleted_after_the_early_hash_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"x\n")
    start_hashing(path)
    _wait_started(path)
    path.unlink()
    with pytest.raises(InputError, match="no such input file"):
        hash_input(path)


def test_submit_hashes_its_input_early_and_stores_that_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import orjson
    from click.testing import CliRunner

    from batchrun.cli import main
    from batchrun.ledger import Ledger

    started: list[str] = []
    real_init = input_hash._EarlyHash.__init__

    def spy(self: input_hash._EarlyHash, path: str, key: input_hash._FileKey) -> None:
        started.append(path)
        real_init(self, path, key)

    monkeypatch.setattr(input_hash._EarlyHash, "__init__", spy)
    path, db = tmp_path / "batch.jsonl", tmp_path / "l.db"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    path.write_bytes(orjson.dumps(line) + b"\n")
    monkeypatch.chdir(tmp_path)  # the input as typed: ./batch.jsonl
    result = CliRunner().invoke(
        main, ["submit", "--input", "./batch.jsonl", "--base-url", "http://127.0.0.1:9/v1", "--db", str(db), "--no-run"],
        env={"OPENAI_API_KEY": "sk-test"},
    )
    assert result.exit_code == 0, result.output
    assert started == ["./batch.jsonl"] and not input_hash._early  # started, then taken
    ledger = Ledger.open(db)
    try:
        ((job, _),) = ledger.list_jobs()
        assert job.input_hash == _sha(path.read_bytes())
    finally:
        ledger.close()
