"""``submit --dry-run``: the whole input read and rendered as submit would, nothing sent, no job and no ledger left."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchrun.testing import FakeProviderServer

from .conftest import run_cli

SPEC = """
name = "dry"
[provider]
base_url = "{base_url}"
model = "m"
[request]
template = "Say {{text}}"
max_tokens = 50
[pricing]
input_per_million = 2.0
output_per_million = 8.0
"""

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}


def write_input(tmp_path: Path) -> Path:
    # Each good record renders to a 100-byte request:
    #   {"model":"m","messages":[{"role":"user","content":"Say <25 characters>"}],"max_tokens":50}
    # = 71 bytes of JSON around the content + 4 ("Say ") + 25, i.e. 25 prompt tokens at ~4 bytes a token.
    good = [orjson.dumps({"id": f"r{i:02d}", "text": f"{i:02d}" + "." * 23}) for i in range(20)]
    bad = [
        b"{broken",  # 21: not JSON
        b'{"id": "x"}',  # 22: no "text" for the template
        orjson.dumps({"id": "r03", "text": "again"}),  # 23: duplicate custom_id
        b"",  # 24: blank
    ]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\n".join(good + bad) + b"\n")
    return path


def ledgers_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.suffix in (".db", ".db-wal", ".db-shm")]


def test_dry_run_counts_estimates_and_leaves_nothing_behind(tmp_path: Path, server: FakeProviderServer) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(base_url=server.base_url))
    records, db = write_input(tmp_path), tmp_path / "ledger.db"

    proc = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--db", str(db), "--dry-run", "--json")

    assert proc.returncode == 0, proc.stderr
    data = orjson.loads(proc.stdout)
    assert data["dry_run"] is True and data["job_id"] is None
    assert (data["total"], data["to_send"], data["rejected"]) == (24, 20, 4)
    assert data["counts"]["pending"] == 20 and data["counts"]["rejected"] == 4
    assert [r["line"] for r in data["rejections"]] == [21, 22, 23, 24]
    reasons = [r["reason"] for r in data["rejections"]]
    assert reasons[0].startswith("not valid JSON")
    assert reasons[1] == "template field 'text' is missing from the record (it has 'id')"
    assert reasons[2] == "custom_id 'r03' appears twice"
    assert reasons[3] == "blank line"
    assert data["tokens"] == {"prompt": 20 * 25, "prompt_counted_requests": 0, "max_output": 20 * 50}
    # min: 500 prompt tokens at $2/M = $0.001; max: + 1,000 answer tokens at $8/M = $0.009
    assert data["cost_usd"]["min"] == pytest.approx(0.001)
    assert data["cost_usd"]["max"] == pytest.approx(0.009)
    assert data["price"] == {"input_per_million": 2.0, "output_per_million": 8.0, "cached_input_per_million": None}
    assert data["budget_usd"] is None and data["unbounded_answers"] is False

    assert server.log == []  # nothing sent
    assert not db.exists()  # no ledger created, not even an empty one
    assert ledgers_under(tmp_path) == []  # nor at the default location ($HOME/.local/share/batchrun)

    text = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--dry-run")
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert out.splitlines()[0] == "dry run: nothing was sent and no job was created"
    assert "24 lines, 20 items to send, 4 rejected" in out
    assert f"{records}:21: not valid JSON" in out and f"{records}:23: custom_id 'r03' appears twice" in out
    assert "~500 prompt" in out and "up to 1,000 output (max_tokens)" in out
    assert "$0.001000 (prompts only) to $0.009000 (every answer at its limit)" in out
    assert server.log == [] and ledgers_under(tmp_path) == []


@pytest.mark.slow
def test_dry_run_includes_the_structured_output_request(tmp_path: Path, server: FakeProviderServer) -> None:
    records = write_input(tmp_path)
    plain = tmp_path / "plain.toml"
    plain.write_text(SPEC.format(base_url=server.base_url))
    (tmp_path / "answer.schema.json").write_bytes(orjson.dumps(SCHEMA))
    structured = tmp_path / "structured.toml"
    structured.write_text(SPEC.format(base_url=server.base_url) + '[output]\nschema = "answer.schema.json"\n')

    without = orjson.loads(run_cli(tmp_path, "submit", str(plain), "--input", str(records), "--dry-run", "--json").stdout)
    with_schema = orjson.loads(
        run_cli(tmp_path, "submit", str(structured), "--input", str(records), "--dry-run", "--json").stdout
    )

    # Every request also carries response_format with the schema: at least the schema's bytes / 4 more each.
    grown = with_schema["tokens"]["prompt"] - without["tokens"]["prompt"]
    assert grown >= 20 * (len(orjson.dumps(SCHEMA)) // 4)
    assert with_schema["tokens"]["max_output"] == without["tokens"]["max_output"]
    assert server.log == [] and ledgers_under(tmp_path) == []


@pytest.mark.slow
def test_dry_run_of_batch_lines_at_a_list_price(tmp_path: Path, server: FakeProviderServer) -> None:
    def line(custom_id: str, content: str, **body: object) -> bytes:
        return orjson.dumps({
            "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body},
        })

    path = tmp_path / "batch.jsonl"
    # Bodies of 400 bytes each (82 bytes of JSON around 318 characters; 65 around 335 without max_tokens):
    # 100 prompt tokens apiece. The line without max_tokens is assumed to answer in up to 1,024 tokens.
    path.write_bytes(b"\n".join([
        line("a", "a" * 318, max_tokens=100),
        line("b", "b" * 318, max_tokens=100),
        line("c", "c" * 318, max_tokens=100),
        line("d", "d" * 335),
        b'{"custom_id": "e", "method": "GET", "url": "/v1/chat/completions", "body": {}}',
    ]) + b"\n")

    proc = run_cli(tmp_path, "submit", "--input", str(path), "--base-url", server.base_url, "--dry-run", "--json")

    assert proc.returncode == 0, proc.stderr
    data = orjson.loads(proc.stdout)
    assert (data["total"], data["to_send"], data["rejected"]) == (5, 4, 1)
    assert "only POST" in data["rejections"][0]["reason"]
    assert data["tokens"] == {"prompt": 400, "prompt_counted_requests": 0, "max_output": 3 * 100 + 1024}
    # gpt-4o-mini's list price: $0.15/M in, $0.60/M out
    assert data["cost_usd"]["min"] == pytest.approx(400 * 0.15 / 1e6)
    assert data["cost_usd"]["max"] == pytest.approx((400 * 0.15 + 1324 * 0.60) / 1e6)
    assert data["price"] is None and data["unpriced"] is None  # priced line by line, as the run costs them

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(path.read_bytes() + orjson.dumps({
        "custom_id": "f", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "my-own-model", "messages": [{"role": "user", "content": "hi"}]},
    }) + b"\n")
    data = orjson.loads(
        run_cli(tmp_path, "submit", "--input", str(mixed), "--base-url", server.base_url, "--dry-run", "--json").stdout
    )
    assert data["cost_usd"] is None  # a partial sum would understate the bill
    assert data["unpriced"] == {"requests": 1, "models": ["my-own-model"]}
    assert server.log == [] and ledgers_under(tmp_path) == []


@pytest.mark.slow
def test_dry_run_strict_and_spec_errors_exit_2(tmp_path: Path, server: FakeProviderServer) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(SPEC.format(base_url=server.base_url))
    records = write_input(tmp_path)

    strict = run_cli(tmp_path, "submit", str(spec), "--input", str(records), "--dry-run", "--strict")
    assert strict.returncode == 2
    assert f"{records}: 4 of 24 lines are bad (--strict)" in strict.stderr
    assert f"{records}:22: template field 'text' is missing" in strict.stderr
    assert "Traceback" not in strict.stderr

    good = tmp_path / "good.jsonl"
    good.write_bytes(b"\n".join(records.read_bytes().splitlines()[:20]) + b"\n")
    assert run_cli(tmp_path, "submit", str(spec), "--input", str(good), "--dry-run", "--strict").returncode == 0

    unpriced = tmp_path / "unpriced.toml"
    unpriced.write_text(SPEC.format(base_url=server.base_url).split("[pricing]")[0])
    no_price = run_cli(tmp_path, "submit", str(unpriced), "--input", str(good), "--dry-run", "--json")
    assert no_price.returncode == 0  # without a budget an unknown price only leaves the cost unknown
    assert orjson.loads(no_price.stdout)["cost_usd"] is None
    text = run_cli(tmp_path, "submit", str(unpriced), "--input", str(good), "--dry-run")
    assert "cost      unknown: 20 requests have no price (model m); add a [pricing] table to the spec" in text.stdout
    budget = run_cli(tmp_path, "submit", str(unpriced), "--input", str(good), "--dry-run", "--budget-usd", "5")
    assert budget.returncode == 2  # as submit would refuse it
    assert "a budget needs a price" in budget.stderr

    assert server.log == [] and ledgers_under(tmp_path) == []
