"""What the fake server does wrong: the fault plan, each request's fate, the request-rate window;
and how its provider batches behave (:class:`BatchFaults`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchrun.testing.limiters import Limiter, Shape


@dataclass
class Faults:
    """What the server does wrong; probabilities are per request, drawn in this order.

    The random faults share one uniform draw ``u`` per request and occupy consecutive
    intervals (``u < p_429`` -> 429, ``u < p_429 + p_500`` -> 500, ...), so each ``p_*`` is
    the marginal probability of that fault; their sum should not exceed 1. The chain is
    p_429, p_500, p_503, p_reset, p_hang, p_bad_body, p_truncated, p_overloaded, p_stream_drop,
    p_stream_error: new faults join at the end, so a seed keeps its fates. Deterministic
    faults are applied first: ``status_override``, then the 429 burst window, then
    ``rpm_limit``. Retry-After is whole seconds rounded up, plus ``retry-after-ms`` when
    the wait is fractional (unless ``retry_after_integer``); burst 429s advertise the rest
    of the burst and rpm 429s the time until a slot frees. Every fault is answered in the
    shape of the API asked.
    """

    latency_s: float = 0.0  # added before answering (asyncio.sleep); a stream's first event too
    latency_jitter_s: float = 0.0  # uniform extra 0..jitter
    p_429: float = 0.0  # 429 with the API's rate-limit error body
    retry_after_s: float | None = 1.0  # Retry-After on random 429s; None -> no header
    p_500: float = 0.0
    p_503: float = 0.0
    p_reset: float = 0.0  # read the request, then drop the connection with a TCP RST
    p_hang: float = 0.0  # read the request, never answer
    p_bad_body: float = 0.0  # 200 whose (correctly framed) body is not valid JSON; streamed: one event's JSON cut
    p_truncated: float = 0.0  # 200 whose body stops halfway, then the connection closes
    # Faults in the *content* of a 200 answer to a structured request (Chat/Responses
    # json_schema, Messages forced tool or json_schema output), drawn from a third number:
    p_fenced: float = 0.0  # valid JSON inside a ```json code fence (Messages tool: a text block)
    p_prose: float = 0.0  # valid JSON wrapped in a sentence before and after (Messages tool: a text block)
    p_truncated_json: float = 0.0  # JSON cut in half, finish_reason "length" / incomplete / max_tokens
    p_schema_violation: float = 0.0  # JSON that breaks the schema (a required key missing)
    p_not_json: float = 0.0  # plain prose, no JSON at all (Messages tool: a text block, no tool call)
    p_refusal: float = 0.0  # Chat: message.refusal; Responses: a refusal part; Messages: stop_reason "refusal"
    output_faults_on_reask: bool = True  # False: a re-ask (a request with an assistant turn) is always answered well
    status_override: int | None = None  # answer every request with this status
    burst_429_period_s: float = 0.0  # > 0: each period (from server start) begins with...
    burst_429_duration_s: float = 0.0  # ...this many seconds of 429s for every request
    rpm_limit: int | None = None  # accepted requests per sliding 60 s window
    # Enforce rpm_limit over a shorter sliding window, scaled (1.0: at most rpm_limit/60 per second),
    # as providers may do.
    rpm_window_s: float = 60.0
    # How rpm_limit is enforced (batchrun.testing.limiters): "sliding" window, "fixed" window
    # (a counter reset every rpm_window_s), or a token "bucket" of rpm_burst tokens.
    rpm_shape: Shape = "sliding"
    rpm_burst: float = 1.0
    retry_after_integer: bool = False  # 429s carry only an integer Retry-After, no retry-after-ms
    seed: int | None = None  # random.Random(seed); changing it while running reseeds
    p_overloaded: float = 0.0  # Messages: 529 overloaded_error; OpenAI routes: 503
    # Streamed: headers and about half the events, then the connection closes with no terminal
    # event and no end of the chunked body. Not streamed: like p_truncated.
    p_stream_drop: float = 0.0
    # Streamed: about half the events, then an in-band error event (Messages ``error``
    # overloaded_error, Responses ``error`` + ``response.failed``, Chat ``data: {"error": ...}``),
    # and the stream ends cleanly. Not streamed: a 500.
    p_stream_error: float = 0.0
    stream_chunk_delay_s: float = 0.0  # slept between a stream's content deltas
    # False: rpm_limit is enforced without x-ratelimit-* / anthropic-ratelimit-* headers (the 429s are all
    # a client learns, as from a proxy or a server that does not advertise its limit).
    ratelimit_headers: bool = True


@dataclass
class BatchFaults:
    """How the batch APIs (OpenAI Files + Batch, Anthropic Message Batches) behave: their
    timing, scaled down from hours to seconds, their limits, and what they do wrong.

    A batch's timing, shuffle and expiry are frozen into it when it is created (so a batch
    created before a restart keeps its clock after it); the probabilities are read when they
    apply. Per-line draws come from the batch's own seed (drawn from ``seed`` at creation), the
    HTTP-level faults from a generator seeded with ``seed``.
    """

    turnaround_s: float = 2.0  # creation -> ended; lines are answered evenly in between
    validating_s: float = 0.1  # OpenAI: the first part of the turnaround is "validating"
    finalizing_s: float = 0.1  # OpenAI: the last part is "finalizing"
    cancel_s: float = 0.2  # cancelling / canceling -> cancelled / ended
    # The batch expires this long after creation (its unanswered lines expired, the answered
    # ones kept); None: 24 h, as the real ones (expires_at says when).
    expire_after_s: float | None = None
    shuffle: bool = True  # lines answered, and results listed, in a random order
    p_line_500: float = 0.0  # a line answered 500 inside the batch (OpenAI error file; Anthropic errored api_error)
    p_line_400: float = 0.0  # a line answered 400 invalid_request_error inside the batch
    p_create_500: float = 0.0  # a create answered 500 *after* the batch was created (it is listed)
    # Seconds a create takes at the provider once its body is in: the batch is made then, whether
    # or not the client is still there to hear of it (a client killed or timed out meanwhile).
    create_s: float = 0.0
    p_upload_500: float = 0.0  # POST /v1/files answered 500 after the file was stored (it is listed)
    p_poll_429: float = 0.0  # a GET of the batch routes (retrieve, list, file, content, results) answered 429
    p_poll_500: float = 0.0  # ... answered 500
    # OpenAI: per model, the estimated prompt tokens of unfinished batches (validated, not
    # ended) plus a new one's may not pass this, else it fails with token_limit_exceeded.
    enqueued_token_limit: int | None = None
    # OpenAI: what error_file_id is when no line failed (the real API has sent each).
    clean_error_file_id: Literal["null", "empty", "absent"] = "null"
    max_file_requests: int = 50_000  # OpenAI: lines per input file (else too_many_tasks)
    max_file_bytes: int = 200 * 1024 * 1024  # OpenAI: bytes per batch input file
    max_upload_bytes: int = 512 * 1024 * 1024  # OpenAI: bytes per upload (413 beyond)
    max_batch_requests: int = 100_000  # Anthropic: requests per batch
    max_batch_bytes: int = 256 * 1024 * 1024  # Anthropic: bytes per create body (413 beyond)
    seed: int | None = None


def fate(
    f: Faults, u: float, since_start_s: float, window: Limiter, now: float,
    overloaded_status: int, stream: bool,
) -> tuple[str, int | None, float | None]:
    """(outcome, status, Retry-After seconds or None) of a request whose fate draw is ``u``.

    ``since_start_s`` places the request in the 429 burst period; ``now`` (monotonic) in the
    request window, where an accepted request takes a slot.
    """
    burst_left = 0.0
    if f.burst_429_period_s > 0 and f.burst_429_duration_s > 0:
        phase = since_start_s % f.burst_429_period_s
        if phase < f.burst_429_duration_s:
            burst_left = f.burst_429_duration_s - phase
    if f.status_override is not None:
        status = f.status_override
        return f"status_{status}", status, f.retry_after_s if status == 429 else None
    if burst_left > 0:
        return "429", 429, burst_left
    wait = window.take(f.rpm_limit, now, f.rpm_window_s) if f.rpm_limit is not None else 0.0
    if wait > 0:
        return "429", 429, wait
    if u < (acc := f.p_429):
        return "429", 429, f.retry_after_s
    if u < (acc := acc + f.p_500):
        return "500", 500, None
    if u < (acc := acc + f.p_503):
        return "503", 503, None
    if u < (acc := acc + f.p_reset):
        return "reset", None, None
    if u < (acc := acc + f.p_hang):
        return "hang", None, None
    if u < (acc := acc + f.p_bad_body):
        return "bad_body", 200, None
    if u < (acc := acc + f.p_truncated):
        return "truncated", 200, None
    if u < (acc := acc + f.p_overloaded):
        return "overloaded", overloaded_status, None
    if u < (acc := acc + f.p_stream_drop):
        return "stream_drop", 200, None
    if u < acc + f.p_stream_error:
        return "stream_error", 200 if stream else 500, None
    return "ok", 200, None


def content_fault(f: Faults, v: float) -> str | None:
    """The content fault of a structured answer whose third draw is ``v``, if any."""
    acc = 0.0
    for name, p in (
        ("fenced", f.p_fenced), ("prose", f.p_prose), ("truncated_json", f.p_truncated_json),
        ("schema_violation", f.p_schema_violation), ("not_json", f.p_not_json), ("refusal", f.p_refusal),
    ):
        acc += p
        if v < acc:
            return name
    return None
