"""Fault-injecting local LLM API server for tests, benchmarks and ``batchrun demo``.

It speaks three APIs, each plain (one JSON body) and streamed (``"stream": true``: server-sent
events), with their real shapes, error bodies and headers:

=========================  =====================================  ============================
API                        routes (POST)                          request id / rate headers
=========================  =====================================  ============================
OpenAI Chat Completions    ``/v1/chat/completions``, ``/chat/…``  ``x-request-id``,
                                                                  ``x-ratelimit-*-requests``
OpenAI Responses           ``/v1/responses``, ``/responses``      same as Chat
Anthropic Messages         ``/v1/messages``, ``/messages``        ``request-id``,
                                                                  ``anthropic-ratelimit-requests-*``
=========================  =====================================  ============================

Answers are deterministic: ``"echo: " + the last user message``, or, for a structured request
(Chat ``response_format`` json_schema, Responses ``text.format`` json_schema, Messages
``tool_choice`` forcing a tool — answered with a ``tool_use`` block — or
``output_config.format`` json_schema), an instance of the schema derived from the request's key.
Token counts are ``len(text) // 4 + 1`` per message (system / instructions included) and per
answer, cut to the request's max tokens (``finish_reason: "length"``, ``status: "incomplete"``,
``stop_reason: "max_tokens"``).

Streams are ``content-type: text/event-stream; charset=utf-8`` with ``transfer-encoding:
chunked``, one chunk per event; the answer is sent in 16-character deltas. Each API's framing is
described in its module (:mod:`batchrun.testing.openai`, :mod:`batchrun.testing.anthropic`).

Faults (:class:`Faults`) are drawn per request from a seeded generator and each API answers them
in its own shape. The log (:class:`RequestRecord`) holds the usage each answer reported, so a
client's totals can be compared with the server's exactly.

The package, one module per concern:

- ``server``: :class:`FakeProviderServer` (listener thread, routing, lifecycle, request log);
- ``wire``: HTTP/1.1 written directly on ``asyncio`` streams, so that connection resets, hangs,
  truncated bodies and dropped streams are fully under our control;
- ``api``, ``openai``, ``anthropic``: what each API reads, answers, and how it frames errors
  and streams;
- ``answers``: the fake model (request keys, token counts, echo and schema-shaped answers);
- ``faults``: the fault plan, each request's fate, the request-rate window;
- ``ledger``: :class:`~batchrun.testing.ledger.InMemoryLedger`, a ledger stand-in for a runner's unit
  tests (``from batchrun.testing.ledger import InMemoryLedger``; not imported here, so the server
  alone loads no database code);
- ``__main__``: the command line.

Run it in its own process with::

    python -m batchrun.testing serve --port 8000 --latency 0.2 --rpm 3000 --log requests.jsonl

OpenAI clients use ``http://127.0.0.1:8000/v1`` as base URL, Anthropic clients
``http://127.0.0.1:8000``; ``--api-key KEY`` makes the server check ``Authorization: Bearer KEY``
(OpenAI routes) or ``x-api-key: KEY`` (Messages, which also takes the bearer form).
"""

from batchrun.testing.answers import default_key_fn
from batchrun.testing.faults import Faults
from batchrun.testing.server import FakeProviderServer, RequestRecord

__all__ = ["FakeProviderServer", "Faults", "RequestRecord", "default_key_fn"]
