"""status, report and compare against real jobs, checked against the fake server's own request log."""

from __future__ import annotations

import asyncio
import math
import os
import pty
import random
import re
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from batchrun.cli import main
from batchrun.jobs import RunSummary, prepare_job, run_job
from batchrun.ledger import AttemptRecord, Ledger, LedgerQueries
from batchrun.report import job_report, nice_step
from batchrun.scheduler import RunOptions
from batchrun.spec import JobSpec, Overrides, load_spec, spec_for_batch_input
from batchrun.testing import FakeProviderServer, Faults, Refusals, RequestRecord, default_key_fn
from batchrun.states import ExitCode, ItemState

FAST = RunOptions(backoff_initial=0.01, backoff_max=0.05, flush_interval=0.05)
# Client-side latency includes the server's time plus the client's own work; on a busy
# two-core machine shared with other test runs that overhead can reach hundreds of
# milliseconds on a bad second, so the upper bound is generous (a unit mix-up still fails it).
LATENCY_SLACK_MS = 400.0
CLOCK_SLACK_MS = 2.0  # the server stamps time.time(), the client times with perf_counter
# The server's outcome -> the error class batchrun records for that attempt.
CLASS_OF = {"429": "rate_limited", "500": "server_error", "503": "server_error", "reset": "connection"}
SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string"}, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["summary", "stars"],
    "additionalProperties": False,
}


@pytest.fixture
def server() -> Iterator[FakeProviderServer]:
    with FakeProviderServer(Faults(seed=1)) as srv:
        yield srv


def make_spec(tmp_path: Path, server: FakeProviderServer, *, schema: bool = False, name: str = "job", **run: Any) -> JobSpec:
    settings = {"concurrency": 16, "max_attempts": 10} | run
    schema_part = ""
    if schema:
        (tmp_path / "review.schema.json").write_bytes(orjson.dumps(SCHEMA))
        schema_part = '[output]\nschema = "review.schema.json"\n'
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f"""
name = "{name}"
[provider]
base_url = "{server.base_url}"
model = "m"
[request]
template = "Say {{text}}"
max_tokens = 50
{schema_part}
[pricing]
input_per_million = 1.0
output_per_million = 2.0
[run]
"""
        + "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n" for k, v in settings.items())
    )
    return load_spec(path)


def records(n: int, prefix: str = "r") -> list[dict[str, object]]:
    return [{"id": f"{prefix}{i}", "text": f"hello {i}"} for i in range(n)]


def submit(ledger: Ledger, spec: JobSpec, path: Path) -> int:
    return prepare_job(ledger, spec, path, new=True).job_id


def run(ledger: Ledger, job_id: int) -> RunSummary:
    return asyncio.run(run_job(ledger, job_id, options=FAST))


def cli(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def status_json(db_url: str, job_id: int) -> dict[str, Any]:
    return orjson.loads(cli("status", str(job_id), "--json", "--db", db_url).stdout)


def nearest_rank(values: list[float], p: int) -> float:
    """Nearest-rank percentile, written independently of batchrun's."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p * len(ordered) / 100)) - 1]


def server_latency_ms(rec: RequestRecord) -> float:
    return (rec.finished_at - rec.received_at) * 1000.0


# -- status against the server's log ----------------------------------------------


@pytest.mark.slow
def test_status_json_agrees_with_the_server_log(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(
        latency_s=0.02, latency_jitter_s=0.08, p_429=0.04, retry_after_s=0.02, p_500=0.05, p_503=0.02,
        p_reset=0.02, seed=11,
    )
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(240)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    log = server.log
    ok = [r for r in log if r.outcome == "ok"]
    failed = [r for r in log if r.outcome != "ok"]
    assert {r.outcome for r in failed} == set(CLASS_OF)  # every injected fault happened at least once

    data = status_json(db_url, job_id)
    assert data["job_id"] == job_id and data["total"] == 240 and data["done"] is True
    assert data["counts"] == {
        "pending": 0, "running": 0, "submitted": 0, "succeeded": 240, "failed": 0, "invalid_output": 0, "rejected": 0, "cancelled": 0,
    }
    assert len(ok) == len(server.ok_by_key()) == 240
    assert data["requests"] == len(log)
    assert data["failed_requests"] == len(failed)
    assert data["tokens"] == {
        "input": sum(r.prompt_tokens for r in ok), "output": sum(r.completion_tokens for r in ok), "cached": 0,
    }
    expected_cost = sum(r.prompt_tokens * 1.0 + r.completion_tokens * 2.0 for r in ok) / 1e6
    assert data["cost_usd"] == pytest.approx(expected_cost, abs=1e-6)
    assert data["cost_per_1k_items"] == pytest.approx(expected_cost / 240 * 1000, abs=1e-6)
    assert data["error_rate"] == 0.0

    by_status = Counter("none" if r.status is None else str(r.status) for r in failed if not 200 <= (r.status or 0) < 300)
    assert {k: v["attempts"] for k, v in data["errors_by_status"].items()} == dict(by_status)
    assert {v["items"] for v in data["errors_by_status"].values()} == {0}
    by_class = Counter(CLASS_OF[r.outcome] for r in failed)
    assert {k: v["attempts"] for k, v in data["errors_by_class"].items()} == dict(by_class)
    assert data["attempt_errors"] == dict(by_class) and data["errors"] == {}
    assert data["retried"] == dict(by_class)  # every item succeeded in the end: each failed attempt was sent again

    per_key = Counter(server.requests_by_key().values())
    assert data["attempts_histogram"] == {"0": 0} | {str(n): per_key[n] for n in sorted(per_key)}
    assert set(per_key) != {1}  # some items did need more than one request

    # Latency: every answered request's client-side time contains its server-side time,
    # so each client percentile is at least the server's, and not much more.
    lat = data["latency_ms"]
    server_ms = [server_latency_ms(r) for r in ok]
    assert lat["count"] == len(ok)
    for p in (50, 90, 99):
        expected = nearest_rank(server_ms, p)
        assert expected - CLOCK_SLACK_MS <= lat[f"p{p}"] <= expected + LATENCY_SLACK_MS, (p, lat, expected)
    assert lat["p50"] >= 40  # the injected latency is 20 ms + U(0, 80 ms): its median is 60 ms
    assert lat["max"] >= max(server_ms) - CLOCK_SLACK_MS
    queue = data["queue_wait_ms"]
    assert queue["count"] == len(log)
    assert 0 <= queue["p50"] <= queue["p90"] <= queue["p99"] <= queue["max"]
    assert data["ttft_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None, "count": 0}

    # Throughput: successes over the span of requests, which the server saw too.
    received = sorted(r.received_at for r in log)
    assert data["throughput_per_s"] == pytest.approx(240 / (received[-1] - received[0]), rel=0.1)
    assert data["eta_s"] is None

    text = cli("status", str(job_id), "--db", db_url).stdout
    assert "succeeded 240" in text and f"requests  {len(log)} ({len(failed)} failed)" in text
    assert re.search(r"latency   p50 \d+ ms  p90 \d+ ms  p99 \d+ ms  \(240\)", text)
    assert "ttft      —" in text


def test_failed_items_by_status_and_class_with_an_example(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.refusals = Refusals(over_context="")  # every request refused as too long, each its own way (context_length)
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(6) + ["{broken"]))
    assert run(ledger, job_id).exit_code == ExitCode.SOME_FAILED
    data = status_json(db_url, job_id)
    assert data["counts"]["failed"] == 6 and data["counts"]["rejected"] == 1
    assert data["requests"] == data["failed_requests"] == len(server.log) == 6
    assert data["error_rate"] == 1.0
    assert data["errors"] == {"context_length": 6, "invalid_json": 1}
    classes = data["errors_by_class"]
    assert classes["context_length"]["attempts"] == 6 and classes["context_length"]["items"] == 6
    assert "HTTP 400" in classes["context_length"]["example"]
    assert classes["invalid_json"]["attempts"] == 0 and classes["invalid_json"]["items"] == 1
    assert "not valid JSON" in classes["invalid_json"]["example"]
    assert list(data["errors_by_status"]) == ["400"]
    assert data["errors_by_status"]["400"]["attempts"] == 6 and data["errors_by_status"]["400"]["items"] == 6
    assert "HTTP 400" in data["errors_by_status"]["400"]["example"]
    assert data["attempts_histogram"] == {"0": 1, "1": 6}
    assert data["latency_ms"]["count"] == 0 and data["latency_ms"]["p50"] is None
    assert data["retried"] == {}  # each failed on its only request: nothing was retried

    text = cli("report", str(job_id), "--db", db_url).stdout
    assert "Errors by class" in text and "context_length" in text and "HTTP 400" in text
    assert "Errors by HTTP status" in text and "not valid JSON" in text
    assert "retried" not in text
    page = tmp_path / "failed.html"
    written = cli("report", str(job_id), "--db", db_url, "--html", str(page)).stdout
    assert written == f"html: {page}\n"  # the page, not the text report too
    html = page.read_text()
    assert "<svg" not in html and "No clean answer yet." in html and "No item has succeeded yet." in html
    assert "HTTP 400" in html and "invalid_json" in html


# -- percentiles in the database ------------------------------------------------


def test_percentiles_in_the_database_match_nearest_rank(
    tmp_path: Path, db_url: str, ledger: Ledger, write_jsonl: Callable[..., Path]
) -> None:
    """Attempts written straight to the ledger (TTFT included, which only streamed requests set)."""
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m"))
    lines = [
        {"custom_id": f"k{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"k{i}"}]}}
        for i in range(101)
    ]
    rng = random.Random(5)
    for n in (1, 2, 7, 101):
        job_id = prepare_job(ledger, spec, write_jsonl(lines[:n], name=f"in{n}.jsonl"), new=True).job_id
        item_ids = [r.item_id for r in LedgerQueries(ledger.engine).iter_items(job_id)]
        attempts = []
        for number, item_id in enumerate(item_ids * 2):
            clean = number % 5 != 3
            attempts.append(AttemptRecord(
                job_id=job_id, item_id=item_id, run_id="r", number=1, started_at=1000.0 + number,
                queue_wait_ms=float(rng.randrange(0, 40)),  # ties on purpose
                latency_ms=rng.uniform(10, 500) if number % 7 else 250.0,
                status_code=200 if clean else 500, error_class=None if clean else "server_error",
                ttft_ms=rng.uniform(5, 80) if clean and number % 3 else None,
            ))
        ledger.record("r", [], attempts)
        data = status_json(db_url, job_id)
        for measure, covered in (
            ("latency_ms", [a.latency_ms for a in attempts if a.error_class is None]),
            ("queue_wait_ms", [a.queue_wait_ms for a in attempts]),
            ("ttft_ms", [a.ttft_ms for a in attempts if a.error_class is None and a.ttft_ms is not None]),
        ):
            values = [v for v in covered if v is not None]
            got = data[measure]
            assert got["count"] == len(values), (n, measure)
            if not values:
                assert got["p50"] is None and got["mean"] is None
                continue
            for p in (50, 90, 99):
                assert got[f"p{p}"] == pytest.approx(nearest_rank(values, p)), (n, measure, p)
            assert got["mean"] == pytest.approx(sum(values) / len(values))
            assert got["max"] == pytest.approx(max(values))
        assert data["attempts_histogram"] == {"0": 0, "2": n}
        hist = job_report(ledger, job_id)["latency_histogram"]
        assert sum(hist["counts"]) + hist["overflow"] == data["latency_ms"]["count"]


def test_nice_step() -> None:
    assert [nice_step(x) for x in (0.7, 1, 1.2, 3, 7, 42, 0.013)] == [1, 1, 2, 5, 10, 50, 0.02]


# -- report --html ------------------------------------------------------------


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: Counter[str] = Counter()
        self.attrs: list[tuple[str, str, str | None]] = []
        self.styles: list[str] = []
        self.stack: list[str] = []
        self.titles: list[tuple[str, str]] = []  # (the svg's aria-label, a bar's tooltip)
        self.svg = ""
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag == "svg":
            self.svg = dict(attrs).get("aria-label") or ""
        self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        while self.stack and self.stack.pop() != tag:
            pass

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.attrs += [(tag, k, v) for k, v in attrs]

    def handle_data(self, data: str) -> None:
        if self.stack[-1:] == ["style"]:
            self.styles.append(data)
        if self.stack[-2:] == ["rect", "title"]:
            self.titles.append((self.svg, data))


def test_report_html_is_one_self_contained_page_with_the_charts(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(latency_s=0.005, latency_jitter_s=0.03, p_500=0.05, seed=3)
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(150)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    page_path = tmp_path / "report.html"
    result = cli("report", str(job_id), "--db", db_url, "--html", str(page_path))
    assert result.stdout == f"html: {page_path}\n"  # the page instead of the text report

    page = page_path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    parsed = _Page()
    parsed.feed(page)
    parsed.close()
    assert parsed.tags["svg"] == 2 and parsed.tags["rect"] > 2
    for tag in ("script", "link", "img", "iframe", "object", "embed", "base"):
        assert parsed.tags[tag] == 0, tag
    for tag, key, value in parsed.attrs:
        assert key not in ("src", "href", "srcset", "xlink:href"), (tag, key, value)
        assert "url(" not in (value or ""), (tag, key, value)
    css = "".join(parsed.styles)
    assert css and "url(" not in css and "@import" not in css and "http" not in css
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", page)

    # The bars add up to the data: answered requests by latency, successes over time.
    data = status_json(db_url, job_id)
    latency_bars = [t for svg, t in parsed.titles if svg.startswith("Latency")]
    time_bars = [t for svg, t in parsed.titles if svg.startswith("Items succeeded")]
    assert sum(int(re.search(r": ([\d,]+) requests", t)[1].replace(",", "")) for t in latency_bars) == (  # type: ignore[index]
        data["latency_ms"]["count"]
    )
    assert sum(int(re.search(r": ([\d,]+) succeeded", t)[1].replace(",", "")) for t in time_bars) == 150  # type: ignore[index]
    assert "server_error" in page and f"{data['requests']:,} ({data['failed_requests']:,} failed)" in page


def test_report_html_replaces_its_own_page_but_not_a_foreign_file(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(5)))
    run(ledger, job_id)
    page = tmp_path / "page.html"
    cli("report", str(job_id), "--db", db_url, "--html", str(page))
    page.write_text(page.read_text() + "<!-- an earlier page -->")
    cli("report", str(job_id), "--db", db_url, "--html", str(page))  # its own earlier page: replaced
    assert "<svg" in page.read_text() and "an earlier page" not in page.read_text()

    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>my notes</html>")
    result = CliRunner().invoke(main, ["report", str(job_id), "--db", db_url, "--html", str(foreign)])
    assert result.exit_code == 2
    assert "is not a batchrun report" in result.output and "--force" in result.output
    assert foreign.read_text() == "<html>my notes</html>"
    cli("report", str(job_id), "--db", db_url, "--html", str(foreign), "--force")
    assert "<svg" in foreign.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_report_of_a_missing_job_is_a_usage_error(db_url: str, ledger: Ledger) -> None:
    result = CliRunner().invoke(main, ["report", "42", "--db", db_url])
    assert result.exit_code == 2 and "no job 42" in result.output and "Traceback" not in result.output


# -- compare ------------------------------------------------------------------


def test_compare_plain_outputs_on_shared_custom_ids(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    spec = make_spec(tmp_path, server)
    base = records(40)
    changed = {"r3", "r7", "r8", "r20", "r31", "r39"}
    edited = [
        {"id": r["id"], "text": f"{r['text']} (edited)"} if r["id"] in changed else r
        for r in base
        if r["id"] not in ("r10", "r11", "r12")
    ] + [{"id": f"new{i}", "text": f"new {i}"} for i in range(4)]
    job_a = submit(ledger, spec, write_jsonl(base, name="a.jsonl"))
    job_b = submit(ledger, spec, write_jsonl(edited, name="b.jsonl"))
    assert run(ledger, job_a).exit_code == ExitCode.OK and run(ledger, job_b).exit_code == ExitCode.OK

    data = orjson.loads(cli("compare", str(job_a), str(job_b), "--json", "--db", db_url).stdout)
    assert data["outputs"] == {
        "compared_on": "output", "shared": 37, "both_succeeded": 37, "differ": 6, "same": 31,
        "examples": ["r3", "r7", "r8", "r20", "r31"],
    }
    for side, job_id in (("a", job_a), ("b", job_b)):
        status = status_json(db_url, job_id)
        assert data[side]["job_id"] == job_id
        for key in ("total", "counts", "tokens", "cost_usd", "cost_per_1k_items", "error_rate", "requests"):
            assert data[side][key] == status[key], key
    assert data["a"]["total"] == 40 and data["b"]["total"] == 41

    text = cli("compare", str(job_a), str(job_b), "--db", db_url, "--examples", "2").stdout
    assert "latency p50" in text and "cost per 1,000 items" in text and "TTFT p99" in text
    assert "Shared custom_ids: 37; both succeeded: 37; output text differs for 6, e.g. r3, r7" in text


def test_compare_structured_outputs_by_parsed_json(
    tmp_path: Path, db_url: str, ledger: Ledger, write_jsonl: Callable[..., Path]
) -> None:
    """B's server answers differently for some keys and wraps many answers in code fences."""
    altered = {"Say hello 4", "Say hello 9", "Say hello 15"}

    def key_b(body: dict[str, Any]) -> str | None:
        key = default_key_fn(body)
        return f"{key} (v2)" if key in altered else key

    path = write_jsonl(records(24))
    with FakeProviderServer(Faults(seed=1)) as server_a:
        job_a = submit(ledger, make_spec(tmp_path, server_a, schema=True, name="a"), path)
        assert run(ledger, job_a).exit_code == ExitCode.OK
    with FakeProviderServer(Faults(p_fenced=0.5, seed=2), key_fn=key_b) as server_b:
        job_b = submit(ledger, make_spec(tmp_path, server_b, schema=True, name="b"), path)
        assert run(ledger, job_b).exit_code == ExitCode.OK
        assert any(r.output_fault == "fenced" for r in server_b.log)
    rows_a = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_a)}
    rows_b = {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_b)}
    raw_differ = {k for k in rows_a if rows_a[k].output != rows_b[k].output}
    assert raw_differ > {"r4", "r9", "r15"}  # the fences change the raw text of many more

    # The same object with its keys in another order is the same answer.
    reordered = rows_b["r0"]
    swapped = dict(reversed(list(orjson.loads(reordered.parsed or "null").items())))
    ledger.set_verdicts([(reordered.item_id, ItemState.SUCCEEDED, orjson.dumps(swapped).decode(), None, None, None)])
    assert rows_a["r0"].parsed != {r.custom_id: r for r in LedgerQueries(ledger.engine).iter_items(job_b)}["r0"].parsed

    data = orjson.loads(cli("compare", str(job_a), str(job_b), "--json", "--db", db_url).stdout)
    assert data["outputs"] == {
        "compared_on": "parsed", "shared": 24, "both_succeeded": 24, "differ": 3, "same": 21,
        "examples": ["r4", "r9", "r15"],
    }


def test_compare_needs_both_jobs(db_url: str, ledger: Ledger) -> None:
    result = CliRunner().invoke(main, ["compare", "1", "2", "--db", db_url])
    assert result.exit_code == 2 and "no job 1" in result.output


# -- status --watch -----------------------------------------------------------


def _cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHRUN_")}
    env["HOME"] = str(tmp_path / "home")
    return env


@pytest.mark.slow
def test_watch_follows_a_running_job_until_it_is_done(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(latency_s=0.08)  # ~2.4 s of work at concurrency 4: the watcher starts in ~1 s
    job_id = submit(ledger, make_spec(tmp_path, server, concurrency=4), write_jsonl(records(120)))
    watcher = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "status", str(job_id), "--watch", "--interval", "0.2", "--db", db_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_cli_env(tmp_path),
    )
    try:
        assert run(ledger, job_id).exit_code == ExitCode.OK
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) >= 3  # a line per interval while it ran
    assert all(line.startswith(f"job {job_id}: ") for line in lines)
    assert "succeeded=120" in lines[-1] and lines[-1].endswith("(done)")
    assert not any(line.endswith("(done)") for line in lines[:-1])
    done = [int(re.search(r"succeeded=(\d+)", line)[1]) for line in lines]  # type: ignore[index]
    assert done == sorted(done) and done[0] < 120


def test_watch_json_prints_one_object_a_line(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(3)))
    run(ledger, job_id)
    out = cli("status", str(job_id), "--watch", "--json", "--db", db_url).stdout
    objects = [orjson.loads(line) for line in out.splitlines()]
    assert len(objects) == 1 and objects[0]["done"] is True and objects[0]["counts"]["succeeded"] == 3


def test_watch_stops_on_ctrl_c_without_a_traceback(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(3)))  # nobody works it
    watcher = subprocess.Popen(
        [sys.executable, "-m", "batchrun", "status", str(job_id), "--watch", "--interval", "0.1", "--db", db_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_cli_env(tmp_path),
    )
    try:
        assert watcher.stdout is not None
        first, second = watcher.stdout.readline(), watcher.stdout.readline()
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=30)
    finally:
        watcher.kill()
    assert watcher.returncode == 130
    assert "pending=3" in first and "pending=3" in second
    assert "Traceback" not in err
    assert LedgerQueries(ledger.engine).counts(job_id)[ItemState.PENDING] == 3


def test_watch_on_a_terminal_draws_in_place(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(4)))
    run(ledger, job_id)
    leader, follower = pty.openpty()
    errors = tmp_path / "stderr.txt"
    with errors.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchrun", "status", str(job_id), "--watch", "--db", db_url],
            stdin=follower, stdout=follower, stderr=stderr, env=_cli_env(tmp_path) | {"TERM": "xterm"},
        )
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal closed: the command is done
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif proc.poll() is not None:
                break
        proc.wait(timeout=30)
    finally:
        proc.kill()
        os.close(leader)
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, errors.read_text()
    assert "succeeded 4" in screen and "(done)" in screen
    assert "\x1b[" in screen  # drawn with terminal control codes, not as a plain line


def test_help_shows_the_commands_and_their_examples() -> None:
    top = cli("--help").stdout
    assert "report" in top and "compare" in top and "status" in top
    assert "--watch" in cli("status", "--help").stdout and "--interval" in cli("status", "--help").stdout
    assert "batchrun report 3 --html report-3.html" in cli("report", "--help").stdout
    assert "batchrun compare 1 2" in cli("compare", "--help").stdout


def test_status_reports_time_to_first_token_of_a_streamed_job(
    tmp_path: Path, db_url: str, ledger: Ledger, write_jsonl: Callable[..., Path], frozen_heap: None
) -> None:
    """TTFT percentiles come from streamed answers: at least the server's latency, below the total."""
    faults = Faults(seed=5, latency_s=0.03, stream_chunk_delay_s=0.03)
    with FakeProviderServer(faults) as streaming:
        spec = make_spec(tmp_path, streaming, stream=True)
        job_id = submit(ledger, spec, write_jsonl(records(40)))
        assert run(ledger, job_id).exit_code == ExitCode.OK
        log = streaming.log
    assert all(r.stream for r in log) and len(log) == 40
    status = status_json(db_url, job_id)
    ttft, total = status["ttft_ms"], status["latency_ms"]
    assert ttft["count"] == 40
    assert 30 - CLOCK_SLACK_MS <= ttft["p50"] <= ttft["p99"] <= 30 + LATENCY_SLACK_MS
    assert ttft["p99"] <= total["p99"] and ttft["max"] <= total["max"]  # each first token came before its answer ended
    # the rest of the answer came in chunks, the next one 30 ms after the first token
    assert total["p50"] >= ttft["p50"] + 25


def test_an_answer_that_came_with_200_is_no_error_status(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(seed=5, p_bad_body=0.3, p_500=0.1)  # 200s whose body is not JSON, and 500s
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(60)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    assert any(r.outcome == "bad_body" for r in server.log) and any(r.outcome == "500" for r in server.log)
    data = status_json(db_url, job_id)
    assert "200" not in data["errors_by_status"] and "500" in data["errors_by_status"]
    assert "200" not in cli("report", str(job_id), "--db", db_url).stdout.split("Errors by HTTP status")[-1]


def test_a_cancelled_jobs_cards_say_cancelled(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(12)))
    assert cli("cancel", str(job_id), "--db", db_url).exit_code == 0
    page = tmp_path / "cancelled.html"
    cli("report", str(job_id), "--db", db_url, "--html", str(page))
    cards = page.read_text().split("<h2>")[0]
    assert "cancelled (12)" in cards and "done" not in cards


# -- attempt messages, the latency split, the TTFT histogram ------------------------------


def test_an_error_class_whose_items_all_succeeded_later_still_has_an_example(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    """An item that failed with a 500 and then succeeded keeps no message; its attempt does."""
    server.faults = Faults(p_500=0.4, seed=7)
    job_id = submit(ledger, make_spec(tmp_path, server), write_jsonl(records(20)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    assert any(r.outcome == "500" for r in server.log)  # some item met a 500 ...
    said = "The server had an error while processing your request."  # the fake server's 500 message
    data = status_json(db_url, job_id)
    assert data["counts"]["succeeded"] == 20  # ... and every item succeeded in the end
    server_error = data["errors_by_class"]["server_error"]
    assert server_error["items"] == 0 and server_error["attempts"] >= 1
    assert said in server_error["example"] and "HTTP 500" in server_error["example"]
    assert said in data["errors_by_status"]["500"]["example"]

    report = orjson.loads(cli("report", str(job_id), "--json", "--db", db_url).stdout)
    assert said in report["errors_by_class"]["server_error"]["example"]
    text = cli("report", str(job_id), "--db", db_url).stdout
    assert "The server had an error" in text.split("Errors by class")[1]
    page = tmp_path / "page.html"
    cli("report", str(job_id), "--db", db_url, "--html", str(page))
    assert "The server had an error" in page.read_text().split("Errors by class")[1]


def test_the_report_splits_clean_answers_time_into_queue_first_byte_and_last_byte(
    tmp_path: Path, db_url: str, ledger: Ledger, server: FakeProviderServer, write_jsonl: Callable[..., Path]
) -> None:
    server.faults = Faults(latency_s=0.01, latency_jitter_s=0.04, p_500=0.05, seed=4)
    job_id = submit(ledger, make_spec(tmp_path, server, concurrency=4), write_jsonl(records(60)))
    assert run(ledger, job_id).exit_code == ExitCode.OK
    data = orjson.loads(cli("report", str(job_id), "--json", "--db", db_url).stdout)
    split = data["latency_split"]
    assert list(split) == ["queue_wait_ms", "ttfb_ms", "latency_ms"]
    assert {m: d["count"] for m, d in split.items()} == dict.fromkeys(split, 60)  # every clean answer, once
    for d in split.values():
        assert 0 <= d["p50"] <= d["p99"]
    for p in ("p50", "p99"):  # each answer's first byte came before its last
        assert split["ttfb_ms"][p] <= split["latency_ms"][p]
    # The fake server sleeps before it sends the headers: the first byte carries that wait.
    assert split["ttfb_ms"]["p50"] >= 10 - CLOCK_SLACK_MS
    assert split["latency_ms"]["p99"] <= data["latency_ms"]["max"]
    assert data["ttft_histogram"] is None  # nothing was streamed

    text = cli("report", str(job_id), "--db", db_url).stdout
    table = text.split("Where the time went")[1].split("\n\n")[0]
    for label in ("queue wait", "time to first byte", "time to last byte"):
        assert re.search(label + r".*\d+(\.\d)? ms\s+.*\d+(\.\d)? ms", table), table
    assert "TTFT of streamed answers" not in text
    page = tmp_path / "split.html"
    cli("report", str(job_id), "--db", db_url, "--html", str(page))
    html = page.read_text()
    assert "Where the time went" in html and "time to first byte" in html
    assert "Time to first token" not in html


def test_a_streamed_jobs_report_has_a_ttft_histogram_of_its_answers(
    tmp_path: Path, db_url: str, ledger: Ledger, write_jsonl: Callable[..., Path]
) -> None:
    faults = Faults(seed=6, latency_s=0.01, latency_jitter_s=0.05, stream_chunk_delay_s=0.005, p_500=0.1)
    with FakeProviderServer(faults) as streaming:
        job_id = submit(ledger, make_spec(tmp_path, streaming, stream=True), write_jsonl(records(50)))
        assert run(ledger, job_id).exit_code == ExitCode.OK
        streamed_ok = sum(1 for r in streaming.log if r.stream and r.outcome == "ok")
    data = orjson.loads(cli("report", str(job_id), "--json", "--db", db_url).stdout)
    hist = data["ttft_histogram"]
    assert streamed_ok == 50 and sum(hist["counts"]) + hist["overflow"] == streamed_ok == data["ttft_ms"]["count"]
    assert hist["width_ms"] > 0 and hist["low_ms"] <= data["ttft_ms"]["p50"]
    for p in ("p50", "p99"):  # the headers come before the first token, and that before the last byte
        assert data["latency_split"]["ttfb_ms"][p] <= data["ttft_ms"][p] <= data["latency_split"]["latency_ms"][p]

    text = cli("report", str(job_id), "--db", db_url).stdout
    line = text.split("TTFT of streamed answers")[1]
    assert re.search(r"\d+(\.\d)? ms \|[ ▁▂▃▄▅▆▇█]+\| \d+(\.\d)? ms", line) and "(50 answers" in line, line
    page = tmp_path / "streamed.html"
    cli("report", str(job_id), "--db", db_url, "--html", str(page))
    parsed = _Page()
    parsed.feed(page.read_text())
    parsed.close()
    assert parsed.tags["svg"] == 3  # latency, TTFT, throughput
    ttft_bars = [t for svg, t in parsed.titles if svg.startswith("Time to first token")]
    assert sum(int(re.search(r": ([\d,]+) requests", t)[1].replace(",", "")) for t in ttft_bars) == 50  # type: ignore[index]
