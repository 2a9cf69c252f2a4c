"""run_sync: the library's event loop for a synchronous call, also from inside a running loop."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading

import pytest

from batchrun.eventloop import RUN_GC_THRESHOLD, run_sync


async def where() -> tuple[str, asyncio.AbstractEventLoop]:
    return threading.current_thread().name, asyncio.get_running_loop()


async def fails() -> None:
    raise LookupError("from the coroutine")


def test_returns_the_coroutines_value_on_this_thread() -> None:
    name, _ = run_sync(where())
    assert name == threading.current_thread().name


def test_raises_the_coroutines_error() -> None:
    with pytest.raises(LookupError, match="from the coroutine"):
        run_sync(fails())


def test_inside_a_running_loop_it_runs_on_a_fresh_loop_in_a_helper_thread() -> None:
    async def cell() -> tuple[asyncio.AbstractEventLoop, str, asyncio.AbstractEventLoop]:
        name, loop = run_sync(where())
        return asyncio.get_running_loop(), name, loop

    callers, name, loop = asyncio.run(cell())
    assert name == "batchrun-loop" and loop is not callers


def test_inside_a_running_loop_the_error_reaches_the_caller() -> None:
    async def cell() -> None:
        run_sync(fails())

    with pytest.raises(LookupError, match="from the coroutine"):
        asyncio.run(cell())


def test_a_library_callers_heap_is_not_frozen() -> None:
    frozen, threshold = gc.get_freeze_count(), gc.get_threshold()
    run_sync(where())
    assert gc.get_freeze_count() == frozen and gc.get_threshold() == threshold


def test_the_commands_heap_is_frozen_for_the_run() -> None:
    code = (
        "import asyncio, gc\n"
        "from batchrun import eventloop\n"
        "eventloop.command_startup()\n"
        "assert gc.get_threshold() == eventloop.STARTUP_GC_THRESHOLD\n"
        "eventloop.run_sync(asyncio.sleep(0))\n"
        "print(gc.get_freeze_count() > 0, gc.get_threshold())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"True {RUN_GC_THRESHOLD}"


def test_runs_on_uvloop_by_default_and_on_asyncio_when_told() -> None:
    from batchrun import eventloop

    _, loop = run_sync(where())
    assert type(loop).__module__.startswith("uvloop") and eventloop.loop_name() == "uvloop"
    eventloop.use_uvloop(False)
    try:
        _, loop = run_sync(where())
        assert type(loop).__module__.startswith("asyncio") and eventloop.loop_name() == "asyncio"
    finally:
        eventloop.use_uvloop(True)


@pytest.mark.parametrize(("value", "expected"), [("0", "asyncio"), ("off", "asyncio"), ("1", "uvloop"), ("", "uvloop")])
def test_the_command_turns_uvloop_off_with_its_variable(value: str, expected: str) -> None:
    code = (
        "import asyncio\nfrom batchrun import eventloop\n"
        "eventloop.command_startup()\n"
        "async def which():\n    return type(asyncio.get_running_loop()).__module__.split('.')[0]\n"
        "print(eventloop.loop_name(), eventloop.run_sync(which()))"
    )
    env = {**os.environ, "BATCHRUN_UVLOOP": value}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.split()
    assert out == [expected, expected]


def test_uvloop_is_a_dependency_where_it_installs() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert "uvloop>=0.19; sys_platform != 'win32' and platform_python_implementation == 'CPython'" in project["dependencies"]
