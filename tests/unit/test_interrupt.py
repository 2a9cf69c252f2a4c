"""SIGINT/SIGTERM: stop points outside the run loop, and the run loop's handlers (stop_on_signals)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from batchrun import interrupt
from batchrun.errors import StoppedError
from batchrun.states import ExitCode, StopReason


class Run:
    """Something a signal asks to stop."""

    def __init__(self) -> None:
        self.stops: list[tuple[StopReason, str | None]] = []

    def request_stop(self, reason: StopReason, message: str | None = None) -> None:
        self.stops.append((reason, message))


@pytest.fixture(autouse=True)
def no_signal_seen() -> Iterator[None]:
    interrupt.reset()
    yield
    interrupt.reset()


def handlers() -> tuple[object, object]:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


def test_a_stop_point_stops_only_after_a_signal() -> None:
    interrupt.stop_point("before the run started")
    interrupt.note(signal.SIGTERM)
    with pytest.raises(StoppedError, match="^stopped by SIGTERM before the run started$") as stopped:
        interrupt.stop_point("before the run started")
    assert stopped.value.exit_code == ExitCode.TEMPFAIL


def test_the_first_signal_in_the_loop_stops_the_run_and_the_handlers_go_after(capsys: pytest.CaptureFixture[str]) -> None:
    before = handlers()
    run = Run()

    async def main() -> tuple[object, object]:
        with interrupt.stop_on_signals(run, lambda: 12.5):
            during = handlers()
            signal.raise_signal(signal.SIGTERM)
            for _ in range(100):
                if run.stops:
                    break
                await asyncio.sleep(0.01)
        return during

    during = asyncio.run(main())
    assert run.stops == [(StopReason.SIGNAL, "stopped by SIGTERM")]
    assert interrupt.received() == "SIGTERM"
    assert capsys.readouterr().err == (
        "batchrun: SIGTERM: finishing requests in flight (up to 12.5 s); send again to stop at once\n"
    )
    assert during[1] != before[1]
    assert handlers() == before


def test_a_signal_before_the_handlers_stops_the_run_at_once() -> None:
    run = Run()
    interrupt.note(signal.SIGINT)

    async def main() -> None:
        with interrupt.stop_on_signals(run, lambda: 1.0):
            pass

    asyncio.run(main())
    assert run.stops == [(StopReason.SIGNAL, "stopped by SIGINT")]


def test_outside_the_main_thread_no_handler_is_installed() -> None:
    run = Run()
    seen: list[tuple[object, object]] = []

    async def main() -> None:
        with interrupt.stop_on_signals(run, lambda: 1.0):
            seen.append(handlers())

    before = handlers()
    helper = threading.Thread(target=asyncio.run, args=(main(),))
    helper.start()
    helper.join()
    assert seen == [before] and run.stops == []


def test_a_second_signal_exits_75_at_once() -> None:
    code = (
        "import asyncio, signal, time\n"
        "from batchrun import interrupt\n"
        "class Run:\n"
        "    def request_stop(self, reason, message=None): pass\n"
        "async def main():\n"
        "    with interrupt.stop_on_signals(Run(), lambda: 30.0):\n"
        "        signal.raise_signal(signal.SIGINT)\n"
        "        await asyncio.sleep(0.1)\n"
        "        signal.raise_signal(signal.SIGTERM)\n"
        "        await asyncio.sleep(5)\n"
        "        print('not stopped')\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == ExitCode.TEMPFAIL, proc.stderr
    assert "not stopped" not in proc.stdout
    assert proc.stderr.startswith("batchrun: SIGINT: finishing requests in flight (up to 30 s)")


def test_the_command_ignores_signals_once_its_exit_code_is_decided() -> None:
    """The interpreter's teardown puts SIG_DFL back for every signal with a Python handler, so a
    SIGINT in the last moment of a finished submit ended it by the signal (exit -2 under load in
    test_signals_cli). Ignored signals are left ignored: the decided code stands."""
    code = (
        "import signal, sys\n"
        "import batchrun.cli\n"
        "batchrun.cli.main = lambda: sys.exit(0)\n"
        "from batchrun.__main__ import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
