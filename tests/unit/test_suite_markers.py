"""The README's fast subset (`pytest -m "not slow"`) leaves out exactly the slow campaigns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import SLOW_FILES

ROOT = Path(__file__).resolve().parents[2]


def collected(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_not_slow_leaves_out_the_slow_files_and_only_them() -> None:
    assert SLOW_FILES <= {p.relative_to(ROOT).as_posix() for p in ROOT.glob("tests/**/test_*.py")}  # no stale names
    fast, slow = collected("-m", "not slow"), collected("-m", "slow")
    assert slow == set(SLOW_FILES)
    assert not fast & slow and "tests/unit/test_suite_markers.py" in fast
