"""``python -m batchrun`` and the ``batchrun`` command."""

from __future__ import annotations


def main() -> None:
    """Run the command line, with the collector mostly idle while it starts.

    SIGINT/SIGTERM are held from here on (batchrun/interrupt.py): a signal during
    the imports, the spec or the ledger stops the command cleanly (exit 75) at
    its next clean point instead of killing it. The collector's start-up
    thresholds and the heap frozen for a run: batchrun/eventloop.py.
    """
    from batchrun import eventloop, interrupt

    interrupt.hold()
    eventloop.command_startup()
    from batchrun.cli import main as cli

    try:
        cli()
    finally:
        interrupt.ended()


if __name__ == "__main__":
    main()
