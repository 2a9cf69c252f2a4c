"""The export's file handling (issue 14, cases 9 and 10): leftovers of a killed export are
cleared (never a live one), a crash after the rename does not orphan the file, an OSError is
a one-line ExportError, and a stop between lines leaves nothing behind."""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.errors import ExportError, StoppedError
from batchrun.export import export_job
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger
from batchrun.report import write_html_report
from batchrun.spec import Overrides, spec_for_batch_input
from batchrun.states import ExitCode

BATCH_SPEC = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1"))
N = 50


class Crash(BaseException):
    """The process dies here (SIGKILL, power cut): nothing after it runs."""


@pytest.fixture
def job(ledger: Ledger, write_jsonl: Callable[..., Path]) -> int:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}} for i in range(N)]
    return prepare_job(ledger, BATCH_SPEC, write_jsonl(lines)).job_id


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


def temp_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name.endswith(".tmp")}


@pytest.fixture
def held_lock(folder: Path) -> Iterator[Path]:
    """A temporary file of an export in progress in another process: its lock is held."""
    live = folder / ".out.jsonl.live1234.tmp"
    live.write_bytes(b'{"custom_id": "half')
    fd = os.open(live, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield live
    finally:
        os.close(fd)


def test_leftovers_of_killed_exports_are_removed_but_not_a_live_one(
    ledger: Ledger, job: int, folder: Path, held_lock: Path
) -> None:
    dead = folder / ".out.jsonl.dead5678.tmp"
    dead.write_bytes(b'{"custom_id": "r0"')
    other = folder / ".out.jsonl.extra.abcd1234.tmp"  # a leftover of "out.jsonl.extra", another file
    other.write_bytes(b"")
    export_job(ledger, job, folder / "out.jsonl")
    assert temp_files(folder) == {held_lock.name, other.name}
    assert len((folder / "out.jsonl").read_bytes().splitlines()) == N


def test_the_html_report_clears_its_own_leftovers(folder: Path) -> None:
    dead = folder / ".report.html.dead5678.tmp"
    dead.write_bytes(b"<html")
    write_html_report(folder / "report.html", "<html></html>")
    assert temp_files(folder) == set()
    assert (folder / "report.html").read_text() == "<html></html>"


def test_a_crash_just_after_the_rename_does_not_orphan_the_file(
    ledger: Ledger, job: int, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = folder / "out.jsonl"
    real_replace = os.replace

    def replace_then_die(src: str, dst: str) -> None:
        real_replace(src, dst)
        raise Crash

    monkeypatch.setattr(os, "replace", replace_then_die)
    with pytest.raises(Crash):
        export_job(ledger, job, out)
    monkeypatch.setattr(os, "replace", real_replace)
    assert out.exists()
    export_job(ledger, job, out)  # its own file: replaced, not refused
    assert len(out.read_bytes().splitlines()) == N and temp_files(folder) == set()


def test_an_os_error_while_writing_is_a_one_line_export_error(
    ledger: Ledger, job: int, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = folder / "out.jsonl"

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ExportError) as caught:
        export_job(ledger, job, out)
    message = caught.value.message
    assert str(out) in message and "No space left on device" in message
    assert f"batchrun export {job} --output" in message
    assert "\n" not in message
    # The job's results are safe in the ledger; only the file is missing: "resume later", not "usage".
    assert caught.value.exit_code == ExitCode.TEMPFAIL
    assert not out.exists() and temp_files(folder) == set()


def refuses_files(folder: str) -> bool:
    """Whether creating a file in ``folder`` fails even for root (sysfs does)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder)
    except OSError:
        return True
    os.close(fd)
    os.unlink(name)
    return False


@pytest.mark.skipif(not (os.path.isdir("/sys") and refuses_files("/sys")), reason="needs a folder that refuses files")
def test_a_folder_that_refuses_the_file_is_an_export_error(ledger: Ledger, job: int) -> None:
    with pytest.raises(ExportError, match=r"/sys/out\.jsonl: cannot write: Permission denied"):
        export_job(ledger, job, "/sys/out.jsonl")


def test_a_stop_between_lines_leaves_no_temporary_file(ledger: Ledger, job: int, folder: Path) -> None:
    out = folder / "out.jsonl"
    out.write_bytes(b"")  # an earlier export of this job's, say: must survive the stop untouched
    asked = 0

    def stop_after_ten() -> bool:
        nonlocal asked
        asked += 1
        return asked > 10

    with pytest.raises(StoppedError, match=f"stopped while writing {out}"):
        export_job(ledger, job, out, should_stop=stop_after_ten, force=True)
    assert out.read_bytes() == b"" and temp_files(folder) == set()
    lines = export_job(ledger, job, out, force=True).lines
    assert lines == N and [orjson.loads(x)["custom_id"] for x in out.read_bytes().splitlines()][:2] == ["r0", "r1"]
