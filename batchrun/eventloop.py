"""The event loop of a synchronous entry point: ``run_sync(coro)`` is the library's only ``asyncio.run``.

- On uvloop when it is importable (a dependency wherever it installs: CPython off Windows;
  10-15% less CPU per request, bench/RESULTS.md), else on asyncio's own loop.
  ``BATCHRUN_UVLOOP=0`` turns it off for the ``batchrun`` command (read once at its
  start-up), :func:`use_uvloop` for a library caller.
- In the ``batchrun`` command, the objects its start-up made (modules, the spec) live as long as
  the process, so the cyclic garbage collector stops walking them: its full collections paused
  the loop for 40-100 ms several times a run while every answer waited, and about half as long
  once these are frozen (bench/RESULTS.md, T2). The command raised the collector's thresholds
  for its start-up (:func:`command_startup`); the run collects at the defaults again. A library
  caller's heap (a notebook's) is left alone: frozen objects are never collected.
- Called from a thread whose event loop is already running (Jupyter), the coroutine runs on a
  fresh loop in a helper thread, and the caller's thread waits for it.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# A command's imports make ~120,000 objects that live as long as the process; at the default
# threshold the cyclic collector walked them ~400 times on the way, ~10% of the start-up
# (bench/RESULTS.md).
STARTUP_GC_THRESHOLD = (50_000, 20, 20)
RUN_GC_THRESHOLD = (700, 10, 10)  # CPython's defaults

_command = False  # set by the command's first act: this process is the `batchrun` command
_uvloop = True  # run on uvloop when it is importable
UVLOOP_ENV = "BATCHRUN_UVLOOP"  # "0" (or "false", "no", "off"): the command runs on asyncio's loop


def use_uvloop(enabled: bool) -> None:
    """Whether :func:`run_sync` runs on uvloop (when importable; default) or on asyncio's own loop."""
    global _uvloop
    _uvloop = enabled


def loop_name() -> str:
    """The loop :func:`run_sync` runs on: ``uvloop`` or ``asyncio``."""
    if _uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            pass
        else:
            return "uvloop"
    return "asyncio"


def command_startup() -> None:
    """The ``batchrun`` command's start-up: the collector mostly idle until the first run freezes the heap."""
    import os

    global _command
    _command = True
    gc.set_threshold(*STARTUP_GC_THRESHOLD)
    # httpx imports its own command line (rich's console and pygments: 25-70 ms) whenever
    # click and rich are installed, as they are here; None makes that import fail, and
    # httpx then defines a stand-in ``httpx.main``. This command never calls it.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    if os.environ.get(UVLOOP_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        use_uvloop(False)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end on a new event loop and return its result (or raise its error)."""
    if _command:
        gc.freeze()
        gc.set_threshold(*RUN_GC_THRESHOLD)
    if not _loop_running():
        return _run(coro)
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run_beside() -> None:
        try:
            outcome.append(_run(coro))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller's thread as it is)
            failure.append(exc)

    helper = threading.Thread(target=run_beside, name="batchrun-loop")
    helper.start()
    helper.join()
    if failure:
        raise failure[0]
    return outcome[0]


def _loop_running() -> bool:
    import asyncio  # here, not above: the command imports this module first, and `--help` runs no loop

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _run(coro: Coroutine[Any, Any, T]) -> T:
    import asyncio

    if loop_name() == "asyncio":
        return asyncio.run(coro)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
