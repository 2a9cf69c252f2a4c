"""Helpers for running the real ``batchrun`` command as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchrun.testing import FakeProviderServer, Faults


def batchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchrun", *args]


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHRUN_")}
    env["HOME"] = str(tmp_path / "home")  # the default ledger location lands here, never in the real home
    env.pop("XDG_DATA_HOME", None)
    env["OPENAI_API_KEY"] = "sk-test-not-a-real-key"
    env["ANTHROPIC_API_KEY"] = "sk-ant-test-not-a-real-key"
    return env


def run_cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(batchrun_cmd(*args), capture_output=True, text=True, env=cli_env(tmp_path), timeout=timeout)


def start_cli(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        batchrun_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path)
    )


def wait_for_requests(server: FakeProviderServer, n: int, timeout: float = 30) -> None:
    """Until the server has logged ``n`` requests (or ``timeout`` seconds passed)."""
    deadline = time.monotonic() + timeout
    while len(server.log) < n and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=3), record_bodies=True) as srv:
        yield srv
