"""The README's Python example runs as printed: its code block, run in a fresh interpreter, prints
exactly the block shown after it, so neither can drift from the library."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def example() -> tuple[str, str]:
    """The ``python`` block of the README's "Python API" section and the ``text`` block it says it prints."""
    section = README.read_text(encoding="utf-8").split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(?P<code>.*?)```\s*It prints:\s*```text\n(?P<out>.*?)```", section, re.S)
    assert found, "README: the Python API section has no python block followed by what it prints"
    return found["code"], found["out"]


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHRUN_") and k != "OPENAI_API_KEY"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_the_readme_python_example_prints_what_the_readme_says(tmp_path: Path) -> None:
    code, expected = example()
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected
    assert proc.stderr == ""  # no warning either (the model's schema fits OpenAI strict mode)


def test_the_readme_python_example_runs_in_a_notebook_cell(tmp_path: Path) -> None:
    """As a Jupyter cell runs it: inside a running event loop, its classes in a namespace of their own."""
    code, expected = example()
    cell = (
        "import asyncio, signal\n"
        "async def cell():\n"
        "    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)\n"
        f"    exec(compile({code!r}, '<cell>', 'exec'), {{'__name__': '__main__'}})\n"
        "    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before\n"
        "asyncio.run(cell())\n"
    )
    proc = run_python(cell, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected
