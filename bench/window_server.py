"""Stand-in for a per-second request limit, which the fake server has no option for yet.

``batchrun.testing`` enforces ``--rpm N`` over a sliding window whose length is the module
constant ``_RPM_WINDOW_S`` (60 s). This wrapper changes that constant before starting the
server, so ``--window 1 serve --rpm 50`` enforces 50 requests per sliding second (3,000/min
enforced per second). The ``x-ratelimit-limit-requests`` header then says 50, and
Retry-After is the time until a slot of the 1 s window frees.

    .venv/bin/python bench/window_server.py --window 1 serve --port 0 --rpm 50 --log log.jsonl

Used only by ``bench/run.py t3s``; drop it once the server has a real per-second option.
"""

from __future__ import annotations

import sys

import batchrun.testing as testing


def main() -> int:
    argv = sys.argv[1:]
    window = 60.0
    if len(argv) >= 2 and argv[0] == "--window":
        window = float(argv[1])
        argv = argv[2:]
    if not hasattr(testing, "_RPM_WINDOW_S"):
        print("batchrun.testing has no _RPM_WINDOW_S any more: update bench/window_server.py",
              file=sys.stderr)
        return 2
    testing._RPM_WINDOW_S = window  # read by FakeOpenAIServer._rpm_take at each request
    return testing.main(argv)


if __name__ == "__main__":
    sys.exit(main())
