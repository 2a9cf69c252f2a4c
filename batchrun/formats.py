"""The names a job's modes and formats go by (``[run] mode``/``--mode``, ``--input-format``,
``--format``), in a module that loads nothing but the provider registry: the CLI builds its
choices from them at start-up, so ``batchrun --help`` does not load the spec parser or the
writers (bench/RESULTS.md: start-up).
"""

from __future__ import annotations

from batchrun.provider_registry import BATCH_FORMATS

MODES = ("online", "batch")  # [run] mode, --mode
INPUT_FORMATS = ("jsonl", "csv", "parquet")  # what batchrun.tabular reads
TABLE_FORMATS = ("csv", "parquet")  # the tables batchrun.export writes
FORMATS = ("results", *BATCH_FORMATS, *TABLE_FORMATS)  # ours, each provider batch API's line shape, tables
