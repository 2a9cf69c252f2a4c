"""``batchrun check``: one real request before a big run.

Builds the request exactly as ``submit`` would (same template, same
structured-output request, same streaming), sends it once without retries,
and reports what came back: status, latency, time to first token, request id,
usage, rate-limit headers and the answer checked against the schema.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchrun.errors import (
    AuthError,
    OutputInvalidError,
    ProviderError,
)
from batchrun.ingest import RequestBuilder, read_request
from batchrun.providers import provider_for
from batchrun.providers.http import Sender
from batchrun.redact import redact, redact_optional
from batchrun.spec import JobSpec
from batchrun.states import ExitCode

RATE_LIMIT_HEADER_MARKERS = ("ratelimit", "retry-after")


@dataclass
class CheckResult:
    """What one checked request did; ``exit_code`` is 0 when it answered and the answer is valid."""

    url: str
    custom_id: str
    stream: bool
    status_code: int | None = None
    latency_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    request_id: str | None = None
    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    rate_limit_headers: dict[str, str] = field(default_factory=dict)
    output: str | None = None
    parsed: Any = None
    schema: str = "none"  # none | valid | invalid
    problem: str | None = None  # why the answer is invalid
    error_class: str | None = None
    error: str | None = None
    exit_code: int = ExitCode.OK

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rate_limit_headers(headers: Any) -> dict[str, str]:
    if headers is None:
        return {}
    return {k.lower(): v for k, v in headers.items() if any(m in k.lower() for m in RATE_LIMIT_HEADER_MARKERS)}


async def check_spec(
    spec: JobSpec,
    *,
    input_path: str | Path,
    line: int = 1,
    sender: Sender | None = None,
) -> CheckResult:
    """Send the request of ``input_path``'s line ``line`` once and report on it."""
    provider = provider_for(spec)
    custom_id, url, body = read_request(input_path, RequestBuilder(spec, provider), line)
    request = provider.prepare(url, body)
    result = CheckResult(url=request.url, custom_id=custom_id, stream=request.stream)
    started = time.perf_counter()
    own_sender = sender is None
    if sender is None:
        sender = Sender.for_spec(spec)
    try:
        reply = await sender.send(provider, request, total_timeout=spec.run.timeout)
    except ProviderError as exc:
        result.latency_ms = (time.perf_counter() - started) * 1000.0
        result.status_code = exc.status_code
        result.error_class = exc.error_class
        result.error = redact(exc.message)
        result.rate_limit_headers = _rate_limit_headers(exc.headers)
        result.exit_code = ExitCode.AUTH if isinstance(exc, AuthError) else ExitCode.SOME_FAILED
        return result
    finally:
        if own_sender:
            await sender.aclose()
    result.status_code = reply.status_code
    result.latency_ms = (time.perf_counter() - started) * 1000.0
    result.ttft_ms, result.tpot_ms = reply.ttft_ms, reply.tpot_ms
    result.request_id, result.model, result.finish_reason = reply.request_id, reply.model, reply.finish_reason
    result.input_tokens, result.output_tokens = reply.input_tokens, reply.output_tokens
    result.cached_tokens = reply.cached_tokens
    result.rate_limit_headers = _rate_limit_headers(reply.headers)
    result.output = redact_optional(reply.output if reply.output is not None else reply.refusal)
    if spec.output.schema is not None:
        from batchrun.validate import OutputValidator

        try:
            verdict = OutputValidator(spec.output.schema).check(
                reply.output, finish_reason=reply.finish_reason, refusal=reply.refusal
            )
        except OutputInvalidError as invalid:
            result.schema, result.problem = "invalid", invalid.message
            result.error_class = invalid.error_class
            result.exit_code = ExitCode.SOME_FAILED
        else:
            result.schema, result.parsed = "valid", verdict.parsed
    return result


def render_check(result: CheckResult) -> str:
    """The human-readable report of a check."""

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.0f} ms"

    lines = [f"POST {result.url}{'  (stream)' if result.stream else ''}  [record {result.custom_id}]"]
    status = "no answer" if result.status_code is None else f"HTTP {result.status_code}"
    timing = f"{status} in {ms(result.latency_ms)}"
    if result.stream:
        timing += f", first token {ms(result.ttft_ms)}"
        if result.tpot_ms is not None:
            timing += f", {result.tpot_ms:.1f} ms per token after it"
    lines.append(f"status      {timing}")
    if result.request_id:
        lines.append(f"request id  {result.request_id}")
    if result.model:
        lines.append(f"model       {result.model}")
    if result.input_tokens is not None or result.output_tokens is not None:
        usage = f"input {result.input_tokens}, output {result.output_tokens}"
        if result.cached_tokens:
            usage += f" ({result.cached_tokens} input cached)"
        lines.append(f"usage       {usage}")
    if result.finish_reason:
        lines.append(f"finish      {result.finish_reason}")
    for name, value in sorted(result.rate_limit_headers.items()):
        lines.append(f"rate limit  {name}: {value}")
    if result.error:
        lines.append(f"error       {result.error_class}: {result.error}")
    if result.output is not None:
        lines.append("output      " + result.output.replace("\n", "\n            "))
    if result.schema == "valid":
        lines.append("schema      valid: " + orjson.dumps(result.parsed).decode()[:500])
    elif result.schema == "invalid":
        lines.append(f"schema      INVALID ({result.error_class}): {result.problem}")
    lines.append("result      " + ("OK" if result.exit_code == ExitCode.OK else "FAILED"))
    return "\n".join(lines)
