"""SIGINT and SIGTERM: noted, and acted on at the next clean point; the run loop's own handlers.

The command (``batchrun/__main__.py``) holds both signals from its first line:
a first signal is only recorded, and the command stops where it can stop
cleanly — before the ingest, between insert batches, before the run, between
export lines (:func:`stop_point`, :func:`holding`) — with exit 75 (DESIGN.md:
Cron and exit codes). A second signal exits 75 at once, in any phase. Inside
the run loop :func:`stop_on_signals` installs asyncio's handlers, which ask the
run (or worker) to stop claiming and drain, and count into the same record.

The library does all this only when asked (``handle_signals=True``, which the
command passes); in-process callers (tests, notebooks) keep their own
handlers. Commands that only read (``status --watch``, ``list``...) hand the
signals back (:func:`release`): Ctrl-C there keeps its usual meaning.
Importing this module installs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Protocol

from batchrun.errors import StoppedError
from batchrun.states import ExitCode, StopReason

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_seen: list[int] = []  # signals received by this command, first first
_held = False  # our recording handlers are the installed ones (only ever set by the command)
_next_command: list[str] = []  # what a second signal prints before it exits: how to carry on


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
    _next_command.clear()


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


def ended() -> None:
    """The command is over and its exit code decided: SIGINT/SIGTERM are ignored from here on.

    The interpreter's teardown puts the default handlers back for every signal with a
    Python handler (not for an ignored one), so a signal in that last moment would end
    the process by the signal (exit -2, -15) instead of the code it had decided.
    """
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def carry_on_with(command: str | None) -> None:
    """The command a second signal prints before it exits 75 (``batchrun resume 3 --db ...``)."""
    _next_command[:] = [command] if command else []


def note(signum: int) -> int:
    """Count a signal (from any handler); the second one exits 75 at once. Returns the count."""
    _seen.append(signum)
    if len(_seen) > 1:
        for stream in (sys.stdout, sys.stderr):  # what was printed (the job id) still reaches its reader
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (interrupted mid-write: exiting is what matters)
                pass
        name = signal.Signals(signum).name
        said = f"batchrun: {name} again: stopped at once" + (
            f"; carry on with: {_next_command[0]}" if _next_command else "")
        with contextlib.suppress(OSError):
            os.write(2, (said + "\n").encode())  # not through sys.stderr: it may be mid-write
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


def stop_point(where: str) -> None:
    """A clean point outside the run loop: a signal that came meanwhile stops here.

    Raises StoppedError (exit 75), ``stopped by SIGTERM`` followed by ``where``
    (what was done and how to carry on).
    """
    name = received()
    if name is not None:
        raise StoppedError(f"stopped by {name} {where}")


class Stoppable(Protocol):
    """What a signal asks to stop: a job's run or a worker."""

    def request_stop(self, reason: StopReason, message: str | None = None) -> None: ...


@contextlib.contextmanager
def stop_on_signals(target: Stoppable, grace_seconds: Callable[[], float]) -> Iterator[None]:
    """SIGINT/SIGTERM handlers on the running loop for the block, the previous handlers back after.

    The first signal prints that requests in flight finish (within ``grace_seconds()``)
    and asks ``target`` to stop claiming; a second exits 75 at once (its leases
    expire, a resume or another worker takes the items back). A signal that came
    before the block stops ``target`` at once. Outside the main thread (a loop in a
    helper thread) no handler can be installed: the block runs without.
    """
    import asyncio

    if threading.current_thread() is not threading.main_thread():
        log.warning("not in the main thread: SIGINT/SIGTERM are not handled for this run")
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        loop.add_signal_handler(signum, _on_signal, target, grace_seconds, signum)
    if stop_requested():  # came after the last stop point, before these handlers
        target.request_stop(StopReason.SIGNAL, f"stopped by {received()}")
    try:
        yield
    finally:
        for signum, handler in previous.items():
            loop.remove_signal_handler(signum)  # asyncio puts the default handlers back...
            if handler is not None:  # ...and what comes after the run needs those it had
                signal.signal(signum, handler)


def _on_signal(target: Stoppable, grace_seconds: Callable[[], float], signum: int) -> None:
    note(signum)
    name = signal.Signals(signum).name
    print(
        f"batchrun: {name}: finishing requests in flight (up to {grace_seconds():g} s); send again to stop at once",
        file=sys.stderr,
        flush=True,
    )
    target.request_stop(StopReason.SIGNAL, f"stopped by {name}")
