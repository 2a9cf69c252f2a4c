from __future__ import annotations

from pathlib import Path

import pytest

from batchrun.errors import SpecError
from batchrun.spec import Overrides, Template, TemplateFieldError, load_spec, spec_for_batch_input

GOOD = """
name = "t"
[provider]
kind = "openai"
base_url = "http://127.0.0.1:9/v1/"
model = "m"
[request]
system = "sys"
template = "Say {text} about {meta.topic}"
max_tokens = 10
temperature = 0
extra = { top_p = 0.5 }
[run]
concurrency = 3
timeout = 5
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_load_good_spec(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.provider.base_url == "http://127.0.0.1:9/v1"
    assert spec.provider.api_key_env == "OPENAI_API_KEY"
    assert spec.request.max_tokens == 10 and spec.request.temperature == 0.0
    assert spec.request.extra == {"top_p": 0.5}
    assert spec.run.concurrency == 3 and spec.run.timeout == 5.0 and spec.run.max_attempts == 5
    assert spec.has_template


def test_overrides_win_and_identity_ignores_run_settings(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    faster = spec.with_overrides(Overrides(concurrency=50, max_attempts=2, timeout=1.5))
    assert (faster.run.concurrency, faster.run.max_attempts, faster.run.timeout) == (50, 2, 1.5)
    assert faster.identity_hash() == spec.identity_hash()
    other_model = spec.with_overrides(Overrides(model="m2"))
    assert other_model.provider.model == "m2"
    assert other_model.identity_hash() != spec.identity_hash()


def test_round_trip_through_dict(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    from batchrun.spec import JobSpec

    again = JobSpec.from_dict(spec.to_dict(), source=spec.source)
    assert again.identity_hash() == spec.identity_hash()
    assert again.request == spec.request


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[provider]\nkind = 'gemini'\n", "[provider] kind = 'gemini': expected one of openai"),
        ("[run]\nconcurrency = 'many'\n", "[run] concurrency = 'many': expected an integer"),
        ("[run]\nconcurrency = 0\n", "[run] concurrency = 0: expected an integer >= 1"),
        ("[run]\ntimeout = -1\n", "[run] timeout = -1.0: expected a number of seconds > 0"),
        ("[request]\nmax_tokens = true\n", "[request] max_tokens = True: expected an integer"),
        ("[request]\ntemplat = 'x'\n", "[request] unknown key 'templat'"),
        ("[provider]\nbase_url = 'ftp://x'\n", "expected an http:// or https:// URL"),
        ("[request]\ntemplate = 'hi {not a field}'\n", "is not a field name"),
        ("[request]\ntemplate = 'hi {x'\n", "unbalanced brace"),
        ("provider = 3\n", "[provider] expected a table"),
        ("[provider\n", "not valid TOML"),
    ],
)
def test_spec_errors_name_file_key_and_expectation(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(path) in info.value.message
    assert fragment in info.value.message


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.toml")


def test_bad_override_is_a_spec_error(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    with pytest.raises(SpecError, match="command line: \\[run\\] concurrency = 0"):
        spec.with_overrides(Overrides(concurrency=0))


def test_spec_for_batch_input_needs_base_url() -> None:
    with pytest.raises(SpecError, match="--base-url is required"):
        spec_for_batch_input(Overrides())
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:1", model="m", concurrency=7))
    assert spec.provider.model == "m" and spec.run.concurrency == 7 and not spec.has_template


def test_template_renders_nested_fields_json_and_escapes() -> None:
    t = Template.compile("{{literal}} {a} {b.c} {n} {lst} {lst.1}")
    assert t.render({"a": "x", "b": {"c": "y"}, "n": 3, "lst": [1, 2]}) == "{literal} x y 3 [1,2] 2"
    assert t.fields == ["a", "b.c", "n", "lst", "lst.1"]


def test_template_missing_field_names_it() -> None:
    t = Template.compile("{a.b.c}")
    with pytest.raises(TemplateFieldError) as info:
        t.render({"a": {"x": 1}})
    assert info.value.args[0] == "a.b"


def test_every_bundled_job_spec_loads_and_renders_its_example_input() -> None:
    """The specs in jobs/ are documentation people copy: each must load and render its input."""
    from batchrun.ingest import RequestBuilder, check_input
    from batchrun.providers import provider_for

    jobs = Path(__file__).resolve().parents[2] / "jobs"
    specs = sorted(jobs.glob("*.toml"))
    assert {p.stem for p in specs} >= {"summarize", "triage", "nightly"}
    for path in specs:
        spec = load_spec(path)
        example = jobs / f"{path.stem}.jsonl"
        if not example.exists():
            example = jobs / "triage.jsonl"  # nightly.toml runs over ticket files like triage's
        stats = check_input(example, RequestBuilder(spec, provider_for(spec, api_key=None, read_key=False)))
        assert stats.rejected == 0 and stats.accepted == stats.lines > 0, (path, stats.rejections)


def test_cache_is_on_by_default_off_by_spec_or_flag_and_not_part_of_identity(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.run.cache is True
    off = load_spec(write(tmp_path, GOOD + "cache = false\n"))
    assert off.run.cache is False
    assert off.identity_hash() == spec.identity_hash()
    assert spec.with_overrides(Overrides(cache=False)).run.cache is False
    assert off.with_overrides(Overrides(concurrency=2)).run.cache is False  # no flag: the spec decides
    stored = spec.to_dict()
    del stored["run"]["cache"]  # a job stored before the cache existed
    from batchrun.spec import JobSpec

    assert JobSpec.from_dict(stored).run.cache is True
    with pytest.raises(SpecError, match="cache"):
        load_spec(write(tmp_path, GOOD + 'cache = "yes"\n'))


def test_a_stored_spec_from_another_version_still_opens() -> None:
    """A job's spec is stored once, when it is submitted; later versions read it back for status,
    resume and export. Fields a later version dropped are ignored, fields it added take defaults."""
    from batchrun.spec import JobSpec, Overrides, spec_for_batch_input

    stored = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m")).to_dict()
    stored["provider"]["retired_option"] = True  # a field this version no longer has
    del stored["run"]["cache"]  # a field an older version did not have yet
    stored["request"].pop("messages")
    stored.pop("pricing")
    spec = JobSpec.from_dict(stored)
    assert spec.provider.model == "m" and spec.run.cache is True and spec.request.messages == ()


def test_any_run_field_is_an_override_by_its_name() -> None:
    """One resolution: a flag named like a [run] field overrides it, with no list to keep in step."""
    spec = spec_for_batch_input(Overrides(base_url="http://127.0.0.1:1", model="m"))
    flags = {"grace_seconds": 7.0, "outage_seconds": 9.0, "concurrency": None, "quiet": True, "model": "m2"}
    over = Overrides.from_flags(flags)
    assert over == Overrides(model="m2", grace_seconds=7.0, outage_seconds=9.0)
    changed = spec.with_overrides(over)
    assert (changed.run.grace_seconds, changed.run.outage_seconds, changed.provider.model) == (7.0, 9.0, "m2")
    assert changed.run.concurrency == spec.run.concurrency  # None: not given, the spec decides
    assert over.without("grace_seconds").run == {"outage_seconds": 9.0}
    with pytest.raises(TypeError, match="not a \\[run\\] field: colour"):
        Overrides(colour="red")
