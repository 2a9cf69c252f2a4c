"""The README's fast subset (`pytest -m "not slow"`) and the slow rest split the suite between them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from tests.conftest import SLOW_FILES

ROOT = Path(__file__).resolve().parents[2]

# One collection of the whole suite in a new interpreter; prints {test id: whether it is slow}.
COLLECT = """
import sys, orjson, pytest
class Marks:
    found = {}
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        self.found.update((item.nodeid, item.get_closest_marker("slow") is not None) for item in items)
plugin = Marks()
code = pytest.main(["-q", "-p", "no:cacheprovider", "--collect-only", "-m", ""], plugins=[plugin])  # whatever PYTEST_ADDOPTS says
sys.stdout.flush()
sys.stdout.buffer.write(b"\\nMARKS " + orjson.dumps(plugin.found))
sys.exit(int(code))
"""


def test_the_fast_subset_and_the_slow_rest_split_the_suite() -> None:
    assert SLOW_FILES <= {p.relative_to(ROOT).as_posix() for p in ROOT.glob("tests/**/test_*.py")}  # no stale names
    proc = subprocess.run([sys.executable, "-c", COLLECT], capture_output=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    marks: dict[str, bool] = orjson.loads(proc.stdout.rsplit(b"\nMARKS ", 1)[1])
    fast = {test for test, slow in marks.items() if not slow}
    slow = set(marks) - fast
    assert fast and slow
    assert {test.split("::")[0] for test in slow} >= SLOW_FILES
    assert not {test.split("::")[0] for test in fast} & SLOW_FILES  # a slow file is slow as a whole
    # the fast subset still tries every kind of test, the README's two promises and this check itself
    for folder in ("unit", "integration", "acceptance"):
        assert any(test.startswith(f"tests/{folder}/") for test in fast), folder
    assert "tests/acceptance/test_cli.py::test_demo_runs_the_bundled_job" in fast
    assert "tests/integration/test_readme.py::test_the_readme_python_example_prints_what_the_readme_says" in fast
    assert "tests/unit/test_suite_markers.py::test_the_fast_subset_and_the_slow_rest_split_the_suite" in fast
