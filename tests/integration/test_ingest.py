from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from batchrun.errors import InputError
from batchrun.ingest import RequestBuilder, iter_lines
from batchrun.jobs import prepare_job
from batchrun.ledger import Ledger, LedgerQueries
from batchrun.providers import provider_for
from batchrun.spec import Overrides, parse_spec, spec_for_batch_input
from batchrun.states import ItemState

TEMPLATE_SPEC = parse_spec(
    {
        "provider": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
        "request": {"system": "be brief", "template": "Summarise {text} ({meta.lang})", "max_tokens": 5},
        "run": {"max_line_bytes": 200},
    },
    where="test",
)
BATCH_SPEC = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1"))


def batch_line(cid: object, content: str = "hi", **extra: object) -> dict[str, object]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": content}]},
        **extra,
    }


def items(ledger: Ledger, job_id: int) -> list:
    return list(LedgerQueries(ledger.engine).iter_items(job_id))


def test_iter_lines_crlf_missing_final_newline_and_oversize(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a":1}\r\n' + b"x" * 50 + b"\n" + b'{"b":2}')
    with open(path, "rb") as f:
        lines = list(iter_lines(f, 20))
    assert lines == [(1, b'{"a":1}'), (2, None), (3, b'{"b":2}')]


def test_template_records_are_rendered(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl([{"id": "a", "text": "cats", "meta": {"lang": "en"}}, {"text": "dogs", "meta": {"lang": "fr"}}])
    prepared = prepare_job(ledger, TEMPLATE_SPEC, path)
    rows = items(ledger, prepared.job_id)
    assert [(r.custom_id, r.state) for r in rows] == [("a", "pending"), ("2", "pending")]
    with ledger.engine.connect() as conn:
        from sqlalchemy import text

        body = orjson.loads(conn.execute(text("select body from items where custom_id = 'a'")).scalar())
    assert body == {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Summarise cats (en)"}],
        "max_tokens": 5,
    }


def test_bad_lines_become_rejected_items_with_line_and_reason(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl(
        [
            {"id": 1, "text": "ok", "meta": {"lang": "en"}},
            b"{not json",
            b'{"id": "u", "text": "\xff\xfe"}',
            b"[1, 2]",
            {"id": "nometa", "text": "x"},
            b"   ",
            {"id": 1, "text": "dup", "meta": {"lang": "en"}},
            {"id": "big", "text": "y" * 300, "meta": {"lang": "en"}},
            {"id": None, "text": "z", "meta": {"lang": "en"}},
            {"id": "last", "text": "fine", "meta": {"lang": "de"}},
        ],
        newline=b"\r\n",
        final_newline=False,
    )
    prepared = prepare_job(ledger, TEMPLATE_SPEC, path)
    assert prepared.ingest is not None
    assert (prepared.ingest.accepted, prepared.ingest.rejected) == (2, 8)
    rows = {r.line: r for r in items(ledger, prepared.job_id)}
    assert len(rows) == 10
    expected = {
        2: "invalid_json",
        3: "invalid_utf8",
        4: "not_an_object",
        5: "missing_field",
        6: "blank",
        7: "duplicate_custom_id",
        8: "too_large",
        9: "bad_custom_id",
    }
    for line, error_class in expected.items():
        assert rows[line].state == ItemState.REJECTED, line
        assert rows[line].error_class == error_class, line
    assert "'meta'" in (rows[5].error_message or "")
    assert "already used on line 1" in (rows[7].error_message or "")
    assert rows[1].state == rows[10].state == ItemState.PENDING
    assert rows[7].custom_id == "1"  # the duplicate keeps its key; export lists it only as an error


def test_strict_refuses_the_file_and_creates_no_job(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl([batch_line("a"), b"{oops", batch_line("a")])
    with pytest.raises(InputError) as info:
        prepare_job(ledger, BATCH_SPEC, path, strict=True)
    message = info.value.message
    assert f"{path}:2: not valid JSON" in message
    assert f"{path}:3: custom_id 'a' appears twice" in message
    assert "2 of 3 lines are bad" in message
    assert ledger.list_jobs() == []


def test_batch_form_lines(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl(
        [
            batch_line("a"),
            batch_line("b", method="GET"),
            {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
            {"custom_id": "d", "text": "plain record without a spec"},
        ]
    )
    prepared = prepare_job(ledger, BATCH_SPEC, path)
    rows = {r.custom_id: r for r in items(ledger, prepared.job_id)}
    assert rows["a"].state == ItemState.PENDING
    assert rows["b"].state == ItemState.REJECTED and "only POST" in (rows["b"].error_message or "")
    assert rows["c"].state == ItemState.REJECTED and "no 'model'" in (rows["c"].error_message or "")
    assert rows["d"].state == ItemState.REJECTED and "[request] template" in (rows["d"].error_message or "")


def test_same_spec_and_content_finds_the_job(ledger: Ledger, write_jsonl: Callable[..., Path], tmp_path: Path) -> None:
    path = write_jsonl([batch_line("a"), batch_line("b")])
    first = prepare_job(ledger, BATCH_SPEC, path)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    again = prepare_job(ledger, BATCH_SPEC, copy)
    assert again.job_id == first.job_id and not again.created and again.ingest is None
    forced = prepare_job(ledger, BATCH_SPEC, path, new=True)
    assert forced.job_id != first.job_id and forced.created


def test_interrupted_ingest_carries_on_after_last_line(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl([batch_line(str(i)) for i in range(1, 8)])
    from batchrun.input_hash import hash_input

    job_id = ledger.create_job(BATCH_SPEC, input_path=str(path), input_hash=hash_input(path))
    builder = RequestBuilder(BATCH_SPEC, provider_for(BATCH_SPEC, read_key=False))
    # Simulate a crash after the first three lines were committed.
    ledger.insert_items(
        job_id,
        [{"line": i, "custom_id": str(i), "url": "/v1/chat/completions", "body": "{}", "state": "pending"} for i in (1, 2, 3)],
    )
    again = prepare_job(ledger, BATCH_SPEC, path)
    assert again.job_id == job_id and not again.created
    assert again.ingest is not None and again.ingest.accepted == 4
    assert [r.line for r in items(ledger, job_id)] == list(range(1, 8))
    assert ledger.get_job(job_id).total == 7
    del builder


def test_missing_input_file_is_an_input_error(ledger: Ledger, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such input file"):
        prepare_job(ledger, BATCH_SPEC, tmp_path / "absent.jsonl")


def test_large_input_is_ingested_in_batches(ledger: Ledger, write_jsonl: Callable[..., Path]) -> None:
    n = 12_345
    path = write_jsonl([batch_line(f"id-{i}", f"content {i}") for i in range(n)])
    batches: list[int] = []
    prepared = prepare_job(ledger, BATCH_SPEC, path, on_batch=lambda s: batches.append(s.lines))
    assert LedgerQueries(ledger.engine).counts(prepared.job_id)[ItemState.PENDING] == n
    assert len(batches) == 3  # 5000 + 5000 + rest: never the whole file at once


def test_rejected_lines_never_duplicate_a_custom_id_in_the_output(
    ledger: Ledger, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    from batchrun.export import export_job

    path = write_jsonl([
        {"custom_id": "a", "body": "not an object"},
        batch_line("a"),
        {"custom_id": "3", "method": "GET", "url": "/v1/chat/completions", "body": {}},
        b"{broken",  # falls back to its line number, 4
        batch_line("4"),
    ])
    prepared = prepare_job(ledger, BATCH_SPEC, path)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    export_job(ledger, prepared.job_id, out, errors=errors)
    ids = [orjson.loads(x)["custom_id"] for x in out.read_bytes().splitlines()]
    assert sorted(ids) == ["3", "4", "a"] and len(ids) == len(set(ids))
    errs = {orjson.loads(x)["line"] for x in errors.read_bytes().splitlines()}
    assert errs == {1, 3, 4}  # every bad line is still reported


def test_overlapping_submits_ingest_once(db_url: str, write_jsonl: Callable[..., Path]) -> None:
    import threading

    from batchrun.errors import JobLockedError

    path = write_jsonl([batch_line(str(i)) for i in range(30_000)])
    results: list[object] = []

    def submit_once() -> None:
        with Ledger.open(db_url) as led:
            try:
                results.append(prepare_job(led, BATCH_SPEC, path).job_id)
            except JobLockedError as exc:
                results.append(exc)

    threads = [threading.Thread(target=submit_once) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with Ledger.open(db_url) as led:
        jobs = led.list_jobs()
        assert len(jobs) == 1
        assert sum(jobs[0][1].values()) == 30_000
    assert 1 in results


@pytest.mark.slow
def test_strict_checks_hold_custom_ids_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14, case 10: --strict and --dry-run read every custom_id to find repeats; past
    SEEN_IN_MEMORY of them they go to a temporary file, so memory stays flat on any input
    (100,000 ids held in a set took ~12 MB here), and a repeat after the move is still found."""
    import tracemalloc

    from batchrun import ingest

    monkeypatch.setattr(ingest, "SEEN_IN_MEMORY", 10_000)
    n = 100_000
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for i in range(n):
            f.write(orjson.dumps(batch_line(f"record-{i:08d}")) + b"\n")
        f.write(orjson.dumps(batch_line("record-00000007")) + b"\n")  # a repeat long after the move
    builder = RequestBuilder(BATCH_SPEC, provider_for(BATCH_SPEC, read_key=False))
    tracemalloc.start()
    try:
        checked = ingest.check_input(path, builder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (checked.accepted, checked.rejected) == (n, 1)
    assert checked.rejections == [(n + 1, "custom_id 'record-00000007' appears twice")]
    assert peak < 5_000_000, f"{peak / 1e6:.1f} MB"
