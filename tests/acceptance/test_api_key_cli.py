"""A missing API key variable is an error before anything is sent (issue 17, item 4)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import batchrun_cmd, cli_env, run_cli
from .test_cli import SPEC, write_records, write_spec


def run_without_key(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = cli_env(tmp_path)
    env.pop("OPENAI_API_KEY")
    return subprocess.run(batchrun_cmd(*args), capture_output=True, text=True, env=env, timeout=timeout, check=False)


@pytest.mark.slow
def test_submit_resume_and_check_refuse_a_missing_key_naming_it(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 5), tmp_path / "l.db"
    submitted = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert submitted.returncode == 2, submitted.stderr
    assert "OPENAI_API_KEY is not set" in submitted.stderr and "Traceback" not in submitted.stderr
    assert orjson.loads(run_cli(tmp_path, "list", "--json", "--db", str(db)).stdout) == []  # no job stored

    stored = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--no-run")
    assert stored.returncode == 0, stored.stderr
    resumed = run_without_key(tmp_path, "resume", "1", "--db", str(db))
    assert resumed.returncode == 2, resumed.stderr
    assert "OPENAI_API_KEY that job 1 reads is not set" in resumed.stderr

    checked = run_without_key(tmp_path, "check", str(spec), "--input", str(records))
    assert checked.returncode == 2 and "OPENAI_API_KEY is not set" in checked.stderr, checked.stderr
    assert len(server.log) == 0  # nothing was sent by any of them

    dry = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--dry-run")
    assert dry.returncode == 0, dry.stderr  # sends nothing: needs no key


@pytest.mark.slow
def test_an_empty_api_key_env_means_no_key(tmp_path: Path, server: FakeProviderServer) -> None:
    spec = write_spec(tmp_path, server, SPEC.replace('model = "m"', 'model = "m"\napi_key_env = ""'))
    records, db = write_records(tmp_path, 5), tmp_path / "l.db"
    proc = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    assert len(server.log) == 5
    assert run_without_key(tmp_path, "check", str(spec), "--input", str(records)).returncode == 0


@pytest.mark.slow
@pytest.mark.postgres
def test_a_worker_backs_off_a_job_whose_key_is_missing_naming_it(
    tmp_path: Path, server: FakeProviderServer, pg_url: str
) -> None:
    spec = write_spec(tmp_path, server, SPEC.replace('model = "m"', 'model = "m"\napi_key_env = "JOB_ONE_KEY"'))
    records = write_records(tmp_path, 3)
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", pg_url, "--no-run").returncode == 0
    worker = subprocess.Popen(batchrun_cmd("worker", "--db", pg_url, "--exit-when-idle", "--poll", "0.2"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path))
    time.sleep(3)
    worker.terminate()
    _, err = worker.communicate(timeout=60)
    assert "JOB_ONE_KEY that job 1 reads is not set" in err, err
    assert len(server.log) == 0
