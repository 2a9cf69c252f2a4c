"""The progress display's own formatting (the display itself: tests/acceptance/test_progress_cli.py)."""

from __future__ import annotations

from batchrun.progress import _eta


def test_the_eta_counts_hours_past_a_day() -> None:
    assert _eta({"eta_s": None}) == "-"
    assert _eta({"eta_s": 65.4}) == "00:01:05"
    assert _eta({"eta_s": 90_000}) == "25:00:00"  # not 01:00:00
    assert _eta({"eta_s": 3 * 86_400 + 5}) == "72:00:05"
