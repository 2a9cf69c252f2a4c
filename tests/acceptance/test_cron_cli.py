"""The README's crontab line works under cron's environment, and ``[provider] api_key_file``
(issue 17, item 12)."""

from __future__ import annotations

import re
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import batchrun_cmd, cli_env, run_cli
from .test_api_key_cli import run_without_key
from .test_cli import SPEC, write_records

README = Path(__file__).resolve().parents[2] / "README.md"
KEY = "sk-from-a-file-0123456789"


def readme_cron_line() -> str:
    """The command of the README's nightly crontab line (the one at 02:00)."""
    lines = re.findall(r"```cron\n(.*?)\n```", README.read_text(), flags=re.S)
    assert all(" /opt/batchrun/.venv/bin/batchrun " in entry for entry in lines), lines  # cron has no venv on PATH
    [line] = [entry for entry in lines if entry.startswith("0 2 ")]
    return line.split(None, 5)[5]  # minute hour day month weekday, then the command


def key_file_spec(folder: Path, server: FakeProviderServer, key_line: str = 'api_key_file = "openai.key"') -> Path:
    spec = folder / "triage.toml"
    spec.write_text(SPEC.format(base_url=server.base_url).replace('model = "m"', f'model = "m"\n{key_line}'))
    return spec


@pytest.mark.slow
def test_the_readme_cron_line_runs_under_crons_environment(tmp_path: Path) -> None:
    command = readme_cron_line()
    assert command.startswith("cd /data/jobs && /opt/batchrun/.venv/bin/batchrun submit "), command
    jobs, home = tmp_path / "jobs", tmp_path / "home"
    jobs.mkdir(), home.mkdir()
    venv_bin = Path(sys.executable).parent
    command = command.replace("/data/jobs", str(jobs)).replace("/opt/batchrun/.venv/bin", str(venv_bin))
    with FakeProviderServer(Faults(seed=3), api_key=KEY) as server:
        key_file_spec(jobs, server)
        (jobs / "openai.key").write_text(KEY + "\n")
        (jobs / "tickets.jsonl").write_bytes(write_records(tmp_path, 4).read_bytes())
        cron_env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={home}", "SHELL=/bin/sh", "LOGNAME=cron"]
        first = subprocess.run([*cron_env, "sh", "-c", command], capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, (jobs / "batchrun.log").read_text()
        assert first.stdout == first.stderr == ""  # all of it went to the log
        assert len(server.log) == 4  # sent with the key from the file (the server refuses any other)
        answers = [orjson.loads(line) for line in (jobs / "triage.jsonl").read_bytes().splitlines()]
        assert sorted((a["custom_id"], a["status"]) for a in answers) == [(f"r{i}", "succeeded") for i in range(4)]
        log = (jobs / "batchrun.log").read_text()
        assert KEY not in log

        again = subprocess.run([*cron_env, "sh", "-c", command], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, (jobs / "batchrun.log").read_text()
        assert len(server.log) == 4  # the same job, finished: nothing re-sent
    assert any(home.rglob("*.db"))  # the default ledger is under cron's HOME


@pytest.mark.slow
def test_api_key_file_missing_empty_or_both_exits_2_before_sending(tmp_path: Path) -> None:
    with FakeProviderServer(Faults(seed=3), api_key=KEY) as server:
        spec, records, db = key_file_spec(tmp_path, server), write_records(tmp_path, 3), tmp_path / "l.db"
        key = tmp_path / "openai.key"
        missing = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
        assert missing.returncode == 2, missing.stderr
        assert f"the API key file {key} does not exist; nothing was sent" in missing.stderr
        assert missing.stderr.startswith("batchrun: error: ") and "Traceback" not in missing.stderr

        key.write_text("  \n")
        empty = run_without_key(tmp_path, "check", str(spec), "--input", str(records))
        assert empty.returncode == 2 and f"{key} is empty" in empty.stderr, empty.stderr

        stored = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--no-run")
        assert stored.returncode == 0, stored.stderr
        resumed = run_without_key(tmp_path, "resume", "1", "--db", str(db))
        assert resumed.returncode == 2 and f"{key} that job 1 reads is empty" in resumed.stderr, resumed.stderr
        assert len(server.log) == 0

        key.write_text(KEY + "\n")
        done = run_without_key(tmp_path, "resume", "1", "--db", str(db))
        assert done.returncode == 0, done.stderr
        assert len(server.log) == 3
        assert KEY.encode() not in db.read_bytes()  # the job stores the file's path, never the key

        both = key_file_spec(tmp_path, server, 'api_key_file = "openai.key"\napi_key_env = "MY_KEY"')
        proc = run_cli(tmp_path, "check", str(both), "--input", str(records))
        assert proc.returncode == 2 and "api_key_file and api_key_env" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_key_file_from_a_windows_editor_works_and_a_pasted_key_is_never_printed(tmp_path: Path) -> None:
    with FakeProviderServer(Faults(seed=3), api_key=KEY) as server:
        spec, records = key_file_spec(tmp_path, server), write_records(tmp_path, 3)
        (tmp_path / "openai.key").write_bytes(b"\xef\xbb\xbf" + KEY.encode() + b"\r\n")  # BOM and CRLF
        proc = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "l.db"))
        assert proc.returncode == 0, proc.stderr
        assert len(server.log) == 3

        (tmp_path / "two.key").write_text(KEY + "\nsecond line\n")
        two = key_file_spec(tmp_path, server, 'api_key_file = "two.key"')
        split = run_without_key(tmp_path, "check", str(two), "--input", str(records))
        assert split.returncode == 2 and "does not hold one line of printable ASCII" in split.stderr, split.stderr
        assert "Traceback" not in split.stderr and KEY not in split.stderr

        pasted = key_file_spec(tmp_path, server, 'api_key_file = "sk-proj-ABCDEF0123456789secret"')
        refused = run_without_key(tmp_path, "check", str(pasted), "--input", str(records))
        assert refused.returncode == 2 and "looks like a key, not a file's path" in refused.stderr, refused.stderr
        assert "ABCDEF0123456789secret" not in refused.stderr
        assert len(server.log) == 3


@pytest.mark.slow
def test_moving_the_key_from_a_variable_to_a_file_carries_on_the_same_job(tmp_path: Path) -> None:
    """Written for cron, the spec reads its key from a file now: the job stored with a variable is
    found again (even one stored under an earlier version's hash), nothing is sent twice, and a later
    ``resume`` reads the file too."""
    with FakeProviderServer(Faults(seed=3), api_key=KEY) as server:
        records, db = write_records(tmp_path, 6), tmp_path / "l.db"
        spec = key_file_spec(tmp_path, server, 'api_key_env = "TEAM_KEY"')
        by_variable = {**cli_env(tmp_path), "TEAM_KEY": KEY}
        stored = subprocess.run(batchrun_cmd("submit", str(spec), "--input", str(records), "--db", str(db), "--no-run"),
                                capture_output=True, text=True, env=by_variable, timeout=60)
        assert stored.returncode == 0, stored.stderr
        with sqlite3.connect(db) as conn:  # as a job stored by a version whose hash counted the variable
            conn.execute("UPDATE jobs SET spec_hash = 'an-earlier-versions-hash'")
        key_file_spec(tmp_path, server)  # the same spec, the key from openai.key
        (tmp_path / "openai.key").write_text(KEY + "\n")
        carried = run_without_key(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
        assert carried.returncode == 0, carried.stderr
        assert len(server.log) == 6  # sent with the file's key (the server refuses any other)
        assert [job["job_id"] for job in orjson.loads(run_cli(tmp_path, "list", "--json", "--db", str(db)).stdout)] == [1]
        with sqlite3.connect(db) as conn:  # found by its stored spec once, then stored under the current hash
            assert conn.execute("SELECT spec_hash FROM jobs").fetchall() != [("an-earlier-versions-hash",)]
        again = run_without_key(tmp_path, "resume", "1", "--db", str(db))
        assert again.returncode == 0, again.stderr  # no TEAM_KEY here: the job reads the file now
        assert "TEAM_KEY" not in again.stderr and len(server.log) == 6


@pytest.mark.parametrize("raw", ["~/k/openai.key", "keys/openai.key"])
def test_api_key_file_is_resolved_home_or_spec_relative(tmp_path: Path, raw: str) -> None:
    from batchrun.spec import load_spec

    spec = tmp_path / "spec" / "job.toml"
    spec.parent.mkdir()
    spec.write_text(f'[provider]\nbase_url = "http://x/v1"\nmodel = "m"\napi_key_file = "{raw}"\n'
                    '[request]\ntemplate = "{text}"\n')
    loaded = load_spec(spec)
    expected = Path(raw).expanduser() if raw.startswith("~") else spec.parent / raw
    assert loaded.provider.api_key_file == str(expected.resolve())
    plain = spec.with_name("plain.toml")
    plain.write_text(spec.read_text().replace(f'api_key_file = "{raw}"\n', ""))
    assert load_spec(plain).identity_hash() == loaded.identity_hash()  # where the key is read from is not identity


@pytest.fixture
def silent_proxy() -> Iterator[str]:
    """A proxy address that accepts connections and never answers: a network that drops packets."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.mark.slow
@pytest.mark.parametrize("network", ["silent", "refused"])
def test_a_tiktoken_table_that_cannot_be_fetched_costs_one_short_line_and_no_long_wait(
    tmp_path: Path, silent_proxy: str, network: str
) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text('[provider]\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "gpt-4o-mini"\n'
                    '[request]\ntemplate = "Say {text}"\nmax_tokens = 5\n')
    records = write_records(tmp_path, 3)
    env = cli_env(tmp_path)  # no BATCHRUN_TIKTOKEN: tiktoken is on
    (tmp_path / "empty-cache").mkdir()
    proxy = silent_proxy if network == "silent" else "http://127.0.0.1:9"  # port 9: nothing listens
    env.update(TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"), HTTPS_PROXY=proxy, HTTP_PROXY=proxy)
    started = time.monotonic()
    proc = subprocess.run(batchrun_cmd("submit", str(spec), "--input", str(records), "--dry-run"),
                          capture_output=True, text=True, env=env, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert "estimated from request size" in proc.stdout
    [line] = proc.stderr.splitlines()
    assert "tiktoken's o200k_base table" in line and "BATCHRUN_TIKTOKEN=0" in line and len(line) < 220, line
    # The dry run waits 2 s for the table (it used to wait 10 s on a silent network);
    # start-up on a loaded machine takes a few more.
    assert elapsed < 8, elapsed


@pytest.mark.slow
@pytest.mark.postgres
def test_a_worker_backs_off_a_job_whose_key_file_is_missing_naming_it(tmp_path: Path, pg_url: str) -> None:
    with FakeProviderServer(Faults(seed=3), api_key=KEY) as server:
        spec, records = key_file_spec(tmp_path, server), write_records(tmp_path, 3)
        stored = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", pg_url, "--no-run")
        assert stored.returncode == 0, stored.stderr
        worker = subprocess.Popen(batchrun_cmd("worker", "--db", pg_url, "--exit-when-idle", "--poll", "0.2"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path))
        time.sleep(3)
        worker.terminate()
        _, err = worker.communicate(timeout=60)
        assert f"the API key file {tmp_path / 'openai.key'} that job 1 reads does not exist" in err, err
        assert len(server.log) == 0
