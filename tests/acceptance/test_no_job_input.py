"""An input that makes no job (issue 17): every line rejected, or nothing at all, exits 2 with no job
created and nothing sent, and says why; ``--allow-empty`` accepts an empty input."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import run_cli

SPEC = """
name = "no-job"
[provider]
base_url = "{base_url}"
model = "m"
[request]
template = "Summarise {{review}} in one line"
max_tokens = 50
"""


def jobs_in(db: Path) -> int:
    if not db.exists():
        return 0
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("select count(*) from jobs").fetchone()[0])
    except sqlite3.OperationalError:  # no tables yet
        return 0
    finally:
        conn.close()


def submit(tmp_path: Path, server: FakeProviderServer, lines: list[bytes], *extra: str) -> tuple[int, str, str, Path]:
    spec, src, db = tmp_path / "job.toml", tmp_path / "in.jsonl", tmp_path / "l.db"
    spec.write_text(SPEC.format(base_url=server.base_url))
    src.write_bytes(b"".join(line + b"\n" for line in lines))
    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(src), "--db", str(db), *extra)
    return proc.returncode, proc.stdout, proc.stderr, db


def test_every_line_missing_the_template_field_exits_2_naming_it_with_a_guess(
    tmp_path: Path, server: FakeProviderServer
) -> None:
    lines = [orjson.dumps({"id": i, "reviews": f"good {i}"}) for i in range(30)] + [b"{broken"]
    code, stdout, stderr, db = submit(tmp_path, server, lines)
    assert code == 2, stderr
    assert "none of its 31 lines can be sent, so no job was created" in stderr
    assert "(30 of them), e.g. line 1: template field 'review' is missing from the record (did you mean 'reviews'?)" in stderr
    assert "Traceback" not in stderr and stdout == ""
    assert jobs_in(db) == 0 and len(server.log) == 0


def test_a_field_with_no_close_key_lists_the_keys_the_record_has(tmp_path: Path, server: FakeProviderServer) -> None:
    code, _, stderr, db = submit(tmp_path, server, [orjson.dumps({"id": 1, "body": "x", "stars": 4})])
    assert code == 2
    assert "template field 'review' is missing from the record (it has 'id', 'body', 'stars')" in stderr
    assert jobs_in(db) == 0 and len(server.log) == 0


@pytest.mark.slow
def test_every_line_bad_json_names_that(tmp_path: Path, server: FakeProviderServer) -> None:
    code, _, stderr, db = submit(tmp_path, server, [b"{nope", b"[1, 2]", b"{also nope"], "--strict")
    assert code == 2 and jobs_in(db) == 0 and len(server.log) == 0  # --strict refuses it, as always
    code, _, stderr, db = submit(tmp_path, server, [b"{nope", b"[1, 2]", b"{also nope"])
    assert code == 2, stderr
    assert "none of its 3 lines can be sent" in stderr and "(2 of them), e.g. line 1: not valid JSON" in stderr
    assert jobs_in(db) == 0 and len(server.log) == 0


def test_one_good_line_makes_a_job(tmp_path: Path, server: FakeProviderServer) -> None:
    lines = [orjson.dumps({"id": 1, "text": "x"}), orjson.dumps({"id": 2, "review": "fine"})]
    code, stdout, stderr, db = submit(tmp_path, server, lines)
    assert code == 1, stderr  # finished, one line rejected
    assert stdout.splitlines()[0] == "1" and jobs_in(db) == 1 and len(server.log) == 1


@pytest.mark.parametrize("strict", [False, True])
def test_an_empty_input_exits_2_unless_allowed(tmp_path: Path, server: FakeProviderServer, strict: bool) -> None:
    flags = ["--strict"] if strict else []
    code, _, stderr, db = submit(tmp_path, server, [], *flags)
    assert code == 2, stderr
    assert "the input is empty, so no job was created" in stderr and "--allow-empty" in stderr
    assert jobs_in(db) == 0 and len(server.log) == 0
    code, stdout, stderr, db = submit(tmp_path, server, [], "--allow-empty", "--json", *flags)
    assert code == 0, stderr
    result = orjson.loads(stdout)
    assert result["total"] == 0 and result["exit_code"] == 0
    assert jobs_in(db) == 1 and len(server.log) == 0


def test_allow_empty_is_in_the_help(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "submit", "--help")
    assert "--allow-empty" in proc.stdout and "empty input exits 2" in " ".join(proc.stdout.split())
