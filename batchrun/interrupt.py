"""SIGINT and SIGTERM outside the run loop: noted, and acted on at the next clean point.

The command (``batchrun/__main__.py``) holds both signals from its first line:
a first signal is only recorded, and the command stops where it can stop
cleanly — before the ingest, between insert batches, before the run, between
export lines — with exit 75 (DESIGN.md: Cron and exit codes). A second signal
exits 75 at once, in any phase. Inside the run loop asyncio's handlers do the
same job and count into the same record (``cli._on_signal``).

Commands that only read (``status --watch``, ``list``...) hand the signals
back (:func:`release`): Ctrl-C there keeps its usual meaning. Importing this
module installs nothing, so in-process callers (tests, the library) keep their
own handlers.
"""

from __future__ import annotations

from batchrun.states import ExitCode
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType


SIGNALS = (signal.SIGINT, signal.SIGTERM)

_seen: list[int] = []  # signals received by this command, first first
_held = False  # our recording handlers are the installed ones (only ever set by the command)


def hold() -> None:
    """Record SIGINT/SIGTERM from now on instead of dying of them (the command's first act)."""
    global _held
    for signum in SIGNALS:
        signal.signal(signum, _record)
    _held = True


def held() -> bool:
    """Whether the command holds the signals (False in-process: tests, the library)."""
    return _held


@contextlib.contextmanager
def holding() -> Iterator[Callable[[], bool]]:
    """The signals held for a block; yields :func:`stop_requested`.

    The command holds them all along already; an in-process caller (a test
    through click's runner) gets them for the block only, its own handlers back after.
    """
    if _held or threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield stop_requested
        return
    previous = {signum: signal.signal(signum, _record) for signum in SIGNALS}
    try:
        yield stop_requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def reset() -> None:
    """Forget the signals seen (an in-process caller running another command)."""
    _seen.clear()


def rehold() -> None:
    """Hold the signals again after a run loop handed them back (asyncio restores the defaults
    when its handlers are removed); nothing when the command never held them (in-process use)."""
    if _held:
        hold()


def release() -> None:
    """Give SIGINT/SIGTERM their usual behaviour back; one that came meanwhile takes effect now."""
    global _held
    if not _held:
        return
    _held = False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _seen:
        signal.raise_signal(_seen[0])


def note(signum: int) -> int:
    """Count a signal (from any handler); the second one exits 75 at once. Returns the count."""
    _seen.append(signum)
    if len(_seen) > 1:
        for stream in (sys.stdout, sys.stderr):  # what was printed (the job id) still reaches its reader
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (interrupted mid-write: exiting is what matters)
                pass
        os._exit(ExitCode.TEMPFAIL)
    return len(_seen)


def _record(signum: int, frame: FrameType | None) -> None:
    note(signum)


def stop_requested() -> bool:
    """Whether a SIGINT/SIGTERM came: the ``should_stop`` of ingest and export."""
    return bool(_seen)


def received() -> str | None:
    """The name of the first signal received (``SIGTERM``), or None."""
    return signal.Signals(_seen[0]).name if _seen else None
