"""Job specs: load and check a TOML file into a frozen :class:`JobSpec`.

Precedence is flags > spec > defaults, resolved once here; the rest of the
library only ever sees the frozen result.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import orjson

from batchrun.errors import SpecError
from batchrun.formats import MODES
from batchrun.provider_registry import (
    DEFAULT_ANTHROPIC_VERSION,
    DEFAULT_KIND,
    ENTRIES,
    KINDS,
    provider_entry,
)

if TYPE_CHECKING:
    from batchrun.pricing import Price

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
_FIELD_PATH = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


class TemplateFieldError(KeyError):
    """A placeholder names a field the record does not have."""


@dataclass(frozen=True)
class Template:
    """A ``{field}`` / ``{field.sub}`` template compiled once, rendered per record.

    ``{{`` and ``}}`` stand for literal braces. Strings are inserted as they are;
    other values as JSON.
    """

    source: str
    parts: tuple[str | tuple[str, ...], ...]

    @classmethod
    def compile(cls, source: str, *, where: str = "template") -> Template:
        parts: list[str | tuple[str, ...]] = []
        pos = 0
        for match in _PLACEHOLDER.finditer(source):
            parts.append(source[pos : match.start()])
            token = match.group(0)
            if token in ("{{", "}}"):
                parts.append(token[0])
            else:
                name = match.group(1).strip()
                if not _FIELD_PATH.fullmatch(name):
                    raise SpecError(
                        f"{where}: placeholder {token!r} is not a field name "
                        "(use {field} or {field.sub}; write {{ and }} for literal braces)"
                    )
                parts.append(tuple(name.split(".")))
            pos = match.end()
        rest = source[pos:]
        if "{" in rest or "}" in rest:
            raise SpecError(f"{where}: unbalanced brace in {rest!r} (write {{{{ or }}}} for a literal brace)")
        parts.append(rest)
        return cls(source, tuple(p for p in parts if p != ""))

    @property
    def fields(self) -> list[str]:
        return [".".join(p) for p in self.parts if isinstance(p, tuple)]

    def render(self, record: Mapping[str, Any]) -> str:
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value: Any = record
            for i, key in enumerate(part):
                if isinstance(value, Mapping) and key in value:
                    value = value[key]
                elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                    value = value[int(key)]
                else:
                    raise TemplateFieldError(".".join(part[: i + 1]))
            out.append(value if isinstance(value, str) else orjson.dumps(value).decode())
        return "".join(out)


@dataclass(frozen=True)
class ProviderSpec:
    kind: str = DEFAULT_KIND  # one of the provider registry's kinds (batchrun/provider_registry.py)
    base_url: str | None = None
    model: str | None = None
    api_key_env: str = provider_entry(DEFAULT_KIND).api_key_env
    api_key_file: str | None = None  # absolute path of a file whose stripped content is the key (not the key)
    anthropic_version: str = DEFAULT_ANTHROPIC_VERSION  # the anthropic-version header (read by that kind only)
    convert_openai_input: bool = False  # accept OpenAI Batch lines and convert their bodies (where the kind can)


def _known_fields(kind: type, stored: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``stored`` that are fields of the dataclass ``kind`` (the rest take their defaults)."""
    names = {f.name for f in dataclasses.fields(kind)}
    return {key: value for key, value in stored.items() if key in names}


@dataclass(frozen=True)
class RequestSpec:
    system: str | None = None
    template: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # The context window requests must fit in (prompt + max_tokens; batchrun.context); None: the
    # model's known window, 0: no guard.
    max_input_tokens: int | None = None


@dataclass(frozen=True)
class RunSpec:
    concurrency: int = 32
    max_attempts: int = 5
    timeout: float = 600.0
    connect_timeout: float = 10.0
    max_line_bytes: int = 1_000_000
    lease_seconds: float = 120.0
    grace_seconds: float = 30.0
    hang_factor: float = 10.0
    hang_min_seconds: float = 10.0
    rpm: float = 0.0  # requests per minute for the job; 0 = no limit
    tpm: float = 0.0  # tokens per minute (prompt estimate + max_tokens, corrected from usage); 0 = no limit
    max_runtime: float = 0.0  # seconds a run may work before it stops cleanly (exit 75); 0 = no limit
    outage_seconds: float = 300.0  # every request failing this long: stop with exit 75, items pending
    # A run that never had a clean answer and cannot connect (refused, DNS, TLS) stops this soon instead.
    connect_grace: float = 30.0
    stream: bool = False  # ask for server-sent events: time to first token and per output token are recorded
    # The job's total spend cap in USD (exit 4 when the next request's worst case does not fit);
    # 0 = no budget. Written in a spec or given as --budget-usd it must be > 0.
    budget_usd: float = 0.0
    # Reuse an answer any job of the ledger already got for the same request (batchrun.cache);
    # false (or --no-cache): send every item. Request keys are recorded either way.
    cache: bool = True
    # "online": one request per attempt; "batch": through the provider's batch API ([batch], half price).
    mode: str = "online"
    # OpenAI's service_tier for online requests ("flex": batch prices, slower, 429s when busy); "": the default.
    service_tier: str = ""

    @property
    def lock_stale_seconds(self) -> float:
        """How long a job lock may go without a heartbeat before another run takes the job over.

        Half the lease: a run that stalled longer (SIGSTOP, a suspended laptop, a
        long outage) stops sending before its items can be given to another run.
        """
        return self.lease_seconds / 2


RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(RunSpec))
FLEX_TIMEOUT = 900.0  # [run] timeout under service_tier = "flex" unless the spec sets one (OpenAI's advice)


@dataclass(frozen=True)
class BatchSpec:
    """``[batch]``: how batch mode splits a job into provider batches (shards) and waits for them.

    Like ``[run]``, it says how a job is worked, not what is asked: it is not part of
    the job's identity, and a resume may change it.
    """

    max_requests: int = 0  # requests per shard; 0: the provider's limit (OpenAI 50,000, Anthropic 100,000)
    max_bytes: int = 0  # bytes of a shard's request file; 0: the provider's limit (200 MB, 256 MB)
    # Estimated prompt tokens of all unfinished shards together (the per-model queue limit of
    # the user's tier); 0: no limit of ours (a batch the provider refuses for it is retried smaller).
    enqueued_tokens: int = 0
    keep_files: bool = False  # keep the shard's files (OpenAI) / batch (Anthropic) at the provider once collected
    deadline: float = 0.0  # seconds after the job's first shard: cancel what is left at the provider, go online
    poll_interval: float = 30.0  # first wait between two polls of a shard; it grows to poll_max
    poll_max: float = 300.0
    reask: str = "batch"  # an answer that fails the schema is asked again in the next shard, or "online"
    # Seconds a create call may take (its HTTP timeout); a resume waits this long and a margin from a
    # create that got no answer before it concludes none was made. 0: the provider's default.
    create_timeout: float = 0.0


BATCH_FIELDS = frozenset(f.name for f in dataclasses.fields(BatchSpec))
REASK_ROUTES = ("batch", "online")  # [batch] reask


@dataclass(frozen=True)
class OutputSpec:
    """Structured output: the JSON Schema answers must match, and how often to re-ask."""

    schema: Mapping[str, Any] | None = None
    schema_file: str | None = None
    schema_model: str | None = None  # "module:Model": the Pydantic model the schema is made from (batchrun.schemas)
    name: str = "output"
    strict: bool | None = None  # None: strict when the schema allows it
    validation_retries: int = 2


@dataclass(frozen=True)
class PricingSpec:
    """``[pricing]``: USD per million tokens; unset keys fall back to the model's list price."""

    input_per_million: float | None = None
    output_per_million: float | None = None
    cached_input_per_million: float | None = None
    # Batch mode's rates; each defaults to half its online rate (the providers' batch discount).
    batch_input_per_million: float | None = None
    batch_output_per_million: float | None = None
    batch_cached_input_per_million: float | None = None


BATCH_DISCOUNT = 0.5  # batch price / online price, unless [pricing] batch_* says otherwise


class Overrides:
    """Run-time flags that win over the spec: ``--base-url``, ``--model``, and any ``[run]`` field
    by its name (``concurrency=64``, ``rpm=600``, ...). ``None`` means "not given: the spec decides".

    A new run-time override is one click option whose name is the ``[run]`` field's.
    """

    __slots__ = ("base_url", "model", "provider_kind", "run")

    def __init__(
        self,
        *,
        base_url: str | None = None,
        model: str | None = None,
        provider_kind: str | None = None,  # only for a job without a SPEC (input in a provider's batch form)
        **run: Any,
    ) -> None:
        unknown = sorted(set(run) - RUN_FIELDS)
        if unknown:
            raise TypeError(f"not a [run] field: {', '.join(unknown)}")
        self.base_url = base_url
        self.model = model
        self.provider_kind = provider_kind
        self.run: Mapping[str, Any] = MappingProxyType({k: v for k, v in run.items() if v is not None})

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> Overrides:
        """The overrides among a command's parsed flags (a flag named like a ``[run]`` field is one)."""
        return cls(
            base_url=flags.get("base_url"),
            model=flags.get("model"),
            provider_kind=flags.get("provider_kind"),
            **{name: flags[name] for name in RUN_FIELDS if flags.get(name) is not None},
        )

    def without(self, *names: str) -> Overrides:
        """These overrides less the named ``[run]`` fields (a worker's own flags are not per job)."""
        run = {k: v for k, v in self.run.items() if k not in names}
        return Overrides(base_url=self.base_url, model=self.model, provider_kind=self.provider_kind, **run)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Overrides) and all(getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __repr__(self) -> str:
        given = {n: getattr(self, n) for n in ("base_url", "model", "provider_kind") if getattr(self, n) is not None}
        return f"Overrides({', '.join(f'{k}={v!r}' for k, v in {**given, **self.run}.items())})"


@dataclass(frozen=True)
class JobSpec:
    """A checked job spec. ``source`` is the text as the user wrote it."""

    provider: ProviderSpec
    request: RequestSpec
    run: RunSpec
    output: OutputSpec = field(default_factory=OutputSpec)
    pricing: PricingSpec = field(default_factory=PricingSpec)
    batch: BatchSpec = field(default_factory=BatchSpec)
    name: str | None = None
    source: str = ""
    path: str | None = None

    @property
    def has_template(self) -> bool:
        return self.request.template is not None or bool(self.request.messages)

    def to_dict(self) -> dict[str, Any]:
        """The resolved spec as stored in the ledger."""
        data = dataclasses.asdict(self)
        data.pop("source")
        data.pop("path")
        data["request"]["messages"] = [list(m) for m in self.request.messages]
        data["request"]["extra"] = dict(self.request.extra)
        data["output"]["schema"] = dict(self.output.schema) if self.output.schema is not None else None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "", path: str | None = None) -> JobSpec:
        """A spec as :meth:`to_dict` stored it, read tolerantly: a field a later version dropped is
        ignored and one it added takes its default, so a job stored by any version still opens."""
        req = _known_fields(RequestSpec, data.get("request", {}))
        req["messages"] = tuple(tuple(m) for m in req.get("messages", ()))
        return cls(
            provider=ProviderSpec(**_known_fields(ProviderSpec, data.get("provider", {}))),
            request=RequestSpec(**req),
            run=RunSpec(**_known_fields(RunSpec, data.get("run", {}))),
            output=OutputSpec(**_known_fields(OutputSpec, data.get("output", {}))),
            pricing=PricingSpec(**_known_fields(PricingSpec, data.get("pricing", {}))),
            batch=BatchSpec(**_known_fields(BatchSpec, data.get("batch", {}))),
            name=data.get("name"),
            source=source,
            path=path,
        )

    def identity_hash(self) -> str:
        """Hash of everything that decides what is sent (not how fast, nor where the key is read from): job identity.

        A job stored under an earlier version of this hash is still found (:meth:`Ledger.find_job`
        compares the hash of its stored spec when no stored hash matches).
        """
        data = self.to_dict()
        data.pop("run")
        data.pop("batch")
        data.pop("name")
        data.pop("pricing")
        data["output"].pop("schema_file")
        data["output"].pop("schema_model")  # where the schema came from; the schema itself counts
        if data["request"]["max_input_tokens"] is None:  # unset: the hash of a job stored before the setting
            data["request"].pop("max_input_tokens")
        data["provider"].pop("api_key_file")  # where the key is read from, not what is sent
        data["provider"].pop("api_key_env")
        import hashlib  # here: commands that only read a stored spec (status) never hash one

        return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def with_overrides(self, overrides: Overrides) -> JobSpec:
        provider = self.provider
        if overrides.base_url is not None:
            _check_base_url(overrides.base_url, "--base-url")
        if overrides.base_url is not None or overrides.model is not None:
            provider = dataclasses.replace(
                provider,
                base_url=overrides.base_url.rstrip("/") if overrides.base_url else provider.base_url,
                model=overrides.model or provider.model,
            )
        run = self.run
        if overrides.run.get("budget_usd") is not None:
            _check_budget(overrides.run["budget_usd"], "--budget-usd")
        if overrides.run:
            run = dataclasses.replace(run, **overrides.run)
            _check_run(run, "command line")
        return dataclasses.replace(self, provider=provider, run=run)

    def with_output_schema(self, schema: type | Mapping[str, Any]) -> JobSpec:
        """This spec with ``schema`` as its ``[output] schema``: a Pydantic model class (its JSON Schema;
        the job's results then come back as its instances) or a JSON Schema. SpecError if it is neither."""
        from batchrun.schemas import ModelError, check_model, model_schema, remember
        from batchrun.validate import check_schema

        model = None
        try:
            if isinstance(schema, Mapping):
                schema_dict = dict(schema)
            else:
                model = remember(check_model(schema))
                schema_dict = model_schema(schema)
            check_schema(schema_dict)
        except ModelError as exc:
            raise SpecError(f"schema: {exc}") from None
        except ValueError as exc:
            raise SpecError(f"schema: not a valid JSON Schema (draft 2020-12): {exc}") from None
        output = dataclasses.replace(self.output, schema=schema_dict, schema_file=None, schema_model=model)
        return dataclasses.replace(self, output=output)

    def price(self) -> Price | None:
        """USD per million tokens for this job: [pricing] over the model's list price."""
        from batchrun.pricing import Price, price_for

        listed = price_for(self.provider.model)
        p = self.pricing
        if p.input_per_million is None and p.output_per_million is None and p.cached_input_per_million is None:
            return listed
        return Price(
            input=p.input_per_million if p.input_per_million is not None else (listed.input if listed else 0.0),
            output=p.output_per_million if p.output_per_million is not None else (listed.output if listed else 0.0),
            cached_input=p.cached_input_per_million
            if p.cached_input_per_million is not None
            else (listed.cached_input if listed else None),
        )

    def batch_price(self) -> Price | None:
        """USD per million tokens of batch mode: [pricing] batch_* rates, else half the online ones."""
        from batchrun.pricing import Price

        online = self.price()
        p = self.pricing
        if online is None and p.batch_input_per_million is None and p.batch_output_per_million is None:
            return None
        half = (online or Price(0.0, 0.0)).scaled(BATCH_DISCOUNT)
        return Price(
            input=p.batch_input_per_million if p.batch_input_per_million is not None else half.input,
            output=p.batch_output_per_million if p.batch_output_per_million is not None else half.output,
            cached_input=p.batch_cached_input_per_million
            if p.batch_cached_input_per_million is not None else half.cached_input,
        )

    def user_templates(self) -> tuple[Template | None, tuple[tuple[str, Template], ...]]:
        """Compiled (system, messages) templates; raises SpecError on bad placeholders."""
        system = Template.compile(self.request.system, where="[request] system") if self.request.system else None
        messages: list[tuple[str, Template]] = [
            (role, Template.compile(content, where=f"[request] messages[{i}]"))
            for i, (role, content) in enumerate(self.request.messages)
        ]
        if self.request.template is not None:
            messages.append(("user", Template.compile(self.request.template, where="[request] template")))
        return system, tuple(messages)


def load_spec(path: str | Path, overrides: Overrides | None = None) -> JobSpec:
    """Read and check a TOML job spec; errors name the file, the key and what was expected."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec: {exc}") from exc
    import tomllib  # here: a stored spec is JSON, and status reads only those

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    spec = parse_spec(data, where=str(path), source=text, path=str(path.resolve()), base_dir=path.parent)
    return spec.with_overrides(overrides) if overrides else spec


def spec_for_batch_input(overrides: Overrides) -> JobSpec:
    """The spec of a job submitted without one: input already in a provider's batch form.

    The lines are in the batch form of ``--provider``'s kind (the registry's default
    kind when it is not given).
    """
    if not overrides.base_url:
        raise SpecError("without a SPEC, --base-url is required (input must be in a provider's batch form)")
    kind = overrides.provider_kind or DEFAULT_KIND
    if kind not in KINDS:
        raise SpecError(f"--provider {kind!r}: expected one of {', '.join(KINDS)}")
    data: dict[str, Any] = {"provider": {"kind": kind, "base_url": overrides.base_url}}
    if overrides.model:
        data["provider"]["model"] = overrides.model
    spec = parse_spec(data, where="command line", source=orjson.dumps(data).decode())
    return spec.with_overrides(overrides)


_KNOWN = {
    "": {"name", "provider", "request", "run", "output", "pricing", "batch"},
    "pricing": {f.name for f in dataclasses.fields(PricingSpec)},
    "batch": set(BATCH_FIELDS),
    "output": {"schema", "name", "strict", "validation_retries"},
    "provider": {f.name for f in dataclasses.fields(ProviderSpec)},
    "request": {"system", "template", "messages", "max_tokens", "temperature", "extra", "max_input_tokens"},
    "run": {f.name for f in dataclasses.fields(RunSpec)},
}


def parse_spec(
    data: Mapping[str, Any],
    *,
    where: str,
    source: str = "",
    path: str | None = None,
    base_dir: Path | None = None,
) -> JobSpec:
    """Check a parsed spec mapping and build the frozen :class:`JobSpec`.

    ``base_dir`` is where a relative ``[output] schema`` file is looked up.
    """
    _check_keys(data, "", where)
    provider_t = _table(data, "provider", where)
    request_t = _table(data, "request", where)
    run_t = _table(data, "run", where)
    output_t = _table(data, "output", where)
    pricing_t = _table(data, "pricing", where)
    batch_t = _table(data, "batch", where)
    for name, table in (
        ("provider", provider_t), ("request", request_t), ("run", run_t), ("output", output_t), ("pricing", pricing_t),
        ("batch", batch_t),
    ):
        _check_keys(table, name, where)

    kind = _get(provider_t, "provider", "kind", str, where, DEFAULT_KIND)
    if kind not in KINDS:
        raise SpecError(f"{where}: [provider] kind = {kind!r}: expected one of {', '.join(KINDS)}")
    entry = provider_entry(kind)
    base_url = _get(provider_t, "provider", "base_url", str, where, None)
    if base_url is not None:
        _check_base_url(base_url, where)
    provider = ProviderSpec(
        kind=kind,
        base_url=base_url.rstrip("/") if base_url else None,
        model=_get(provider_t, "provider", "model", str, where, None),
        api_key_env=_get(provider_t, "provider", "api_key_env", str, where, entry.api_key_env),
        api_key_file=_api_key_file(provider_t, where, base_dir or Path.cwd()),
        anthropic_version=_get(provider_t, "provider", "anthropic_version", str, where, DEFAULT_ANTHROPIC_VERSION),
        convert_openai_input=_get(provider_t, "provider", "convert_openai_input", bool, where, False),
    )
    if provider.convert_openai_input and not entry.converts_openai_input:
        converting = " or ".join(f'"{e.kind}"' for e in ENTRIES if e.converts_openai_input)
        raise SpecError(f"{where}: [provider] convert_openai_input only applies to kind = {converting}")

    raw_messages = request_t.get("messages", [])
    if not isinstance(raw_messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in raw_messages
    ):
        raise SpecError(f"{where}: [request] messages: expected a list of {{role = \"...\", content = \"...\"}} tables")
    extra = request_t.get("extra", {})
    if not isinstance(extra, dict):
        raise SpecError(f"{where}: [request] extra: expected a table of extra request body fields")
    max_tokens = _get(request_t, "request", "max_tokens", int, where, None)
    if max_tokens is not None and max_tokens < 1:
        raise SpecError(f"{where}: [request] max_tokens = {max_tokens}: expected a positive integer")
    temperature = _get(request_t, "request", "temperature", float, where, None)
    max_input_tokens = _get(request_t, "request", "max_input_tokens", int, where, None)
    if max_input_tokens is not None and max_input_tokens < 0:
        raise SpecError(f"{where}: [request] max_input_tokens = {max_input_tokens}: expected a positive integer "
                        "(the model's context window), or 0 for no context guard")
    request = RequestSpec(
        system=_get(request_t, "request", "system", str, where, None),
        template=_get(request_t, "request", "template", str, where, None),
        messages=tuple((m["role"], m["content"]) for m in raw_messages),
        max_tokens=max_tokens,
        temperature=float(temperature) if temperature is not None else None,
        extra=extra,
        max_input_tokens=max_input_tokens,
    )

    defaults = RunSpec()
    run_values: dict[str, Any] = {}
    for f in dataclasses.fields(RunSpec):
        default = getattr(defaults, f.name)
        expected = _expected(default)
        value = _get(run_t, "run", f.name, expected, where, default)
        run_values[f.name] = float(value) if expected is float else value
    if run_values["service_tier"] == "flex" and "timeout" not in run_t:
        run_values["timeout"] = FLEX_TIMEOUT
    run = RunSpec(**run_values)
    _check_run(run, where)
    if "budget_usd" in run_t:
        _check_budget(run.budget_usd, f"{where}: [run] budget_usd")

    output = _parse_output(output_t, where, base_dir or Path.cwd())
    prices: dict[str, float | None] = {}
    for key in (f.name for f in dataclasses.fields(PricingSpec)):
        value = _get(pricing_t, "pricing", key, float, where, None)
        if value is not None and value < 0:
            raise SpecError(f"{where}: [pricing] {key} = {value}: expected a price >= 0 (USD per million tokens)")
        prices[key] = float(value) if value is not None else None
    pricing = PricingSpec(**prices)
    batch = _parse_batch(batch_t, where)
    name = _get(data, "", "name", str, where, None)
    spec = JobSpec(
        provider=provider, request=request, run=run, output=output, pricing=pricing, batch=batch, name=name,
        source=source, path=path,
    )
    try:
        spec.user_templates()  # compile now so placeholder errors surface at load time
    except SpecError as exc:
        raise SpecError(f"{where}: {exc.message}") from exc
    return spec


def _expected(default: Any) -> type:
    """The TOML type of a setting, from its default's."""
    return bool if isinstance(default, bool) else int if isinstance(default, int) else str if isinstance(default, str) else float


_DURATIONS = frozenset({"deadline", "poll_interval", "poll_max", "create_timeout"})  # [batch] keys that also take "6h", "90s"


def _parse_batch(table: Mapping[str, Any], where: str) -> BatchSpec:
    from batchrun.ratelimit import parse_reset

    defaults = BatchSpec()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(BatchSpec):
        default = getattr(defaults, f.name)
        raw = table.get(f.name, default)
        if f.name in _DURATIONS and isinstance(raw, str):
            seconds = parse_reset(raw.strip()) if raw.strip() else 0.0
            if seconds is None:
                raise SpecError(f"{where}: [batch] {f.name} = {raw!r}: expected seconds or a duration such as 90s, 30m, 6h")
            values[f.name] = float(seconds)
            continue
        expected = _expected(default)
        value = _get(table, "batch", f.name, expected, where, default)
        values[f.name] = float(value) if expected is float else value
    batch = BatchSpec(**values)
    for key in ("max_requests", "max_bytes", "enqueued_tokens", "deadline", "create_timeout"):
        if getattr(batch, key) < 0:
            raise SpecError(f"{where}: [batch] {key} = {getattr(batch, key)}: expected a number >= 0 (0: no limit)")
    for key in ("poll_interval", "poll_max"):
        if not getattr(batch, key) > 0:
            raise SpecError(f"{where}: [batch] {key} = {getattr(batch, key)}: expected a number of seconds > 0")
    if batch.reask not in REASK_ROUTES:
        raise SpecError(f"{where}: [batch] reask = {batch.reask!r}: expected one of {', '.join(REASK_ROUTES)}")
    return batch


def _parse_output(table: Mapping[str, Any], where: str, base_dir: Path) -> OutputSpec:
    from batchrun.validate import check_schema

    retries = _get(table, "output", "validation_retries", int, where, 2)
    if retries < 0:
        raise SpecError(f"{where}: [output] validation_retries = {retries}: expected an integer >= 0")
    name = _get(table, "output", "name", str, where, "output")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise SpecError(f"{where}: [output] name = {name!r}: expected 1-64 letters, digits, _ or -")
    strict = table.get("strict", "auto")
    if strict not in (True, False, "auto"):
        raise SpecError(f"{where}: [output] strict = {strict!r}: expected true, false or \"auto\"")
    raw = table.get("schema")
    schema_file: str | None = None
    if raw is None:
        return OutputSpec(name=name, validation_retries=retries, strict=None if strict == "auto" else strict)
    schema_model: str | None = None
    if isinstance(raw, str) and _is_model_ref(raw):
        schema, schema_model = _model_schema(raw, where, base_dir), raw
    elif isinstance(raw, str):
        schema_path = (base_dir / raw).resolve()
        schema_file = str(schema_path)
        try:
            schema = orjson.loads(schema_path.read_bytes())
        except FileNotFoundError:
            raise SpecError(f"{where}: [output] schema = {raw!r}: no such file {schema_path}") from None
        except OSError as exc:
            raise SpecError(f"{where}: [output] schema = {raw!r}: cannot read {schema_path}: {exc}") from exc
        except orjson.JSONDecodeError as exc:
            raise SpecError(f"{where}: [output] schema = {raw!r}: {schema_path} is not valid JSON: {exc}") from None
    elif isinstance(raw, Mapping):
        schema = dict(raw)
    else:
        raise SpecError(f"{where}: [output] schema: expected a file name or an inline table, got {type(raw).__name__}")
    label = schema_file or "[output] schema"
    try:
        check_schema(schema)
    except ValueError as exc:
        raise SpecError(f"{where}: {label}: not a valid JSON Schema (draft 2020-12): {exc}") from None
    return OutputSpec(
        schema=schema,
        schema_file=schema_file,
        schema_model=schema_model,
        name=name,
        strict=None if strict == "auto" else strict,
        validation_retries=retries,
    )


def _is_model_ref(raw: str) -> bool:
    from batchrun.schemas import is_model_ref

    return is_model_ref(raw)


def _model_schema(ref: str, where: str, base_dir: Path) -> dict[str, Any]:
    """The JSON Schema of the Pydantic model ``[output] schema = "module:Model"`` names (the spec's folder on the path)."""
    from batchrun.schemas import ModelError, import_model, model_schema

    try:
        return model_schema(import_model(ref, [base_dir]))
    except ModelError as exc:
        raise SpecError(f"{where}: [output] schema = {ref!r}: {exc}") from None


def _check_base_url(base_url: str, where: str) -> None:
    import httpx

    problem = None
    if not base_url.startswith(("http://", "https://")):
        problem = "expected an http:// or https:// URL"
    else:
        try:
            url = httpx.URL(base_url)
            if not url.host:
                problem = "it has no host"
            elif url.port is not None and not 0 < url.port < 65536:
                problem = f"port {url.port} is out of range"
        except httpx.InvalidURL as exc:
            problem = f"not a valid URL ({exc})"
    if problem:
        raise SpecError(f"{where}: [provider] base_url = {base_url!r}: {problem}")


_RUN_MAXIMA = {
    "concurrency": 10_000,
    "max_attempts": 1_000,
    "max_line_bytes": 1 << 30,
    "timeout": 86_400.0,
    "connect_timeout": 3_600.0,
    "lease_seconds": 86_400.0,
}


def _check_run(run: RunSpec, where: str) -> None:
    for key, value in dataclasses.asdict(run).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SpecError(f"{where}: [run] {key} = {value}: expected a finite number")
        if key in _RUN_MAXIMA and value > _RUN_MAXIMA[key]:
            raise SpecError(f"{where}: [run] {key} = {value}: expected at most {_RUN_MAXIMA[key]:g}")
    for key in ("concurrency", "max_attempts", "max_line_bytes"):
        if getattr(run, key) < 1:
            raise SpecError(f"{where}: [run] {key} = {getattr(run, key)}: expected an integer >= 1")
    for key in ("timeout", "connect_timeout", "lease_seconds", "outage_seconds", "connect_grace"):
        if getattr(run, key) <= 0:
            raise SpecError(f"{where}: [run] {key} = {getattr(run, key)}: expected a number of seconds > 0")
    for key in ("grace_seconds", "hang_factor", "hang_min_seconds", "rpm", "tpm", "max_runtime"):
        if getattr(run, key) < 0:
            raise SpecError(f"{where}: [run] {key} = {getattr(run, key)}: expected a number >= 0")
    if run.mode not in MODES:
        raise SpecError(f"{where}: [run] mode = {run.mode!r}: expected one of {', '.join(MODES)}")


def _check_budget(value: float, where: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise SpecError(f"{where} = {value}: expected a total in USD > 0 (leave it out for no budget)")


def _table(data: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise SpecError(f"{where}: [{name}] expected a table, got {type(table).__name__}")
    return table


def _check_keys(table: Mapping[str, Any], section: str, where: str) -> None:
    unknown = sorted(set(table) - _KNOWN[section])
    if unknown:
        label = f"[{section}] " if section else ""
        raise SpecError(
            f"{where}: {label}unknown key {unknown[0]!r}; expected one of {', '.join(sorted(_KNOWN[section]))}"
        )


def _api_key_file(table: Mapping[str, Any], where: str, base_dir: Path) -> str | None:
    """``[provider] api_key_file`` as an absolute path (``~`` expanded, relative to the spec's folder);
    it replaces ``api_key_env``, so the two together are an error. The file is read when the key is."""
    raw = _get(table, "provider", "api_key_file", str, where, None)
    if raw is None:
        return None
    if "api_key_env" in table:
        raise SpecError(f"{where}: [provider] api_key_file and api_key_env both say where the key is: keep one")
    if not raw.strip():
        raise SpecError(f'{where}: [provider] api_key_file = "": give the path of a file holding the key')
    return str((base_dir / Path(raw).expanduser()).resolve())


def _get(table: Mapping[str, Any], section: str, key: str, expected: type, where: str, default: Any) -> Any:
    if key not in table:
        return default
    value = table[key]
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        label = f"[{section}] " if section else ""
        kind = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}[expected]
        raise SpecError(f"{where}: {label}{key} = {value!r}: expected {kind}")
    return value
