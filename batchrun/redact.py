"""Keeping API keys out of everything we write: logs, errors, the ledger, ``check`` output.

The key is read at one edge (:func:`batchrun.providers.provider_for`) and
registered here; every path that writes text a server or an exception may have
filled (error messages, response bodies, log records) passes it through
:func:`redact` first.
"""

from __future__ import annotations

import logging
import threading

MASK = "[REDACTED]"
_MIN_SECRET_LENGTH = 8  # shorter values would mask ordinary words

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever :func:`redact` sees it from now on (process-wide)."""
    global _secrets
    if not value or len(value) < _MIN_SECRET_LENGTH:
        return
    with _lock:
        if value not in _secrets:
            # longest first, so a key containing another is masked whole
            _secrets = tuple(sorted((*_secrets, value), key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``[REDACTED]``."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def contains_secret(text: str) -> bool:
    return any(secret in text for secret in _secrets)


def redact_optional(text: str | None) -> str | None:
    return None if text is None else redact(text)


class RedactingFilter(logging.Filter):
    """A logging filter that masks secrets in the final message of every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _secrets:
            message = record.getMessage()
            cleaned = redact(message)
            if cleaned != message:
                record.msg, record.args = cleaned, None
            if record.exc_info and record.exc_info[1] is not None:
                record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
                record.exc_info = None
        return True
