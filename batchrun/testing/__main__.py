"""``python -m batchrun.testing serve ...``: the fake server in its own process."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from batchrun.testing.faults import BatchFaults, Faults
from batchrun.testing.refusals import Refusals
from batchrun.testing.server import FakeProviderServer


def main(argv: list[str] | None = None) -> int:
    """``python -m batchrun.testing serve ...``: run the fake server until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.testing",
        description="Fault-injecting fake LLM server: OpenAI Chat Completions and Responses, "
                    "Anthropic Messages, plain and streamed; and their batch APIs (OpenAI Files + "
                    "Batch, Anthropic Message Batches).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve on 127.0.0.1 until SIGINT/SIGTERM",
        description="Serve on 127.0.0.1 until SIGINT/SIGTERM. Online: POST /v1/chat/completions, "
                    "/v1/responses, /v1/messages. Batch: POST/GET /v1/files, GET/DELETE "
                    "/v1/files/ID, GET /v1/files/ID/content, POST/GET /v1/batches, GET "
                    "/v1/batches/ID, POST /v1/batches/ID/cancel; POST/GET /v1/messages/batches, "
                    "GET/DELETE /v1/messages/batches/ID, POST .../ID/cancel, GET .../ID/results. "
                    "A batch answers its lines with the same fake model as the online routes, "
                    "evenly over --batch-turnaround seconds (wall clock); with --batch-state its "
                    "files, batches and answered lines survive a restart on the same directory.")
    serve.add_argument("--port", type=int, default=8000, help="0 -> ephemeral")
    serve.add_argument("--latency", type=float, default=0.0, help="seconds added per request")
    serve.add_argument("--jitter", type=float, default=0.0, help="uniform extra 0..JITTER s")
    serve.add_argument("--rpm", type=int, default=None, help="sliding 60 s request limit")
    serve.add_argument("--rpm-window", type=float, default=60.0,
                       help="enforce --rpm over this sliding window in seconds, scaled (1: per second)")
    serve.add_argument("--rpm-shape", choices=["sliding", "fixed", "bucket"], default="sliding",
                       help="how --rpm is enforced over --rpm-window: a sliding window, a fixed window "
                            "(a counter reset every --rpm-window s), or a token bucket of --rpm-burst")
    serve.add_argument("--rpm-burst", type=float, default=1.0, help="bucket: tokens it holds (default 1)")
    serve.add_argument("--retry-after-integer", action="store_true",
                       help="429s carry only an integer Retry-After (rounded up), no retry-after-ms")
    serve.add_argument("--no-ratelimit-headers", action="store_true",
                       help="enforce --rpm without sending x-ratelimit-* headers (429s are all a client learns)")
    serve.add_argument("--retry-after", type=float, default=1.0,
                       help="Retry-After seconds on random 429s (negative -> no header)")
    for name in ("429", "500", "503", "reset", "hang", "bad-body", "truncated", "overloaded",
                 "stream-drop", "stream-error"):
        serve.add_argument(f"--p-{name}", type=float, default=0.0,
                           help=f"probability of a {name} fault")
    serve.add_argument("--status", type=int, default=None, help="answer everything with STATUS")
    serve.add_argument("--burst-period", type=float, default=0.0, help="429 burst period, s")
    serve.add_argument("--burst-duration", type=float, default=0.0, help="429 burst length, s")
    serve.add_argument("--stream-chunk-delay", type=float, default=0.0,
                       help="seconds slept between a stream's content deltas")
    serve.add_argument("--api-key", default=None,
                       help="require this key (Authorization: Bearer / x-api-key), else 401")
    serve.add_argument("--models", default=None, metavar="M1,M2",
                       help="only these models exist: a request for any other gets a 404")
    serve.add_argument("--seed", type=int, default=None)
    serve.add_argument("--log", default=None,
                       help="append one JSON line per request (and per answered batch line) here")
    batch = serve.add_argument_group("batch APIs")
    defaults = BatchFaults()
    batch.add_argument("--batch-state", default=None, metavar="DIR",
                       help="keep files, batches and their progress in DIR (survives restarts)")
    batch.add_argument("--batch-turnaround", type=float, default=defaults.turnaround_s, metavar="S",
                       help="seconds from a batch's creation to its end (default %(default)s)")
    batch.add_argument("--batch-validating", type=float, default=defaults.validating_s, metavar="S",
                       help="OpenAI: seconds a batch stays 'validating' (part of the turnaround)")
    batch.add_argument("--batch-finalizing", type=float, default=defaults.finalizing_s, metavar="S",
                       help="OpenAI: seconds a batch stays 'finalizing' (part of the turnaround)")
    batch.add_argument("--batch-cancel-delay", type=float, default=defaults.cancel_s, metavar="S",
                       help="seconds from a cancel to the batch's end")
    batch.add_argument("--batch-expire-after", type=float, default=None, metavar="S",
                       help="a batch expires S seconds after creation, unanswered lines expired "
                            "(default: 24 h)")
    batch.add_argument("--batch-create-delay", type=float, default=defaults.create_s, metavar="S",
                       help="seconds a create takes once its body is in; the batch is made then, "
                            "whether or not the client is still waiting")
    batch.add_argument("--batch-no-shuffle", action="store_true",
                       help="answer and list a batch's lines in input order")
    for name, what in (("line-500", "a batch line answered 500"),
                       ("line-400", "a batch line answered 400"),
                       ("create-500", "a batch create answered 500 after creating the batch"),
                       ("upload-500", "POST /v1/files answered 500 after storing the file"),
                       ("poll-429", "a GET of a batch route answered 429"),
                       ("poll-500", "a GET of a batch route answered 500")):
        batch.add_argument(f"--batch-p-{name}", type=float, default=0.0, metavar="P",
                           help=f"probability of {what}")
    batch.add_argument("--batch-token-limit", type=int, default=None, metavar="N",
                       help="OpenAI: enqueued prompt tokens per model; past it a batch fails "
                            "with token_limit_exceeded")
    batch.add_argument("--batch-clean-error-file-id", choices=("null", "empty", "absent"),
                       default="null",
                       help="OpenAI: error_file_id of a batch where no line failed")
    batch.add_argument("--batch-max-requests", type=int, default=None, metavar="N",
                       help="lines per OpenAI input file and requests per Anthropic batch "
                            "(default 50,000 and 100,000)")
    args = parser.parse_args(argv)

    faults = Faults(
        latency_s=args.latency, latency_jitter_s=args.jitter,
        p_429=args.p_429, retry_after_s=args.retry_after if args.retry_after >= 0 else None,
        p_500=args.p_500, p_503=args.p_503, p_reset=args.p_reset, p_hang=args.p_hang,
        p_bad_body=args.p_bad_body, p_truncated=args.p_truncated,
        status_override=args.status, burst_429_period_s=args.burst_period,
        burst_429_duration_s=args.burst_duration, rpm_limit=args.rpm, rpm_window_s=args.rpm_window,
        rpm_shape=args.rpm_shape, rpm_burst=args.rpm_burst, retry_after_integer=args.retry_after_integer,
        seed=args.seed, p_overloaded=args.p_overloaded, p_stream_drop=args.p_stream_drop,
        p_stream_error=args.p_stream_error, stream_chunk_delay_s=args.stream_chunk_delay,
        ratelimit_headers=not args.no_ratelimit_headers,
    )
    batch_faults = BatchFaults(
        turnaround_s=args.batch_turnaround, validating_s=args.batch_validating,
        finalizing_s=args.batch_finalizing, cancel_s=args.batch_cancel_delay,
        create_s=args.batch_create_delay,
        expire_after_s=args.batch_expire_after, shuffle=not args.batch_no_shuffle,
        p_line_500=args.batch_p_line_500, p_line_400=args.batch_p_line_400,
        p_create_500=args.batch_p_create_500, p_upload_500=args.batch_p_upload_500,
        p_poll_429=args.batch_p_poll_429, p_poll_500=args.batch_p_poll_500,
        enqueued_token_limit=args.batch_token_limit,
        clean_error_file_id=args.batch_clean_error_file_id, seed=args.seed,
    )
    if args.batch_max_requests is not None:
        batch_faults.max_file_requests = batch_faults.max_batch_requests = args.batch_max_requests
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    refusals = Refusals(models=frozenset(args.models.split(",")) if args.models else None)
    with FakeProviderServer(faults, port=args.port, log_path=args.log, api_key=args.api_key,
                            batch_faults=batch_faults, batch_state_dir=args.batch_state, refusals=refusals) as server:
        print(f"listening on {server.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
        served = len(server.log)
    print(f"stopped after {served} requests", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
