"""``batchrun show`` as a user meets it: a failed item's request, attempts and error; --where, --limit, --json."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer, Refusals

from .conftest import batchrun_cmd, cli_env, run_cli
from .test_cli import write_records, write_spec


@pytest.mark.slow
def test_show_a_failed_item_and_browse_by_state(tmp_path: Path) -> None:
    db = tmp_path / "l.db"
    with FakeProviderServer(refusals=Refusals(over_context="")) as server:  # every request refused: permanent
        spec = write_spec(tmp_path, server)
        proc = run_cli(tmp_path, "submit", str(spec), "--input", str(write_records(tmp_path, 4, [b"[1]"])),
                       "--db", str(db))
    assert proc.returncode == 1, proc.stderr

    shown = run_cli(tmp_path, "show", "1", "r2", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "# r2  (job 1, line 3): failed, 1 request"
    assert f"POST {server.base_url}/chat/completions" in lines
    assert '      "content": "Say hello 2"' in lines
    assert any(line.startswith("  1  ") and "  400  context_length" in line for line in lines), shown.stdout
    assert "## Error" in lines and any(line.startswith("context_length (HTTP 400): ") for line in lines)

    failed = run_cli(tmp_path, "show", "1", "--where", "state=failed", "--limit", "2", "--json", "--db", str(db))
    items = [orjson.loads(line) for line in failed.stdout.splitlines()]
    assert failed.returncode == 0 and [i["custom_id"] for i in items] == ["r0", "r1"]
    assert items[0]["request"]["body"]["messages"] == [{"role": "user", "content": "Say hello 0"}]
    assert items[0]["attempt_log"][0]["status_code"] == 400 and items[0]["error"]["status_code"] == 400
    jq = subprocess.run(
        ["sh", "-c", " ".join(batchrun_cmd("show", "1", "--where", "state=rejected", "--json", "--db", str(db)))
         + " | jq -r '.custom_id + \" \" + .error.class'"],
        capture_output=True, text=True, env=cli_env(tmp_path), timeout=60,
    )
    assert jq.stdout == "5 not_an_object\n", jq.stderr

    none = run_cli(tmp_path, "show", "1", "--where", "state=succeeded", "--db", str(db))
    assert none.returncode == 0 and none.stdout == "" and "no items of job 1 match" in none.stderr
    for args, message in (
        (["1", "nobody"], "job 1 has no item 'nobody'"),
        (["1", "--where", "body=x"], "with KEY one of state, error_class, status_code, custom_id"),
        (["1", "--where", "state=done"], "--where state=done: expected one of pending, running"),
        (["9"], "no job 9"),
    ):
        bad = run_cli(tmp_path, "show", *args, "--db", str(db))
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)
