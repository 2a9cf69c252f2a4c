"""Say why nothing connects (issue 17, item 3): refused, DNS and TLS errors are named on the
screen, in status and in the report, and a run that never had an answer gives up after
``[run] connect_grace`` with the items pending."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import run_cli
from .test_cli import SPEC, write_records

GRACE_SPEC = SPEC.replace("[run]", "[run]\nconnect_grace = 2")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def plain_text_port() -> Iterator[int]:
    """A port that answers every connection with plain text: a TLS client's handshake fails on it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\nnot TLS\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        done.set()
        thread.join()
        listener.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["refused", "tls"])
def test_a_run_that_cannot_connect_names_why_and_stops_after_connect_grace(
    tmp_path: Path, server: FakeProviderServer, plain_text_port: int, case: str
) -> None:
    base_url = {"refused": f"http://127.0.0.1:{closed_port()}/v1", "tls": f"https://127.0.0.1:{plain_text_port}/v1"}
    error_class, words = {"refused": ("connection_refused", "connection refused"),
                          "tls": ("tls", "TLS handshake failed")}[case]
    spec = tmp_path / "job.toml"
    spec.write_text(GRACE_SPEC.format(base_url=base_url[case]))
    records, db = write_records(tmp_path, 30), tmp_path / "l.db"
    started = time.monotonic()
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert proc.returncode == 75, proc.stderr
    assert time.monotonic() - started < 30  # 2 s of grace, not outage_seconds (300 s)
    assert f"nothing connected in 2 s ([run] connect_grace): {words}" in proc.stderr
    assert f"carry on with: batchrun resume 1 --db {db}" in proc.stderr
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    assert status["counts"]["pending"] == 30 and status["counts"]["failed"] == 0
    assert words in status["errors_by_class"][error_class]["example"]
    report = run_cli(tmp_path, "report", "1", "--db", str(db))
    assert error_class in report.stdout and words in report.stdout
    assert len(server.log) == 0


@pytest.mark.slow
def test_dns_failures_are_named(tmp_path: Path) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(GRACE_SPEC.format(base_url="http://no-such-host.invalid/v1"))
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 3)), "--db",
                   str(tmp_path / "l.db"))
    assert proc.returncode == 75, proc.stderr
    assert "host not found (DNS)" in proc.stderr
