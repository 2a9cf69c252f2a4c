"""The command line as a user meets it: exit codes, messages, no tracebacks."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Faults

from .conftest import run_cli, start_cli

SPEC = """
name = "cli-test"
[provider]
base_url = "{base_url}"
model = "m"
[request]
template = "Say {{text}}"
max_tokens = 50
[run]
concurrency = 4
"""


def write_spec(tmp_path: Path, server: FakeProviderServer, text: str = SPEC) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text.format(base_url=server.base_url))
    return path


def write_records(tmp_path: Path, n: int, extra: list[bytes] | None = None) -> Path:
    path = tmp_path / "records.jsonl"
    lines = [orjson.dumps({"id": f"r{i}", "text": f"hello {i}"}) for i in range(n)] + (extra or [])
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.slow
def test_submit_status_list_export(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 20, [b"{broken"]), tmp_path / "l.db"
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out), "--errors", str(errors))
    assert proc.returncode == 1, proc.stderr  # one rejected line
    assert proc.stdout.splitlines()[0] == "1"
    assert f"{records}:21: not valid JSON" in proc.stderr
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert len(lines) == 21
    assert lines[0] == {
        "custom_id": "r0", "status": "succeeded", "output": "echo: Say hello 0",
        "usage": {"input_tokens": lines[0]["usage"]["input_tokens"], "output_tokens": lines[0]["usage"]["output_tokens"]},
        "attempts": 1, "latency_ms": lines[0]["latency_ms"], "error": None,
    }
    assert lines[20]["status"] == "rejected" and lines[20]["error"]["line"] == 21
    err_lines = [orjson.loads(x) for x in errors.read_bytes().splitlines()]
    assert [(e["custom_id"], e["line"], e["error_class"]) for e in err_lines] == [("21", 21, "invalid_json")]

    status = run_cli(tmp_path, "status", "1", "--db", str(db), "--json")
    data = orjson.loads(status.stdout)
    assert data["job_id"] == 1 and data["total"] == 21
    assert data["counts"] == {"pending": 0, "running": 0, "submitted": 0, "succeeded": 20, "failed": 0, "invalid_output": 0, "rejected": 1, "cancelled": 0}
    assert data["requests"] == 20 == len(server.log)
    assert data["tokens"]["input"] == sum(r.prompt_tokens for r in server.log)
    assert data["tokens"]["output"] == sum(r.completion_tokens for r in server.log)
    assert data["latency_ms"]["p50"] > 0

    text = run_cli(tmp_path, "status", "--db", str(db))
    assert "succeeded 20" in text.stdout and "p50" in text.stdout

    listed = orjson.loads(run_cli(tmp_path, "list", "--json", "--db", str(db)).stdout)
    assert [(j["job_id"], j["name"], j["total"]) for j in listed] == [(1, "cli-test", 21)]

    batch = tmp_path / "batch.jsonl"
    assert run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(batch), "--format", "openai-batch").returncode == 0
    first = orjson.loads(batch.read_bytes().splitlines()[0])
    assert first["custom_id"] == "r0" and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "echo: Say hello 0"
    last = orjson.loads(batch.read_bytes().splitlines()[-1])
    assert last["response"] is None and last["error"]["code"] == "invalid_json"


@pytest.mark.slow
def test_resubmit_is_idempotent(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 10), tmp_path / "l.db"
    first = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--json")
    assert first.returncode == 0, first.stderr
    data = orjson.loads(first.stdout)
    assert data["job_id"] == 1 and data["total"] == 10 and data["counts"]["succeeded"] == 10
    again = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert again.returncode == 0 and again.stdout.splitlines()[0] == "1"
    assert "carrying on job 1" in again.stderr
    assert len(server.log) == 10  # nothing was sent twice
    forced = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--new")
    assert forced.stdout.splitlines()[0] == "2" and len(server.log) == 10  # a new job; the answers are reused
    fresh = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--new", "--no-cache")
    assert fresh.stdout.splitlines()[0] == "3" and len(server.log) == 20


@pytest.mark.slow
def test_export_never_clobbers_a_foreign_file(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 3), tmp_path / "l.db"
    out = tmp_path / "precious.jsonl"
    out.write_text("my own data\n")
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--output", str(out))
    assert proc.returncode == 2 and "already exists and is not an earlier export of job 1" in proc.stderr
    assert out.read_text() == "my own data\n"
    assert len(server.log) == 0  # refused before anything was sent
    mine = tmp_path / "mine.jsonl"
    assert run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(mine)).returncode == 0
    # This job's own earlier export may be replaced; a foreign file needs --force.
    assert run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(mine)).returncode == 0
    refused = run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(out))
    assert refused.returncode == 2 and out.read_text() == "my own data\n"
    assert run_cli(tmp_path, "export", "1", "--db", str(db), "--output", str(out), "--force").returncode == 0
    assert len(out.read_bytes().splitlines()) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["submit", "nope.toml", "--input", "x.jsonl"], "nope.toml: no such spec file"),
        (["submit", "--input", "x.jsonl"], "--base-url is required"),
        (["submit", "--input", "missing.jsonl", "--base-url", "http://127.0.0.1:9/v1"], "missing.jsonl: no such input file"),
        (["resume", "42"], "no ledger at"),
        (["status", "7"], "no ledger at"),
        (["retry", "1", "--state", "succeeded"], "only failed, invalid_output, cancelled can be retried"),
        (["submit", "--input", "x.jsonl", "--base-url", "http://127.0.0.1:9/v1", "--db", "postgresql+psycopg://u:pw@127.0.0.1:1/x"],
         "cannot open ledger postgresql+psycopg://u:***@127.0.0.1:1/x"),
    ],
)
def test_usage_errors_exit_2_without_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "x.jsonl").write_text("{}\n")
    proc = run_cli(tmp_path, *[a if not a.endswith((".toml", ".jsonl")) else str(tmp_path / a) for a in args])
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_spec_names_file_and_key(tmp_path: Path, server: FakeProviderServer) -> None:
    spec = write_spec(tmp_path, server, SPEC.replace("concurrency = 4", "concurrency = 'lots'"))
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 1)), "--db", str(tmp_path / "l.db"))
    assert proc.returncode == 2
    assert f"{spec}: [run] concurrency = 'lots': expected an integer" in proc.stderr


def test_strict_refuses_bad_input_and_sends_nothing(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db = write_spec(tmp_path, server), tmp_path / "l.db"
    records = write_records(tmp_path, 5, [b'{"id": "x"}'])
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--strict")
    assert proc.returncode == 2
    assert f"{records}:6: template field 'text' is missing" in proc.stderr
    assert len(server.log) == 0
    assert orjson.loads(run_cli(tmp_path, "list", "--json", "--db", str(db)).stdout) == []


def test_auth_refused_exits_3(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(status_override=401)
    spec, records = write_spec(tmp_path, server), write_records(tmp_path, 50)
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "l.db"))
    assert proc.returncode == 3
    assert "authentication refused" in proc.stderr
    assert "sk-test-not-a-real-key" not in proc.stderr + proc.stdout
    assert len(server.log) <= 4


@pytest.mark.slow
def test_second_runner_exits_75_naming_the_holder(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.2)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 300), tmp_path / "l.db"
    first = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--quiet")
    deadline = time.monotonic() + 30
    while not server.log and time.monotonic() < deadline:
        time.sleep(0.02)
    second = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert second.returncode == 75
    assert "is being worked by run" in second.stderr and f"pid {first.pid}" in second.stderr
    overlapping = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db))
    assert overlapping.returncode == 75 and "is being worked by run" in overlapping.stderr
    for proc in (second, overlapping):  # the lock message only: no progress line of a run that never ran
        assert "done " not in proc.stderr, proc.stderr
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=30)
    assert first.returncode == 75
    finish = run_cli(tmp_path, "resume", "1", "--db", str(db), "--concurrency", "64")
    assert finish.returncode == 0, finish.stderr
    assert set(server.requests_by_key().values()) == {1}


@pytest.mark.slow
def test_retry_and_cancel(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(status_override=500)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 4), tmp_path / "l.db"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--max-attempts", "2")
    assert proc.returncode == 1
    assert len(server.log) == 8
    server.faults = Faults()
    retried = run_cli(tmp_path, "retry", "1", "--db", str(db), "--where", "error_class=server_error")
    assert retried.returncode == 0 and "4 items of job 1 back to pending" in retried.stdout
    assert run_cli(tmp_path, "resume", "1", "--db", str(db)).returncode == 0
    assert len(server.log) == 12
    bad_where = run_cli(tmp_path, "retry", "1", "--db", str(db), "--where", "prompt=x")
    assert bad_where.returncode == 2 and "KEY one of" in bad_where.stderr



@pytest.mark.slow
def test_cancel_leaves_finished_items_and_sends_nothing_more(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.1)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 200), tmp_path / "l.db"
    first = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--quiet")
    deadline = time.monotonic() + 30
    while len(server.log) < 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=30)
    assert first.returncode == 75
    before = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)["counts"]
    assert before["pending"] > 0 and before["succeeded"] > 0
    cancelled = run_cli(tmp_path, "cancel", "1", "--db", str(db))
    assert cancelled.returncode == 0 and f"{before['pending']} items of job 1 cancelled" in cancelled.stdout
    sent = len(server.log)
    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db))
    assert resumed.returncode == 1  # finished, but not every item succeeded
    assert len(server.log) == sent
    after = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)["counts"]
    assert after["cancelled"] == before["pending"] and after["succeeded"] == before["succeeded"]


def test_help_lists_every_command(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "--help")
    for command in ("submit", "resume", "status", "export", "list", "retry", "cancel", "demo", "db"):
        assert command in proc.stdout


def test_demo_runs_the_bundled_job(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "demo", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "1"
    output_line = next(line for line in proc.stdout.splitlines() if line.startswith("output: "))
    path = Path(output_line.removeprefix("output: ").split(" (")[0])
    assert path.is_file() and str(path).startswith(str(tmp_path / "home"))
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert len(lines) == 200 and {x["status"] for x in lines} == {"succeeded"}
    assert (tmp_path / "home" / ".local" / "share" / "batchrun" / "ledger.db").is_file()


TRIAGE_LIKE = """
[provider]
base_url = "{base_url}"
model = "m"
[request]
template = "Say {{text}}"
max_tokens = {max_tokens}
[output]
schema = "s.json"
validation_retries = 0
"""


@pytest.mark.slow
def test_structured_retry_with_more_tokens_and_revalidate(tmp_path: Path, server: FakeProviderServer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
    (tmp_path / "s.json").write_bytes(orjson.dumps(schema))
    spec = tmp_path / "job.toml"
    spec.write_text(TRIAGE_LIKE.format(base_url=server.base_url, max_tokens=2))
    records, db = write_records(tmp_path, 4), tmp_path / "l.db"
    first = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--json")
    assert first.returncode == 1
    assert orjson.loads(first.stdout)["counts"]["invalid_output"] == 4
    status = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)
    assert status["errors"] == {"truncated": 4}
    retried = run_cli(tmp_path, "retry", "1", "--db", str(db), "--where", "error_class=truncated", "--max-tokens", "300")
    assert "4 items of job 1 back to pending" in retried.stdout
    out = tmp_path / "out.jsonl"
    resumed = run_cli(tmp_path, "resume", "1", "--db", str(db), "--output", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert server.bodies[-1]["max_tokens"] == 300 and server.bodies[0]["max_tokens"] == 2
    first_line = orjson.loads(out.read_bytes().splitlines()[0])
    assert first_line["output"] == {"a": "echo: Say hello 0"}

    stricter = tmp_path / "stricter.json"
    stricter.write_bytes(orjson.dumps({**schema, "properties": {"a": {"type": "string", "maxLength": 3}}}))
    sent = len(server.log)
    reval = run_cli(tmp_path, "revalidate", "1", "--db", str(db), "--schema", str(stricter))
    assert reval.returncode == 0, reval.stderr
    assert "checked 4: 0 now succeeded, 4 now invalid_output" in reval.stdout
    back = run_cli(tmp_path, "revalidate", "1", "--db", str(db), "--json")
    assert orjson.loads(back.stdout)["to_succeeded"] == ["r0", "r1", "r2", "r3"]
    assert len(server.log) == sent
    bad = run_cli(tmp_path, "revalidate", "1", "--db", str(db), "--schema", str(records))
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr


def test_bad_schema_in_spec_is_refused_before_sending(tmp_path: Path, server: FakeProviderServer) -> None:
    (tmp_path / "s.json").write_text('{"type": "object", "properties": {"a": {"type": "strin"}}}')
    spec = tmp_path / "job.toml"
    spec.write_text(TRIAGE_LIKE.format(base_url=server.base_url, max_tokens=5))
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 2)), "--db", str(tmp_path / "l.db"))
    assert proc.returncode == 2
    assert f"{tmp_path / 's.json'}: not a valid JSON Schema (draft 2020-12): schema.properties.a.type" in proc.stderr
    assert len(server.log) == 0


def test_non_strict_schema_warns(tmp_path: Path, server: FakeProviderServer) -> None:
    (tmp_path / "s.json").write_text('{"type": "object", "properties": {"a": {"type": "string"}}}')
    spec = tmp_path / "job.toml"
    spec.write_text(TRIAGE_LIKE.format(base_url=server.base_url, max_tokens=50))
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 2)), "--db", str(tmp_path / "l.db"))
    assert proc.returncode == 0, proc.stderr
    assert "strict = false (schema: objects need additionalProperties = false)" in proc.stderr
    assert server.bodies[0]["response_format"]["json_schema"]["strict"] is False


@pytest.mark.slow
def test_demo_triage(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "demo", "--job", "triage", timeout=180)
    assert proc.returncode in (0, 1), proc.stderr
    output_line = next(line for line in proc.stdout.splitlines() if line.startswith("output: "))
    path = Path(output_line.removeprefix("output: ").split(" (")[0])
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert len(lines) == 50
    for line in lines:
        if line["status"] == "succeeded":
            assert line["output"]["category"] in ("billing", "bug", "account", "feature_request", "shipping", "other")
        else:
            assert line["status"] == "invalid_output" and line["error"]["class"] in ("truncated", "schema_invalid")


@pytest.mark.slow
def test_max_runtime_stops_cleanly_with_exit_75(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(latency_s=0.1)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 200), tmp_path / "l.db"
    started = time.monotonic()
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--max-runtime", "2s")
    assert proc.returncode == 75, proc.stderr
    assert time.monotonic() - started < 15
    assert "--max-runtime of 2 s reached" in proc.stderr and "batchrun resume 1" in proc.stderr
    counts = orjson.loads(run_cli(tmp_path, "status", "1", "--json", "--db", str(db)).stdout)["counts"]
    assert counts["running"] == 0 and 0 < counts["succeeded"] < 200
    bad = run_cli(tmp_path, "resume", "1", "--db", str(db), "--max-runtime", "soon")
    assert bad.returncode == 2 and "'soon' is not a duration" in bad.stderr
    done = run_cli(tmp_path, "resume", "1", "--db", str(db), "--concurrency", "64")
    assert done.returncode == 0
    assert set(server.requests_by_key().values()) == {1}


@pytest.mark.slow
def test_resume_finishes_an_interrupted_ingest(tmp_path: Path, server: FakeProviderServer) -> None:
    from batchrun.input_hash import hash_input
    from batchrun.ledger import Ledger
    from batchrun.spec import load_spec

    spec_path, records, db = write_spec(tmp_path, server), write_records(tmp_path, 30), tmp_path / "l.db"
    spec = load_spec(spec_path)
    with Ledger.open(db) as ledger:  # a submit killed after its first ingest batch
        job_id = ledger.create_job(spec, input_path=str(records), input_hash=hash_input(records))
        ledger.insert_items(
            job_id,
            [{"line": i, "custom_id": f"r{i - 1}", "url": None, "body": orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": f"Say hello {i - 1}"}], "max_tokens": 50}
            ).decode(), "state": "pending"} for i in range(1, 11)],
        )
    out = tmp_path / "out.jsonl"
    proc = run_cli(tmp_path, "resume", str(job_id), "--db", str(db), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_bytes().splitlines()) == 30
    assert len(server.log) == 30

    with Ledger.open(db) as ledger:
        job2 = ledger.create_job(spec, input_path=str(records), input_hash="not-this-content")
    changed = run_cli(tmp_path, "resume", str(job2), "--db", str(db))
    assert changed.returncode == 2
    assert "was interrupted while reading its input" in changed.stderr


def test_sigterm_during_a_long_retry_after_exits_at_once(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(p_429=1.0, retry_after_s=120)
    spec, records, db = write_spec(tmp_path, server), write_records(tmp_path, 20), tmp_path / "l.db"
    proc = start_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--quiet")
    deadline = time.monotonic() + 30
    while not server.log and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 75
    assert time.monotonic() - started < 10  # the shared pause is interrupted, not waited out


def test_errors_target_is_checked_before_sending(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records = write_spec(tmp_path, server), write_records(tmp_path, 5)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "l.db"),
                   "--output", str(tmp_path / "o.jsonl"), "--errors", str(precious))
    assert proc.returncode == 2 and "precious.txt already exists" in proc.stderr
    assert len(server.log) == 0 and precious.read_text() == "keep me\n"


@pytest.mark.slow
def test_sigterm_while_reading_a_big_input_exits_75_and_carries_on(tmp_path: Path) -> None:
    src = tmp_path / "big.jsonl"
    with open(src, "wb") as f:
        for i in range(300_000):
            f.write(orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "m", "messages": [{"role": "user", "content": f"x{i}"}]}}) + b"\n")
    db = tmp_path / "l.db"
    args = ("submit", "--input", str(src), "--base-url", "http://127.0.0.1:9/v1", "--db", str(db), "--quiet")
    proc = start_cli(tmp_path, *args)
    deadline = time.monotonic() + 60
    import sqlite3

    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(db) as conn:
                if conn.execute("select count(*) from items").fetchone()[0] > 0:
                    break
        except sqlite3.OperationalError:
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    # The run sends while the input is read: the signal stops both, and says how to carry on.
    assert "carry on with: batchrun resume 1" in stderr and "Traceback" not in stderr
    with sqlite3.connect(db) as conn:
        stored = conn.execute("select count(*) from items").fetchone()[0]
        done = conn.execute("select ingest_done from jobs").fetchone()[0]
    assert proc.returncode == 75, stderr
    assert stored < 300_000 and not done
    again = run_cli(tmp_path, *args, "--no-run")  # carries on reading from the last stored line, to the end
    assert again.returncode == 0, again.stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("select count(*), count(distinct custom_id) from items").fetchone() == (300_000, 300_000)
        assert conn.execute("select ingest_done, count(*) from jobs").fetchone() == (1, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["db", "upgrade", "--db", "/etc/passwd/x.db"], "cannot open ledger"),
        (["status", "--db", "/etc/passwd/x.db"], "no ledger at /etc/passwd/x.db"),
        (["submit", "--input", "x.jsonl", "--base-url", "http://[::1/v1"], "not a valid URL"),
        (["submit", "--input", "x.jsonl", "--base-url", "http://127.0.0.1:99999/v1"], "port 99999 is out of range"),
    ],
)
def test_bad_paths_and_urls_exit_2_without_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "x.jsonl").write_text("{}\n")
    proc = run_cli(tmp_path, *[str(tmp_path / a) if a.endswith(".jsonl") else a for a in args])
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_non_finite_spec_numbers_are_refused(tmp_path: Path, server: FakeProviderServer) -> None:
    spec = write_spec(tmp_path, server, SPEC.replace("concurrency = 4", "concurrency = 4\nlease_seconds = nan"))
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 1)), "--db", str(tmp_path / "l.db"))
    assert proc.returncode == 2 and "[run] lease_seconds = nan: expected a finite number" in proc.stderr


@pytest.mark.slow
def test_log_file_gets_json_lines_with_progress_records(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(seed=2, latency_s=0.02, p_500=0.1)
    spec, records, db, log_file = write_spec(tmp_path, server), write_records(tmp_path, 60), tmp_path / "l.db", tmp_path / "run.jsonl"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--quiet",
                   "--log-file", str(log_file), "--progress-interval", "0.2")
    assert proc.returncode == 0, proc.stderr
    assert "done " not in proc.stderr  # --quiet: no progress on stderr, only in the file
    entries = [orjson.loads(line) for line in log_file.read_bytes().splitlines()]
    progress = [e["progress"] for e in entries if e["logger"] == "batchrun.progress"]
    assert len(progress) >= 2
    assert all({"done", "todo", "rate_per_s", "eta_s", "in_flight", "concurrency_now", "cost_usd", "errors"} <= set(p)
               for p in progress)
    final = progress[-1]
    assert (final["done"], final["todo"], final["succeeded"]) == (60, 60, 60)
    assert final["errors"].get("server_error", 0) == sum(1 for r in server.log if r.outcome == "500")
    assert final["requests"] == len(server.log)
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in entries)
    runs = [e["run"] for e in entries if "run" in e]  # the invocation's first and last records
    assert entries[0]["message"] == "run_started" and runs[0]["command"] == "submit"
    assert entries[-1]["message"] == "run_ended" and runs[-1] == {"event": "run_ended", "exit_code": 0, "pid": runs[0]["pid"]}
    # a second run appends to the same file; a new job over the same input is answered from the cache
    again = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--new",
                    "--log-file", str(log_file), "--progress-interval", "0.2")
    assert again.returncode == 0, again.stderr
    later = [orjson.loads(line) for line in log_file.read_bytes().splitlines()][len(entries):]
    last = [e["progress"] for e in later if e["logger"] == "batchrun.progress"][-1]
    assert (last["done"], last["succeeded"], last["cached"], last["requests"]) == (60, 60, 60, 0)
    assert "(reused 60)" in again.stderr  # the progress line on stderr says so too


@pytest.mark.slow
def test_log_file_run_ended_carries_the_exit_code(tmp_path: Path, server: FakeProviderServer) -> None:
    server.faults = Faults(seed=3, latency_s=0.05)
    spec, records, log_file = write_spec(tmp_path, server), write_records(tmp_path, 400), tmp_path / "run.jsonl"
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "l.db"), "--quiet",
                   "--log-file", str(log_file), "--max-runtime", "1s")
    assert proc.returncode == 75, proc.stderr  # stopped at its deadline with work left
    entries = [orjson.loads(line) for line in log_file.read_bytes().splitlines()]
    assert [e["message"] for e in entries if "run" in e] == ["run_started", "run_ended"]
    assert entries[-1]["run"]["exit_code"] == 75


def test_log_file_that_cannot_be_opened_is_a_usage_error(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, records = write_spec(tmp_path, server), write_records(tmp_path, 3)
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(tmp_path / "l.db"),
                   "--log-file", str(tmp_path / "no" / "such" / "dir.jsonl"))
    assert proc.returncode == 2 and "--log-file" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "l.db").exists() and server.log == []  # refused before anything was done


@pytest.mark.slow
def test_list_has_a_header_with_created_time_model_input_and_state(tmp_path: Path, server: FakeProviderServer) -> None:
    spec, db = write_spec(tmp_path, server), tmp_path / "l.db"
    records = write_records(tmp_path, 3)
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db)).returncode == 0
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--new",
                   "--no-run").returncode == 0
    header, first, second = run_cli(tmp_path, "list", "--db", str(db)).stdout.splitlines()
    assert header.split()[:4] == ["ID", "CREATED", "MODEL", "STATE"] and "NAME/INPUT" in header
    assert first.split()[:6] == ["1", time.strftime("%Y-%m-%d"), first.split()[2], "m", "done", "3"]
    assert second.split()[3:6] == ["m", "work", "left"]
    listed = orjson.loads(run_cli(tmp_path, "list", "--db", str(db), "--json").stdout)
    assert [(j["model"], j["state"], j["input"]) for j in listed] == [("m", "done", str(records)),
                                                                      ("m", "work left", str(records))]
    assert all(abs(j["created_at"] - time.time()) < 600 for j in listed)
