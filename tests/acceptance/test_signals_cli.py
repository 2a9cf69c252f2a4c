"""SIGINT/SIGTERM in every phase of a command, not only in the run loop (issue 14, case 9).

The first signal stops the command at the next clean point with exit 75 and the
command to carry on; a second stops it at once (still 75). Never 143, never
click's ``Aborted!`` (exit 1: "items failed"), never a traceback, and an
interrupted export leaves no temporary file behind.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import run_cli, start_cli
from .test_cli import SPEC

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status (Linux)")

BIG = 60_000  # items whose export takes about a second here: long enough to be signalled midway


def wait_for(condition: Callable[[], object], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.002)


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM yet (Python has none by default): the
    command is past the interpreter's own start-up, where no program can catch anything."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone already
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    assert "Traceback" not in err, err
    assert "Aborted!" not in err, err
    return proc.returncode, err


def write_records(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": f"hello {i}"}) + b"\n" for i in range(n)))
    return path


def open_for_writing(fifo: Path, proc: subprocess.Popen[str], timeout: float = 30) -> int:
    """The write end of ``fifo``, once the command has opened it to read (it blocks there until we write)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.002)


# ---------------------------------------------------------------- start-up


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_spec_is_read_stops_before_anything_is_stored(
    tmp_path: Path, server: FakeProviderServer, signum: int
) -> None:
    spec = tmp_path / "job.toml"
    os.mkfifo(spec)
    records, db, out = write_records(tmp_path / "in.jsonl", 5), tmp_path / "l.db", tmp_path / "out.jsonl"
    proc = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out))
    fd = open_for_writing(spec, proc)  # the command is in load_spec now, blocked on the read
    proc.send_signal(signum)
    time.sleep(0.2)  # delivered while it waits
    os.set_blocking(fd, True)
    try:
        os.write(fd, SPEC.format(base_url=server.base_url).encode())
    except BrokenPipeError:
        pass  # the signal ended the command: the exit code tells how
    finally:
        os.close(fd)
    code, err = finish(proc)
    assert code == 75, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "run the same command again" in err
    assert len(server.log) == 0 and not out.exists()
    # Carrying on is the same command: the job is stored and worked from the start.
    spec.unlink()
    spec.write_text(SPEC.format(base_url=server.base_url))
    again = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out))
    assert again.returncode == 0, again.stderr
    assert len(out.read_bytes().splitlines()) == 5


# ---------------------------------------------------------------- any moment of a short submit


@pytest.mark.slow
def test_a_signal_at_any_moment_of_a_submit_exits_75_and_carrying_on_finishes_it(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    """From the moment the command can catch a signal to its end: spec, ledger, ingest, the
    imports before the run, the run, the export. Each outcome is 75 (or 0 when the signal
    came after the work was done), and the command it names finishes the job exactly.
    The moments are spread over the time an unsignalled submit takes on this machine."""
    n = 40
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(base_url=server.base_url))
    records = write_records(tmp_path / "in.jsonl", n)

    def submit(i: int) -> subprocess.Popen[str]:
        return start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / f"l{i}.db"),
                         "--output", str(tmp_path / f"out{i}.jsonl"), "--quiet")

    timed = submit(0)
    wait_for(lambda: catches_sigterm(timed.pid), what="signal handler")
    started = time.monotonic()
    assert finish(timed)[0] == 0
    whole = time.monotonic() - started
    outcomes: list[int] = []
    for i, fraction in enumerate([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9], start=1):
        signum = (signal.SIGTERM, signal.SIGINT)[i % 2]
        db, out = tmp_path / f"l{i}.db", tmp_path / f"out{i}.jsonl"
        proc = submit(i)
        wait_for(lambda: catches_sigterm(proc.pid), what="signal handler")
        time.sleep(fraction * whole)
        if proc.poll() is None:
            proc.send_signal(signum)
        code, err = finish(proc)
        outcomes.append(code)
        assert code in (0, 75), f"{signal.Signals(signum).name} at {fraction:.0%}: exit {code}: {err}"
        if code == 75:
            if "run the same command again" in err:
                again = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db),
                                "--output", str(out), "--quiet")
            elif "batchrun export 1" in err:
                again = run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(out))
            else:
                assert "carry on with: batchrun resume 1" in err, err
                again = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out), "--quiet")
            assert again.returncode == 0, again.stderr
        assert not temp_files(tmp_path)
        lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"r{i}" for i in range(n))
        assert {x["status"] for x in lines} == {"succeeded"}
    assert 75 in outcomes


# ---------------------------------------------------------------- export


@pytest.fixture(scope="module")
def big_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite ledger whose job 1 has BIG items, all cancelled: finished, and slow to export."""
    folder = tmp_path_factory.mktemp("big")
    src, db = folder / "in.jsonl", folder / "l.db"
    src.write_bytes(b"".join(
        orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": [{"role": "user", "content": f"record {i} " + "x" * 200}]}})
        + b"\n" for i in range(BIG)
    ))
    stored = run_cli(folder, "submit", "--input", str(src), "--base-url", "http://127.0.0.1:9/v1", "--db", str(db), "--no-run")
    assert stored.returncode == 0, stored.stderr
    assert run_cli(folder, "cancel", "1", "--db", str(db)).returncode == 0
    return db


def signal_midway(proc: subprocess.Popen[str], folder: Path, signals: tuple[int, ...]) -> None:
    wait_for(lambda: temp_files(folder) or proc.poll() is not None, what="temporary file")
    assert proc.poll() is None, "the export ended before it could be signalled"
    for signum in signals:
        proc.send_signal(signum)
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM,), (signal.SIGINT,)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_during_export_exits_75_and_leaves_no_temporary_file(
    tmp_path: Path, big_job: Path, signals: tuple[int, ...]
) -> None:
    out = tmp_path / "out.jsonl"
    proc = start_cli(tmp_path, "export", "1", "--db", str(big_job), "--output", str(out))
    signal_midway(proc, tmp_path, signals)
    code, err = finish(proc)
    assert code == 75, err
    assert not temp_files(tmp_path) and not out.exists()
    assert f"batchrun export 1 --output {out}" in err
    done = run_cli(tmp_path, "export", "1", "--db", str(big_job), "--output", str(out))
    assert done.returncode == 0 and len(out.read_bytes().splitlines()) == BIG


@pytest.mark.slow
@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM,), (signal.SIGINT,), (signal.SIGTERM, signal.SIGTERM)],
    ids=["SIGTERM", "SIGINT", "twice"],
)
def test_a_signal_during_the_final_export_of_resume_exits_75(
    tmp_path: Path, big_job: Path, signals: tuple[int, ...]
) -> None:
    out = tmp_path / "out.jsonl"
    proc = start_cli(tmp_path, "resume", "1", "--db", str(big_job), "--output", str(out), "--quiet")
    signal_midway(proc, tmp_path, signals)
    code, err = finish(proc)
    assert code == 75, err
    assert not out.exists()
    if len(signals) == 1:
        assert not temp_files(tmp_path)
        assert f"job 1 is finished; write the output with: batchrun export 1 --output {out}" in err
    # Whatever a stop at once left behind, the next export of that file clears.
    done = run_cli(tmp_path, "export", "1", "--db", str(big_job), "--output", str(out))
    assert done.returncode == 0 and len(out.read_bytes().splitlines()) == BIG
    assert not temp_files(tmp_path)


@pytest.mark.slow
def test_a_killed_export_leaves_a_temporary_file_the_next_export_removes(tmp_path: Path, big_job: Path) -> None:
    out = tmp_path / "out.jsonl"
    proc = start_cli(tmp_path, "export", "1", "--db", str(big_job), "--output", str(out))
    signal_midway(proc, tmp_path, (signal.SIGKILL,))
    proc.communicate(timeout=30)
    left = temp_files(tmp_path)
    assert len(left) == 1 and not out.exists()
    done = run_cli(tmp_path, "export", "1", "--db", str(big_job), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert not temp_files(tmp_path) and len(out.read_bytes().splitlines()) == BIG


# ---------------------------------------------------------------- commands that only read


@pytest.mark.slow
def test_ctrl_c_still_ends_status_watch_with_130(tmp_path: Path) -> None:
    """Read-only commands get the usual signals back: ``status --watch`` ends on Ctrl-C with 130."""
    db = tmp_path / "l.db"
    records = tmp_path / "in.jsonl"
    records.write_bytes(b"".join(
        orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}) + b"\n"
        for i in range(3)
    ))
    stored = run_cli(tmp_path, "submit", "--input", str(records), "--base-url", "http://127.0.0.1:9/v1",
                     "--db", str(db), "--no-run")
    assert stored.returncode == 0, stored.stderr
    proc = start_cli(tmp_path, "status", "1", "--db", str(db), "--watch", "--interval", "0.2")
    assert proc.stdout is not None and proc.stdout.readline()  # watching: past start-up
    proc.send_signal(signal.SIGINT)
    code, _ = finish(proc)
    assert code == 130
