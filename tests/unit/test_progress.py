"""The progress display's own formatting (the display itself: tests/acceptance/test_progress_cli.py)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re

import pytest

from batchrun.progress import _eta, show_progress
from batchrun.testing.ledger import InMemoryLedger

from .test_scheduler import FakeChat, add_job, answer_after, make_spec, runner


def test_the_eta_counts_hours_past_a_day() -> None:
    assert _eta({"eta_s": None}) == "-"
    assert _eta({"eta_s": 65.4}) == "00:01:05"
    assert _eta({"eta_s": 90_000}) == "25:00:00"  # not 01:00:00
    assert _eta({"eta_s": 3 * 86_400 + 5}) == "72:00:05"


class _Terminal(io.StringIO):
    """A stream that says it is a terminal: the live bar is drawn into it."""

    def isatty(self) -> bool:
        return True


def test_the_live_bar_fits_80_columns_and_keeps_done_total_rate_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NO_COLOR", raising=False)
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=4), 120)
    api = FakeChat(lambda body, asked: answer_after(0.02))
    job_runner = runner(ledger, job_id, api)
    screen = _Terminal()

    async def work() -> None:
        shown = asyncio.ensure_future(show_progress(job_runner, 120, stream=screen, interval=60))
        try:
            await job_runner.run()
            await asyncio.sleep(0.3)  # a frame after the last answer
        finally:
            shown.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await shown

    asyncio.run(work())
    frames = [f for f in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())) if f.strip()]
    assert len(frames) >= 3, frames
    assert all(len(f.rstrip()) <= 80 for f in frames), [f for f in frames if len(f.rstrip()) > 80]
    last = frames[-1]
    assert re.search(r"job \d+ +120/120 +\d+\.\d/s +eta ", last), last  # the most important fields first, whole
    assert any("in flight" in f or "…" in f for f in frames)  # the detail is there, cut from its end when short of room
    assert all(re.search(r"eta \S+ .*failed \d+", f) for f in frames if "/s" in f), frames  # failures kept first


def test_a_run_over_before_the_display_began_still_gets_its_last_record(caplog: pytest.LogCaptureFixture) -> None:
    """All from the response cache, a run can end inside the display's first wait: its last
    progress record (``--log-file``, ``-v``) must still go out (it did not under load)."""
    ledger = InMemoryLedger()
    job_id = add_job(ledger, make_spec(concurrency=4), 3)
    job_runner = runner(ledger, job_id, FakeChat(lambda body, asked: answer_after(0.0)))
    plain = io.StringIO()

    async def work() -> None:
        shown = asyncio.ensure_future(show_progress(job_runner, 3, stream=plain, interval=60))
        await asyncio.sleep(0)  # the display is in its first wait for the run
        await job_runner.run()
        shown.cancel()  # at once, as the command does when the run is over
        with contextlib.suppress(asyncio.CancelledError):
            await shown

    with caplog.at_level(logging.INFO, logger="batchrun.progress"):
        asyncio.run(work())
    records = [r.progress for r in caplog.records if r.name == "batchrun.progress"]  # type: ignore[attr-defined]
    assert records and records[-1]["job_done"] == 3 and records[-1]["job_succeeded"] == 3, records
    assert "done 3/3 ok=3" in plain.getvalue()
