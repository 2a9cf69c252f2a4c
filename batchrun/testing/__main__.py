"""``python -m batchrun.testing serve ...``: the fake server in its own process."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from batchrun.testing.faults import Faults
from batchrun.testing.server import FakeProviderServer


def main(argv: list[str] | None = None) -> int:
    """``python -m batchrun.testing serve ...``: run the fake server until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.testing",
        description="Fault-injecting fake LLM server: OpenAI Chat Completions and Responses, "
                    "Anthropic Messages; plain and streamed.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve on 127.0.0.1 until SIGINT/SIGTERM")
    serve.add_argument("--port", type=int, default=8000, help="0 -> ephemeral")
    serve.add_argument("--latency", type=float, default=0.0, help="seconds added per request")
    serve.add_argument("--jitter", type=float, default=0.0, help="uniform extra 0..JITTER s")
    serve.add_argument("--rpm", type=int, default=None, help="sliding 60 s request limit")
    serve.add_argument("--rpm-window", type=float, default=60.0,
                       help="enforce --rpm over this sliding window in seconds, scaled (1: per second)")
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
    serve.add_argument("--seed", type=int, default=None)
    serve.add_argument("--log", default=None, help="append one JSON line per request here")
    args = parser.parse_args(argv)

    faults = Faults(
        latency_s=args.latency, latency_jitter_s=args.jitter,
        p_429=args.p_429, retry_after_s=args.retry_after if args.retry_after >= 0 else None,
        p_500=args.p_500, p_503=args.p_503, p_reset=args.p_reset, p_hang=args.p_hang,
        p_bad_body=args.p_bad_body, p_truncated=args.p_truncated,
        status_override=args.status, burst_429_period_s=args.burst_period,
        burst_429_duration_s=args.burst_duration, rpm_limit=args.rpm, rpm_window_s=args.rpm_window,
        seed=args.seed, p_overloaded=args.p_overloaded, p_stream_drop=args.p_stream_drop,
        p_stream_error=args.p_stream_error, stream_chunk_delay_s=args.stream_chunk_delay,
    )
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    with FakeProviderServer(faults, port=args.port, log_path=args.log, api_key=args.api_key) as server:
        print(f"listening on {server.base_url}", flush=True)
        while not stop.wait(0.5):
            pass
        served = len(server.log)
    print(f"stopped after {served} requests", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
