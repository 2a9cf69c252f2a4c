"""batchrun.redact: registered secrets masked in text and in log records."""

from __future__ import annotations

import logging

from batchrun.redact import MASK, RedactingFilter, redact, register_secret


def test_registered_keys_are_masked_in_text_and_log_records() -> None:
    key = "sk-live-redact-me-42"
    register_secret(key)
    register_secret("short")  # too short to mask safely: ignored
    assert redact(f"Incorrect API key provided: {key}.") == f"Incorrect API key provided: {MASK}."
    assert redact("a short word") == "a short word"
    try:
        raise RuntimeError(f"boom with {key}")
    except RuntimeError:
        record = logging.LogRecord("t", logging.ERROR, __file__, 1, "key=%s", (key,), exc_info=None)
        import sys

        record.exc_info = sys.exc_info()
    assert RedactingFilter().filter(record)
    text = logging.Formatter().format(record)
    assert key not in text and MASK in text and "boom with" in text
