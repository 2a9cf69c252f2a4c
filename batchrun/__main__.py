"""``python -m batchrun`` and the ``batchrun`` command."""

from __future__ import annotations

import gc

# A command's imports make ~120,000 objects that live as long as the process; at the default
# threshold the cyclic collector walked them ~400 times on the way, ~10% of the start-up
# (bench/RESULTS.md). A run sets the defaults back once they are frozen (cli._run_loop).
STARTUP_GC_THRESHOLD = (50_000, 20, 20)


def main() -> None:
    """Run the command line, with the collector mostly idle while it starts.

    SIGINT/SIGTERM are held from here on (batchrun/interrupt.py): a signal during
    the imports, the spec or the ledger stops the command cleanly (exit 75) at
    its next clean point instead of killing it.
    """
    from batchrun import interrupt

    interrupt.hold()
    gc.set_threshold(*STARTUP_GC_THRESHOLD)
    from batchrun.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
