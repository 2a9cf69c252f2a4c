"""submit/resume from Python (batchrun/submission.py): the --json contract on each path, signals left to
the caller unless asked, the sync entry points inside a running loop, and the async forms."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun import interrupt
from batchrun.errors import ExportError, ExportWriteError, JobNotFoundError, StoppedError
from batchrun.jobs import PreparedJob
from batchrun.ledger import Ledger
from batchrun.scheduler import JobRunner, RunOptions
from batchrun.spec import JobSpec, Overrides, parse_spec
from batchrun.states import ExitCode, ItemState, StopReason, no_counts
from batchrun.submission import SubmitResult, resume, resume_async, submit, submit_async
from batchrun.testing import FakeProviderServer, Faults

from .test_export import refuses_files

JSON_KEYS = ["job_id", "total", "counts", "cached", "exit_code", "stop_reason", "output", "errors_file"]
FAST = RunOptions(backoff_initial=0.01, backoff_max=0.05, flush_interval=0.05)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=1)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_signal_seen() -> Iterator[None]:
    interrupt.reset()
    yield
    interrupt.reset()


def job_spec(server: FakeProviderServer) -> JobSpec:
    return parse_spec(
        {"provider": {"base_url": server.base_url, "model": "m"}, "request": {"template": "Say {text}"},
         "run": {"concurrency": 4}},
        where="test",
    )


def records(write_jsonl: Callable[..., Path], n: int = 6, *, bad: int = 0) -> Path:
    return write_jsonl([{"id": f"r{i}", "text": f"hello {i}"} for i in range(n)] + ["{broken"] * bad)


def handlers() -> dict[int, Any]:
    return {signum: signal.getsignal(signum) for signum in SIGNALS}


def the_callers(during: dict[int, Any], before: dict[int, Any]) -> bool:
    """Whether the handlers seen during a run are the caller's: SIGTERM untouched, SIGINT too or
    asyncio.run's own (it turns Ctrl-C into KeyboardInterrupt, for every caller of asyncio.run)."""
    sigint = during[signal.SIGINT]
    asyncio_run = isinstance(getattr(getattr(sigint, "func", None), "__self__", None), asyncio.Runner)
    return during[signal.SIGTERM] == before[signal.SIGTERM] and (sigint == before[signal.SIGINT] or asyncio_run)


def watch_handlers(seen: list[dict[int, Any]]) -> Callable[[JobRunner, int], Any]:
    """An ``on_start`` whose coroutine, running beside the run, notes the signal handlers in place."""

    def on_start(runner: JobRunner, todo: int) -> Any:
        async def note() -> None:
            await asyncio.sleep(0)  # the run has started: its handlers, if any, are installed
            seen.append(handlers())

        return note()

    return on_start


# ---------------------------------------------------------------- the --json contract


def test_a_finished_run_has_every_key(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    result = submit(ledger, job_spec(server), records(write_jsonl, bad=1), output=out, errors=errors, options=FAST)
    data = result.to_json()
    assert list(data) == JSON_KEYS
    assert data["counts"] == {**no_counts(), ItemState.SUCCEEDED: 6, ItemState.REJECTED: 1}
    assert data["total"] == 7 and data["cached"] == 0
    assert data["exit_code"] == ExitCode.SOME_FAILED and data["stop_reason"] is None
    assert data["output"] == str(out) and data["errors_file"] == str(errors)
    assert len(out.read_bytes().splitlines()) == 7 and len(errors.read_bytes().splitlines()) == 1
    assert orjson.loads(orjson.dumps(data)) == data  # plain JSON values
    assert result.ran and result.prepared is not None and result.prepared.created


def test_no_run_stores_the_job_and_has_every_key_with_nulls(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    prepared: list[PreparedJob] = []
    result = submit(ledger, job_spec(server), records(write_jsonl), run=False, on_prepared=prepared.append)
    assert result.to_json() == {
        "job_id": result.job_id, "total": 6, "counts": {**no_counts(), ItemState.PENDING: 6}, "cached": 0,
        "exit_code": ExitCode.OK, "stop_reason": None, "output": None, "errors_file": None,
    }
    assert [p.job_id for p in prepared] == [result.job_id] and not result.ran
    assert len(server.log) == 0


def test_a_signal_before_the_run_stops_it_with_every_key(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    """A signal that came once the job was stored (noted as the command's handlers note it): nothing is
    sent, the job as it is (its input is read beside the run, which never started), exit 75 and the
    command to carry on, which reads the input and works it."""
    def signalled(prepared: PreparedJob) -> None:
        interrupt.note(signal.SIGTERM)

    result = submit(ledger, job_spec(server), records(write_jsonl), output=tmp_path / "out.jsonl",
                    handle_signals=True, on_prepared=signalled)
    data = result.to_json()
    assert list(data) == JSON_KEYS
    assert data["total"] == 0 and not ledger.get_job(result.job_id).ingest_done
    assert data["exit_code"] == ExitCode.TEMPFAIL and data["stop_reason"] == StopReason.SIGNAL
    assert data["output"] is None and data["errors_file"] is None
    assert isinstance(result.error, StoppedError)
    assert result.error.message == (f"stopped by SIGTERM before the run started; carry on with: "
                                    f"batchrun resume {result.job_id} --db "
                                    f"{shlex.quote(ledger.url.removeprefix('sqlite:///'))}")
    assert len(server.log) == 0 and not result.ran
    resumed = resume(ledger, result.job_id, options=FAST)
    assert resumed.exit_code == ExitCode.OK and resumed.counts[ItemState.SUCCEEDED] == 6


def test_a_signal_before_the_job_is_stored_raises(ledger: Ledger, server: FakeProviderServer,
                                                  write_jsonl: Callable[..., Path]) -> None:
    interrupt.note(signal.SIGINT)
    with pytest.raises(StoppedError, match="stopped by SIGINT before the job was stored"):
        submit(ledger, job_spec(server), records(write_jsonl), handle_signals=True)
    assert ledger.list_jobs() == []


def test_without_handle_signals_a_noted_signal_changes_nothing(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """Stop points belong to the command: a library caller's run is not stopped by them."""
    interrupt.note(signal.SIGINT)
    result = submit(ledger, job_spec(server), records(write_jsonl), options=FAST)
    assert result.exit_code == ExitCode.OK and result.error is None


@pytest.mark.skipif(not (os.path.isdir("/sys") and refuses_files("/sys")), reason="needs a folder that refuses files")
def test_an_export_that_cannot_be_written_is_the_results_error(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    result = submit(ledger, job_spec(server), records(write_jsonl), output="/sys/out.jsonl", options=FAST)
    assert isinstance(result.error, ExportWriteError)
    data = result.to_json()
    assert list(data) == JSON_KEYS
    assert data["exit_code"] == ExitCode.TEMPFAIL and data["counts"][ItemState.SUCCEEDED] == 6
    assert data["output"] is None and data["stop_reason"] is None


def test_an_unknown_format_is_refused_before_anything_is_sent(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    with pytest.raises(ExportError, match="unknown format 'jsonl'"):
        submit(ledger, job_spec(server), records(write_jsonl), output=tmp_path / "out.jsonl", fmt="jsonl")
    assert len(server.log) == 0


def test_resume_has_every_key_and_refuses_an_unknown_job(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    stored = submit(ledger, job_spec(server), records(write_jsonl), run=False)
    out = tmp_path / "out.jsonl"
    result = resume(ledger, stored.job_id, output=out, options=FAST)
    assert list(result.to_json()) == JSON_KEYS
    assert result.counts[ItemState.SUCCEEDED] == 6 and result.to_json()["output"] == str(out)
    assert result.prepared is None and result.ran
    with pytest.raises(JobNotFoundError):
        resume(ledger, stored.job_id + 1)


# ---------------------------------------------------------------- signals are the caller's


def test_submit_and_resume_from_python_install_no_signal_handlers(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    before = handlers()
    during: list[dict[int, Any]] = []
    first = submit(ledger, job_spec(server), records(write_jsonl, 3), options=FAST, on_start=watch_handlers(during))
    assert first.exit_code == ExitCode.OK
    assert handlers() == before
    stored = submit(ledger, job_spec(server), records(write_jsonl, 4), new=True, run=False)
    assert resume(ledger, stored.job_id, options=FAST, on_start=watch_handlers(during)).exit_code == ExitCode.OK
    assert handlers() == before
    assert len(during) == 2 and all(the_callers(seen, before) for seen in during)


def test_with_handle_signals_the_run_has_its_own_handlers_and_gives_them_back(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """The other side of the test above: the check sees handlers when there are some."""
    before = handlers()
    during: list[dict[int, Any]] = []
    result = submit(ledger, job_spec(server), records(write_jsonl, 3), options=FAST, handle_signals=True,
                    on_start=watch_handlers(during))
    assert result.exit_code == ExitCode.OK
    assert len(during) == 1 and all(during[0][s] != before[s] for s in SIGNALS) and not the_callers(during[0], before)
    assert handlers() == before


@pytest.mark.slow
def test_a_signal_during_the_run_stops_it_and_resume_finishes(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    server.faults = Faults(latency_s=0.05)
    spec = job_spec(server)

    def signal_once_working(runner: JobRunner, todo: int) -> Any:
        async def send() -> None:
            while not runner.stats.done:
                await asyncio.sleep(0.01)
            signal.raise_signal(signal.SIGTERM)  # our handler, not the default: the test lives on

        return send()

    stopped = submit(ledger, spec, records(write_jsonl, 200), options=FAST, handle_signals=True,
                     on_start=signal_once_working)
    assert stopped.exit_code == ExitCode.TEMPFAIL and stopped.stop_reason == StopReason.SIGNAL
    assert 0 < stopped.counts[ItemState.SUCCEEDED] < 200
    assert "batchrun: SIGTERM: finishing requests in flight (up to 30 s); send again to stop at once" in capsys.readouterr().err
    interrupt.reset()
    done = resume(ledger, stopped.job_id, options=FAST)
    assert done.exit_code == ExitCode.OK and done.counts[ItemState.SUCCEEDED] == 200


# ---------------------------------------------------------------- inside a running loop, and async


def test_the_sync_entry_points_work_inside_a_running_loop(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """As in a notebook: the run goes to a fresh loop in a helper thread."""
    threads: list[str] = []

    def on_start(runner: JobRunner, todo: int) -> None:
        threads.append(threading.current_thread().name)

    async def notebook_cell() -> tuple[SubmitResult, SubmitResult]:
        first = submit(ledger, job_spec(server), records(write_jsonl, 3), options=FAST, on_start=on_start)
        stored = submit(ledger, job_spec(server), records(write_jsonl, 4), new=True, run=False)
        return first, resume(ledger, stored.job_id, options=FAST, on_start=on_start)

    first, second = asyncio.run(notebook_cell())
    assert first.counts[ItemState.SUCCEEDED] == 3 and second.counts[ItemState.SUCCEEDED] == 4
    assert threads == ["batchrun-loop", "batchrun-loop"]


def test_the_async_forms(
    ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    before = handlers()
    in_loop: list[dict[int, Any]] = []  # the caller's loop's handlers (asyncio.run's own Ctrl-C)
    during: list[dict[int, Any]] = []
    out = tmp_path / "out.jsonl"

    async def main() -> tuple[SubmitResult, SubmitResult, SubmitResult]:
        in_loop.append(handlers())
        spec = job_spec(server)
        first = await submit_async(ledger, spec, records(write_jsonl, 5), output=out, options=FAST,
                                   overrides=Overrides(concurrency=2), on_start=watch_handlers(during))
        stored = await submit_async(ledger, spec, records(write_jsonl, 2), new=True, run=False)
        second = await resume_async(ledger, stored.job_id, options=FAST, on_start=watch_handlers(during))
        return first, stored, second

    first, stored, second = asyncio.run(main())
    assert list(first.to_json()) == JSON_KEYS
    assert first.exit_code == ExitCode.OK and first.counts[ItemState.SUCCEEDED] == 5
    assert first.to_json()["output"] == str(out) and len(out.read_bytes().splitlines()) == 5
    assert stored.counts[ItemState.PENDING] == 2 and not stored.ran
    assert second.counts[ItemState.SUCCEEDED] == 2
    assert during == in_loop * 2 and handlers() == before
