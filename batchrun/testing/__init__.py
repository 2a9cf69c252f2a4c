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

Batch APIs
----------

Both providers' batch APIs, with the fields and statuses of their SDKs' types (openai-python
``types/batch.py``, ``file_object.py``...; anthropic-sdk-python ``types/messages/message_batch*.py``):

==============================  ==============================================================
OpenAI Files                    ``POST /v1/files`` (multipart: ``purpose``, ``file``; streamed to
                                disk), ``GET /v1/files`` (``purpose``, ``limit``, ``order``,
                                ``after``), ``GET``/``DELETE /v1/files/{id}``,
                                ``GET /v1/files/{id}/content`` (streamed from disk)
OpenAI Batch                    ``POST /v1/batches`` (``input_file_id``, ``endpoint``
                                ``/v1/chat/completions`` or ``/v1/responses``,
                                ``completion_window`` "24h", ``metadata``), ``GET /v1/batches``
                                (``limit``, ``after``; newest first), ``GET /v1/batches/{id}``,
                                ``POST /v1/batches/{id}/cancel``
Anthropic Message Batches       ``POST /v1/messages/batches`` (``{"requests": [{"custom_id",
                                "params"}]}``), ``GET /v1/messages/batches`` (``limit``,
                                ``before_id``, ``after_id``), ``GET``/``DELETE .../{id}``,
                                ``POST .../{id}/cancel``, ``GET .../{id}/results`` (JSONL)
==============================  ==============================================================

An OpenAI batch goes ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed`` (or
``failed`` at validation: a bad line, ``token_limit_exceeded``; ``expired``; ``cancelling`` ->
``cancelled``) with output and error files as the real API writes them; an Anthropic batch is
``in_progress`` (``canceling``) until ``ended``, its counts moving only then. Lines are answered
by the same fake model as the online routes (a batch answer equals the online answer to the same
body) evenly over the batch's turnaround, in a shuffled order, so a cancel or an expiry part-way
keeps a part of them. Each answered line is logged once as a :class:`RequestRecord` with ``api``
``"batch:chat"`` / ``"batch:responses"`` / ``"batch:messages"``, its ``batch_id`` and
``custom_id``; :meth:`FakeProviderServer.billed_by_key` counts online 200s and batch lines
answered 200 together. Timing and faults are a :class:`BatchFaults` (turnaround, phases, cancel
delay, expiry, per-line 500/400, shuffle, 5xx on create and upload *after* creating, 429/5xx on
the GETs, the enqueued-token limit, the ``error_file_id`` quirk, the size limits). With
``batch_state_dir`` (``serve --batch-state DIR``) files, batches and their progress survive a
restart on the same directory: a batch's clock is the wall clock, and a line answered before the
restart is never answered (or billed) again. Module docstrings say field by field what each
route does: :mod:`batchrun.testing.batch_openai`, :mod:`batchrun.testing.batch_anthropic`,
:mod:`batchrun.testing.batch_store` (the state directory's layout).

The package, one module per concern:

- ``server``: :class:`FakeProviderServer` (listener thread, routing, lifecycle, request log);
- ``wire``: HTTP/1.1 written directly on ``asyncio`` streams, so that connection resets, hangs,
  truncated bodies and dropped streams are fully under our control;
- ``api``, ``openai``, ``anthropic``: what each API reads, answers, and how it frames errors
  and streams;
- ``answers``: the fake model (request keys, token counts, echo and schema-shaped answers);
- ``faults``: the fault plan, each request's fate, the request-rate window; ``BatchFaults``;
- ``request_log``: :class:`RequestRecord`, what the log holds;
- ``batch_service``: the batch routes' door (auth, the HTTP calls' faults) and their state;
- ``batch_http``: a batch route's call (its body read on demand) and reply (JSON or a file);
- ``batch_openai``, ``batch_anthropic``: each batch API's routes, objects and result lines;
- ``batch_work``: a batch's clock, answering its lines, ending it; ``batch_store``: on disk;
- ``batch_pages``: the lists' cursor pagination; ``multipart``: uploads read as they arrive;
- ``ledger``: :class:`~batchrun.testing.ledger.InMemoryLedger`, a ledger stand-in for a runner's unit
  tests (``from batchrun.testing.ledger import InMemoryLedger``; not imported here, so the server
  alone loads no database code);
- ``__main__``: the command line.

Run it in its own process with::

    python -m batchrun.testing serve --port 8000 --latency 0.2 --rpm 3000 --log requests.jsonl
    python -m batchrun.testing serve --port 8000 --batch-state state/ --batch-turnaround 5 \
        --batch-p-line-500 0.01 --batch-p-create-500 0.05 --batch-p-poll-429 0.1 --seed 7

OpenAI clients use ``http://127.0.0.1:8000/v1`` as base URL, Anthropic clients
``http://127.0.0.1:8000``; ``--api-key KEY`` makes the server check ``Authorization: Bearer KEY``
(OpenAI routes) or ``x-api-key: KEY`` (Messages, which also takes the bearer form).
"""

from batchrun.testing.answers import default_key_fn
from batchrun.testing.faults import BatchFaults, Faults
from batchrun.testing.refusals import Refusals
from batchrun.testing.request_log import RequestRecord
from batchrun.testing.server import FakeProviderServer

__all__ = ["BatchFaults", "FakeProviderServer", "Faults", "Refusals", "RequestRecord", "default_key_fn"]
