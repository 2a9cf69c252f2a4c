"""Issue 17, item 9: ``-v``/``-q`` after the subcommand parsed by click (a value that reads ``-q`` stays a
value), and a second Ctrl-C at different moments of a submit exits 75 without a traceback."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import batchrun_cmd, cli_env, run_cli, start_cli, wait_for_requests
from .test_cli import write_records, write_spec


def test_an_option_value_that_reads_like_v_or_q_stays_the_options_value(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    db = tmp_path / "l.db"
    spec, records = write_spec(tmp_path, server), write_records(tmp_path, 3)
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "-q").returncode == 0
    out = subprocess.run(batchrun_cmd("export", "1", "--db", str(db), "--output", "-v", "--errors", "-q"),
                         capture_output=True, text=True, env=cli_env(tmp_path), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "-v").read_text().splitlines()) == 3 and (tmp_path / "-q").exists()
    quiet = run_cli(tmp_path, "status", "1", "--db", str(db), "-q", "-v")  # still the group's flags after it
    assert quiet.returncode == 0, quiet.stderr


@pytest.mark.slow
@pytest.mark.parametrize("after_requests,gap", [(0, 0.0), (5, 0.0), (20, 0.05), (40, 0.5)])
def test_a_second_sigint_at_any_moment_exits_75_without_a_traceback(
    tmp_path: Path, after_requests: int, gap: float
) -> None:
    with FakeProviderServer(Faults(seed=5, latency_s=2.0)) as slow:  # requests in flight when signalled
        spec, records = write_spec(tmp_path, slow), write_records(tmp_path, 400)
        proc = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "l.db"),
                         "--concurrency", "32", "--output", str(tmp_path / "out.jsonl"))
        if after_requests:
            wait_for_requests(slow, after_requests)
        else:
            time.sleep(0.3)  # still starting up or ingesting
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "Traceback" not in err, err
