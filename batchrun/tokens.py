"""Prompt tokens before a request is sent: exact with tiktoken for OpenAI models, else a heuristic.

Without the ``tiktoken`` extra, or for a model tiktoken does not know (Claude,
a local model behind an OpenAI-compatible server), a prompt is estimated at
``BYTES_PER_TOKEN`` bytes of request JSON per token. That overcounts (the JSON
keys and quoting count too), which is the safe side for a budget.

tiktoken fetches an encoding's table over the network the first time it is
used and then keeps it in its cache (``TIKTOKEN_CACHE_DIR``), with no timeout
on the fetch. So tables are loaded on a daemon thread (``TokenCounter._loading``);
until a table is in, and if it never comes (no network), estimates use the
heuristic and nothing waits (a dry run, and ingest for a prompt near its context window,
waits ``TABLE_WAIT_SECONDS`` for it, then says so in one line). ``BATCHRUN_TIKTOKEN=0`` turns tiktoken off
(the tests do, so their figures do not depend on the network).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4
# How long a dry run (and the context guard, for a prompt near the window) waits for a table
# not yet in tiktoken's cache: a fetch that works takes
# about a second; a network that drops packets would hang it (tiktoken sets no timeout).
TABLE_WAIT_SECONDS = 2.0
TIKTOKEN_SWITCH = "BATCHRUN_TIKTOKEN"  # "0": estimate from the request size even with tiktoken installed
# OpenAI's chat format: each message is wrapped in a few tokens, and the reply is primed
# with a few more (the counting recipe in OpenAI's cookbook).
TOKENS_PER_MESSAGE = 3
REPLY_PRIMING = 3


def _tiktoken_encoding(name: str) -> Any:
    import tiktoken

    return tiktoken.get_encoding(name)


def _tiktoken_encoding_name(model: str) -> str | None:
    if os.environ.get(TIKTOKEN_SWITCH, "1") == "0":
        return None
    try:
        from tiktoken.model import encoding_name_for_model
    except ImportError:
        return None
    try:
        return encoding_name_for_model(model)
    except KeyError:
        return None


class TokenCounter:
    """The tiktoken encodings of the models a run meets, each loaded once in the background."""

    def __init__(
        self,
        load: Callable[[str], Any] = _tiktoken_encoding,
        encoding_name: Callable[[str], str | None] = _tiktoken_encoding_name,
    ) -> None:
        self._load = load
        self._encoding_name = encoding_name
        self._names: dict[str, str | None] = {}  # model -> encoding name (None: not an OpenAI model)
        self._encodings: dict[str, Any] = {}  # encoding name -> tiktoken.Encoding, once loaded
        self._started: dict[str, threading.Thread] = {}
        self._waited: set[str] = set()
        self._warned: set[str] = set()  # encodings already said to be missing (one line each)
        self._lock = threading.Lock()

    def _loading(self, name: str) -> threading.Thread:
        """The thread loading encoding ``name``, started on the first call."""
        with self._lock:
            thread = self._started.get(name)
            if thread is None:
                thread = threading.Thread(target=self._load_one, args=(name,), name=f"batchrun-tiktoken-{name}", daemon=True)
                self._started[name] = thread
                thread.start()
        return thread

    def _load_one(self, name: str) -> None:
        try:
            encoding = self._load(name)
        except Exception as exc:  # offline, a proxy, a broken cache: the heuristic stays
            self._warn(name, f"could not be fetched ({type(exc).__name__})")
            return
        with self._lock:
            self._encodings[name] = encoding

    def _warn(self, name: str, why: str) -> None:
        with self._lock:
            if name in self._warned:
                return
            self._warned.add(name)
        log.warning(
            "tiktoken's %s table %s; prompt tokens are estimated from the request size (%s=0: do not fetch)",
            name, why, TIKTOKEN_SWITCH,
        )

    def _name(self, model: str) -> str | None:
        if model not in self._names:
            self._names[model] = self._encoding_name(model)
        return self._names[model]

    def wait_for(self, model: str, *, timeout: float) -> bool:
        """Load ``model``'s encoding now, waiting at most ``timeout`` seconds (once per encoding:
        models sharing a table that does not come do not wait again); whether it is in."""
        name = self._name(model)
        if name is None:
            return False
        if name not in self._waited:
            self._waited.add(name)
            thread = self._loading(name)
            thread.join(timeout)
            if thread.is_alive():
                self._warn(name, f"is not in the cache and did not arrive within {timeout:g} s (offline?)")
        return name in self._encodings

    def encoding(self, model: Any) -> Any | None:
        """``model``'s tiktoken encoding if it is loaded; None if it has none or it is not in (yet).

        The first ask for a model starts loading its table in the background.
        """
        if not isinstance(model, str):
            return None
        name = self._name(model)
        if name is None:
            return None
        encoding = self._encodings.get(name)
        if encoding is None:
            self._loading(name)
        return encoding


def count_tokens(encoding: Any, texts: Iterable[str]) -> int:
    """Tokens of ``texts`` in a tiktoken ``encoding`` (special tokens counted as plain text)."""
    return sum(len(encoding.encode_ordinary(text)) for text in texts)


COUNTER = TokenCounter()
