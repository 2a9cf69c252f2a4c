"""The ``batchrun`` command line: parse, call one library function, render.

Every command that touches a ledger takes ``--db`` (or ``BATCHRUN_DB``); a
plain path is a SQLite file. Exit codes are those of DESIGN.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import orjson

from batchrun import interrupt
from batchrun.errors import BatchrunError, LedgerWriteError, StoppedError, UsageError
from batchrun.eventloop import run_sync
from batchrun.formats import FORMATS, INPUT_FORMATS, MODES
from batchrun.ledger.basics import (
    RETRY_FILTERS,
    SHOW_FILTERS,
    database_error_line,
    default_db_path,
    is_database_error,
    resolve_db_url,
)
from batchrun.provider_registry import DEFAULT_KIND, KINDS
from batchrun.redact import RedactingFilter, redact
from batchrun.states import ALL_STATES, USER_RETRYABLE_STATES, ExitCode, StopReason

if TYPE_CHECKING:
    from batchrun.batch import BatchOptions
    from batchrun.ledger import Ledger, StatusReader
    from batchrun.spec import JobSpec, Overrides
    from batchrun.jobs import DryRun, PreparedJob
    from batchrun.submission import OnStart, SubmitResult

# The run machinery (httpx, aiohttp, tenacity) is imported only by the commands that send
# requests, and the ledger stack (SQLAlchemy) only where a ledger is opened, so --help,
# status, list and export start fast (tests/unit/test_startup.py keeps it so).

F = TypeVar("F", bound=Callable[..., Any])
# Commands that keep SIGINT/SIGTERM held from start-up (batchrun/interrupt.py): they store, send or
# write, and a signal stops them at a clean point with exit 75. The others get the usual behaviour.
RUN_COMMANDS = frozenset({"submit", "resume", "worker", "export", "demo"})


def _fail(exc: BatchrunError) -> None:
    # A stop is not an error: it says where it stopped and how to carry on.
    label = "" if isinstance(exc, StoppedError) else "error: "
    click.echo(f"batchrun: {label}{redact(exc.message)}", err=True)
    sys.exit(exc.exit_code)


def handle_errors(fn: F) -> F:
    """Our own errors become a one-line message and their exit code; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BatchrunError as exc:
            _fail(exc)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            # The database went away past what a command rides out (a PostgreSQL restart during an
            # export, a full disk): what was committed is safe, the command can simply be run again.
            _fail(LedgerWriteError(f"the ledger failed: {database_error_line(exc)}; nothing committed is lost: "
                                   "run the same command again when the database is back"))

    return wrapper  # type: ignore[return-value]


db_option = click.option(
    "--db",
    envvar="BATCHRUN_DB",
    default=None,
    metavar="URL",
    help=f"Ledger: a SQLite file path or a SQLAlchemy URL (postgresql+psycopg://...). "
    f"Default: $BATCHRUN_DB, else {default_db_path()}.",
)


provider_option = click.option(
    "--provider", "provider_kind", type=click.Choice(list(KINDS)), default=None,
    help=f"Without a SPEC: the API the batch lines are for (default {DEFAULT_KIND}).",
)


def override_options(fn: F) -> F:
    """The run-time overrides of the spec shared by submit and resume."""
    for option in reversed(
        [
            click.option("--base-url", default=None, help="Override [provider] base_url."),
            click.option("--model", default=None, help="Override [provider] model."),
            click.option("--concurrency", type=click.IntRange(min=1), default=None, help="Max requests in flight."),
            click.option("--max-attempts", type=click.IntRange(min=1), default=None, help="Max attempts per item."),
            click.option("--timeout", type=click.FloatRange(min=0.001), default=None, help="Total seconds per attempt."),
            click.option("--rpm", type=click.FloatRange(min=0), default=None, help="Requests per minute for the job (0: no limit)."),
            click.option("--max-runtime", type=Duration(allow_zero=True), default=None,
                         help="Stop cleanly after this long (e.g. 30m, 2h): exit 75 with work left, resume later. "
                         "For this run only (never stored with the job); 0: no limit, even over the spec's "
                         "[run] max_runtime."),
            click.option("--tpm", type=click.FloatRange(min=0), default=None, help="Tokens per minute for the job (0: no limit)."),
            click.option("--budget-usd", type=click.FloatRange(min=0, min_open=True), default=None, metavar="USD",
                         help="The job's total spend cap in USD (overrides [run] budget_usd). Each request "
                         "reserves its worst case before it is sent; at the cap the run stops with exit 4 "
                         "(resume with a larger total)."),
            click.option("--no-cache", "no_cache", is_flag=True,
                         help="Send every item, even one whose request (same API, URL and body) another job "
                         "already got an answer to (overrides [run] cache). Answers are still filed for later runs."),
            click.option("--transport", type=click.Choice(["aiohttp", "httpx"]), default="aiohttp", hidden=True),
            click.option("--quiet", "-q", is_flag=True, help="No progress display on stderr."),
            click.option("--log-file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
                         help="Append JSON lines to FILE: every log record, and (submit/resume) a progress record each interval."),
            click.option("--progress-interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                         metavar="SECONDS", help="How often progress is logged when not on a terminal (and to --log-file)."),
        ]
    ):
        fn = option(fn)
    return fn


def mode_options(fn: F) -> F:
    """Batch mode's flags, on submit and resume."""
    fn = click.option(
        "--wait/--no-wait", "wait", default=None,
        help="Batch mode: wait for the provider's batches to end (default on a terminal), or exit 75 once "
        "everything is at the provider; a later `batchrun resume JOB` collects it.",
    )(fn)
    return click.option(
        "--mode", type=click.Choice(MODES), default=None,
        help="online: one request per attempt; batch: through the provider's batch API at the batch price "
        "(overrides [run] mode; a job may switch on resume).",
    )(fn)


def _batch_options(command: str, wait: bool | None, quiet: bool) -> BatchOptions:
    """How a batch-mode run of this command behaves: wait on a terminal (or as told); its events on stderr."""
    from batchrun.batch import BatchOptions

    return BatchOptions(
        command=command, wait=sys.stderr.isatty() if wait is None else wait,
        on_event=None if quiet else lambda message: click.echo(f"batchrun: {message}", err=True),
    )


def _overrides(kw: dict[str, Any]) -> Overrides:
    from batchrun.spec import Overrides

    return Overrides.from_flags({**kw, "cache": False if kw.get("no_cache") else None})


def _job_spec(spec: str | None, overrides: Overrides) -> JobSpec:
    """The spec file with the flags over it, or without one the spec the flags make for batch lines."""
    from batchrun.spec import load_spec, spec_for_batch_input

    return load_spec(spec, overrides) if spec else spec_for_batch_input(overrides)


class Duration(click.ParamType):  # type: ignore[type-arg]
    """``90``, ``90s``, ``30m``, ``1h30m``: seconds (``0``/``0s`` too, with ``allow_zero``)."""

    name = "duration"

    def __init__(self, *, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        from batchrun.ratelimit import parse_reset

        seconds = parse_reset(str(value).strip())
        if seconds is None or seconds < 0 or (seconds == 0 and not self.allow_zero):
            self.fail(f"{value!r} is not a duration (e.g. 90s, 30m, 2h, 1h30m)", param, ctx)
        return seconds


def _open(db: str | None, *, existing: bool = False) -> Ledger:
    """The ledger; ``existing``: a command that needs a job refuses a SQLite file that does not exist
    (instead of creating an empty ledger only to say the job is not there)."""
    if existing:
        _refuse_missing(db)
    from batchrun.ledger import Ledger

    return Ledger.open(db)


def _refuse_missing(db: str | None) -> None:
    url = resolve_db_url(db)
    path = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
    if path is not None and not path.exists():
        raise UsageError(f"no ledger at {path}: the file does not exist (nothing was created); "
                         "name the job's ledger with --db PATH or BATCHRUN_DB")


@contextlib.contextmanager
def _read_only(db: str | None) -> Iterator[Ledger | StatusReader]:
    """What ``status`` and ``list`` read: a SQLite ledger at the schema head through the quick reader
    (the stdlib's sqlite3, read-only: no SQLAlchemy to import), any other through the ledger."""
    _refuse_missing(db)
    from batchrun.ledger.quick import open_quick_reader

    quick = open_quick_reader(db)
    if quick is not None:
        with quick:
            yield quick
        return
    with _open(db, existing=True) as ledger:
        yield ledger


def _apply_log_level(ctx: click.Context) -> None:
    """The stderr log level from every ``-v``/``-q`` seen so far, before or after the subcommand."""
    meta = ctx.find_root().meta
    verbose, quiet = meta.get("batchrun.verbose", 0), meta.get("batchrun.quiet", False)
    logging.getLogger().setLevel(logging.ERROR if quiet and not verbose else logging.WARNING - 10 * min(verbose, 2))


def _count_verbose(ctx: click.Context, param: click.Parameter, value: int) -> None:
    if value:
        meta = ctx.find_root().meta
        meta["batchrun.verbose"] = meta.get("batchrun.verbose", 0) + value
        _apply_log_level(ctx)


def _note_quiet(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().meta["batchrun.quiet"] = True
        _apply_log_level(ctx)


def _verbosity_params(own: list[click.Parameter]) -> list[click.Parameter]:
    """The group's ``-v``/``-q`` for a subcommand's own line (hidden in its --help), except where the
    subcommand has an option of that name itself (submit's ``-q``: no progress display).

    Parsed by click like any option, so a value that happens to read ``-q`` (``--output -q``) stays a value.
    """
    taken = {opt for param in own for opt in (*param.opts, *param.secondary_opts)}
    params: list[click.Parameter] = []
    if not taken & {"-v", "--verbose"}:
        params.append(click.Option(["-v", "--verbose", "batchrun_verbose"], count=True, expose_value=False,
                                   hidden=True, callback=_count_verbose))
    if not taken & {"-q", "--quiet"}:
        params.append(click.Option(["-q", "--quiet", "batchrun_quiet"], is_flag=True, expose_value=False,
                                   hidden=True, callback=_note_quiet))
    return params


class BatchrunCommand(click.Command):
    """A subcommand: also takes the group's ``-v``/``-q`` after its name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(_verbosity_params(self.params))


class BatchrunGroup(click.Group):
    """The ``batchrun`` group: usage errors in our one-line style; ``-v``/``-q`` after a subcommand too."""

    command_class = BatchrunCommand
    group_class = type  # `batchrun db ...` is one of ours too

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.extend(_verbosity_params(self.params))

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            self._main(args, prog_name, complete_var, **extra)
        except SystemExit as exc:
            _log_run_ended(exc.code)
            raise

    def _main(self, args: Sequence[str] | None, prog_name: str | None, complete_var: str | None,
              **extra: Any) -> None:
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "batchrun"
            message = exc.format_message().rstrip(".")
            click.echo(f"batchrun: error: {message[:1].lower() + message[1:]} (see: {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"batchrun: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("batchrun: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=BatchrunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, expose_value=False, callback=_count_verbose,
              help="More log output (-v info, -vv debug); also after the command.")
@click.option("-q", "--quiet", "quiet_logs", is_flag=True, expose_value=False, callback=_note_quiet,
              help="Log errors only; also after the command (where a command has its own -q, that one).")
@click.version_option(package_name="batchrun")
def main() -> None:
    """Resumable batch jobs over LLM APIs, with a ledger that never pays twice.

    \b
    Quick start (local fake endpoint, nothing leaves this machine):
      batchrun demo
    A real job:
      batchrun submit jobs/summarize.toml --input jobs/summarize.jsonl --output results.jsonl
      batchrun status
      batchrun resume 1            # after a crash, kill -9 or Ctrl-C

    Exit codes: 0 all succeeded, 1 some failed/invalid/rejected, 2 usage/spec/input
    error (nothing sent), 3 authentication refused or every request refused the same
    way (wrong model, path or parameter; items left pending), 4 budget reached, 75
    stopped early with work left (resume later).
    """
    if not interrupt.held():
        interrupt.reset()  # in-process (tests): each invocation starts with no signal seen
    if click.get_current_context().invoked_subcommand not in RUN_COMMANDS:
        interrupt.release()
    logging.basicConfig(format="batchrun: %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
    _apply_log_level(click.get_current_context())


def _log_to_file(path: str | None) -> None:
    """``--log-file``: JSON lines of every batchrun log record at INFO and above (DEBUG with -vv)."""
    if not path:
        return
    from batchrun.progress import JsonLinesFormatter

    try:
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--log-file {path}: cannot open: {exc.strerror or exc}") from None
    handler.setFormatter(JsonLinesFormatter())
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    handler.setLevel(min(root.level, logging.INFO))
    # The stderr handler keeps the -v level; the package logs INFO so the file gets it.
    for existing in root.handlers:
        if existing.level == logging.NOTSET:
            existing.setLevel(root.level)
    logging.getLogger("batchrun").setLevel(min(root.level, logging.INFO))
    root.addHandler(handler)
    global _run_log
    _run_log = handler
    command = click.get_current_context().command_path.split()[-1]
    logging.getLogger("batchrun.cli").info(
        "run_started", extra={"run": {"event": "run_started", "command": command, "pid": os.getpid()}})


_run_log: logging.Handler | None = None  # --log-file's handler once opened: the run_ended record goes there


def _log_run_ended(code: object) -> None:
    """``--log-file``: the last record of an invocation, with its exit code."""
    if _run_log is None or _run_log not in logging.getLogger().handlers:
        return
    exit_code = code if isinstance(code, int) else (0 if code is None else 1)
    logging.getLogger("batchrun.cli").info(
        "run_ended", extra={"run": {"event": "run_ended", "exit_code": exit_code, "pid": os.getpid()}})


def _progress(quiet: bool, log_file: str | None = None, interval: float = 10.0) -> OnStart | None:
    """The run's progress display on stderr (and its records for ``--log-file``), unless quiet."""
    if quiet and not log_file:
        return None
    from batchrun.progress import show_progress

    return lambda runner, todo: show_progress(runner, todo, interval=interval, quiet=quiet)


def _show_prepared(input_path: str) -> Callable[[PreparedJob], None]:
    """Before the run: the job id on the first line of stdout, and some of the rejected lines."""

    def show(prepared: PreparedJob) -> None:
        click.echo(str(prepared.job_id))
        _show_rejected(prepared, input_path)
        if not prepared.created:
            click.echo(f"batchrun: carrying on job {prepared.job_id} (same spec and input)", err=True)

    return show


def _show_rejected(prepared: PreparedJob | None, input_path: str) -> None:
    """Some of the lines an ingest rejected (before the run, or after it when it read beside the run)."""
    if prepared and prepared.ingest and prepared.ingest.rejected:
        click.echo(f"batchrun: {prepared.ingest.rejected} bad input lines were rejected, e.g.:", err=True)
        for line, reason in prepared.ingest.rejections[:3]:
            click.echo(f"  {input_path}:{line}: {reason}", err=True)


def _show_result(result: SubmitResult, *, as_json: bool, ledger_url: str) -> None:
    """How a submit or resume ended, then its exit code; a hint to carry on names the ledger."""
    from batchrun.hints import command

    exported = result.export
    if as_json:
        click.echo(orjson.dumps(result.to_json()).decode())
    elif result.ran:
        click.echo(
            (" ".join(f"{state}={n}" for state, n in result.counts.items() if n) or "no items")
            + (f" ({result.cached} succeeded from the response cache)" if result.cached else "")
        )
        if exported:
            click.echo(f"output: {exported.path} ({exported.lines} lines)")
            if exported.errors_path:
                click.echo(f"errors: {exported.errors_path} ({exported.error_lines} lines)")
    if result.stop_message:
        click.echo(f"batchrun: {result.stop_message}", err=True)
    if result.error is not None:
        _fail(result.error)
    if result.exit_code == ExitCode.TEMPFAIL:
        click.echo(f"batchrun: job {result.job_id} has work left; carry on with: "
                   f"{command(ledger_url, 'resume', result.job_id)}", err=True)
    if result.stop_reason == StopReason.CANCELLED:
        click.echo(f"batchrun: to send the cancelled items after all: "
                   f"{command(ledger_url, 'retry', result.job_id, '--state', 'cancelled')} && "
                   f"{command(ledger_url, 'resume', result.job_id)}", err=True)
    if result.exit_code == ExitCode.AUTH:
        click.echo(f"batchrun: job {result.job_id}'s items are pending; once that is fixed, carry on with: "
                   f"{command(ledger_url, 'resume', result.job_id)}", err=True)
    if result.exit_code == ExitCode.BUDGET:
        click.echo(
            f"batchrun: job {result.job_id} has work left; carry on with a larger total budget: "
            f"{command(ledger_url, 'resume', result.job_id, '--budget-usd', 'AMOUNT')}",
            err=True,
        )
    sys.exit(result.exit_code)


@main.command()
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Input file: JSONL, or .csv / .parquet (a row a record); - for standard input.")
@click.option("--input-format", type=click.Choice(INPUT_FORMATS), default=None,
              help="What --input - holds (default jsonl); a file's format is its suffix.")
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Export here when the job finishes; the job remembers it (with --format and --errors), "
              "so a later `batchrun resume JOB` writes the same file.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None, help="Format of --output (default: results).")
@click.option("--errors", default=None, type=click.Path(dir_okay=False), help="Also write failed/invalid/rejected items here.")
@click.option("--force", is_flag=True, help="Replace an output file that is not this job's own export.")
@click.option("--new", is_flag=True, help="Always create a new job, even if this spec and input were submitted before.")
@click.option("--strict", is_flag=True, help="Refuse the whole input if any line is bad (nothing is sent).")
@click.option("--allow-empty", is_flag=True,
              help="Accept an empty input (a job with no items, exit 0); without it an empty input exits 2.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (job_id, total, counts, ...) at the end.")
@provider_option
@click.option("--dry-run", is_flag=True,
              help="Read and render the whole input, print item and rejected counts, a token estimate and a cost "
              "range; send nothing and create no job (the ledger is not opened).")
@click.option("--no-run", is_flag=True,
              help="Only store the job and its items (exit 0); `batchrun worker` processes work it.")
@db_option
@override_options
@mode_options
@handle_errors
def submit(spec: str | None, input_path: str, output: str | None, fmt: str | None, errors: str | None, force: bool,
           new: bool, strict: bool, allow_empty: bool, as_json: bool, dry_run: bool, no_run: bool, db: str | None, quiet: bool, transport: str,
           wait: bool | None, **kw: Any) -> None:
    """Submit INPUT under job SPEC and work it to the end.

    The same SPEC and input content find the existing job and carry it on
    (nothing finished is sent again); --new forces a new job. Without a SPEC,
    the input must be batch lines of one provider (OpenAI Batch API lines by
    default; Anthropic Message Batches lines with --provider anthropic) and
    --base-url is required. The API key variable the spec names ([provider]
    api_key_env) must be set, else exit 2 before anything is stored or sent
    (api_key_env = "": a server that needs no key).

    An item whose request (same API, URL and body) already succeeded in any
    job of the ledger is not sent: the response cache reuses its answer at no
    cost, marked "cached" in the results (--no-cache sends everything). So
    yesterday's file plus new records, submitted tonight, pays only for the
    new records.

    \b
    Examples:
      batchrun submit jobs/summarize.toml --input jobs/summarize.jsonl --output out.jsonl
      batchrun submit --input batch.jsonl --base-url http://127.0.0.1:8000/v1 --model gpt-4o-mini
      batchrun submit --input claude.jsonl --provider anthropic --base-url https://api.anthropic.com
      batchrun submit jobs/summarize.toml --input jobs/summarize.jsonl --dry-run
      batchrun submit jobs/summarize.toml --input jobs/summarize.jsonl --budget-usd 5
      batchrun submit jobs/summarize.toml --input day2.jsonl       # day 1's records reused
    """
    if input_path != "-" and not dry_run:
        from batchrun.input_hash import start_hashing

        start_hashing(input_path)  # the job's identity, hashed on a thread beside the imports below
    from batchrun.scheduler import RunOptions
    from batchrun.submission import submit as submit_job

    overrides = _overrides(kw)
    # The job keeps its spec as written (and the run-time overrides that shape it); --max-runtime is
    # this invocation's only: a later resume must not stop after the same time.
    stored = overrides.without("max_runtime")
    job_spec = _job_spec(spec, stored)
    input_path = _input_file(input_path, kw.get("input_format"), db)
    if dry_run:
        from batchrun.jobs import dry_run as estimate

        interrupt.release()  # stores and sends nothing: Ctrl-C just ends it
        _show_dry_run(estimate(job_spec, input_path, strict=strict), as_json=as_json)
        return
    _log_to_file(kw.get("log_file"))
    prepared: list[PreparedJob] = []  # the job once stored, shown before the run
    show_prepared = _show_prepared(input_path)

    def on_prepared(job: PreparedJob) -> None:
        prepared.append(job)
        show_prepared(job)

    with _open(db) as ledger:
        result = submit_job(
            ledger, job_spec, input_path, output=output, fmt=fmt, errors=errors, force=force, new=new, strict=strict,
            run=not no_run, overrides=overrides, options=RunOptions(command="submit", transport=transport),
            batch=_batch_options("submit", wait, quiet or as_json),
            handle_signals=True, require_key=True, on_prepared=None if as_json else on_prepared,
            on_start=_progress(quiet or as_json, kw.get("log_file"), kw["progress_interval"]),
            allow_empty=allow_empty,
        )
    if prepared and prepared[0].ingest is None:  # the input was read beside the run
        _show_rejected(result.prepared, input_path)
    _show_result(result, as_json=as_json, ledger_url=ledger.url)


def _input_file(input_path: str, input_format: str | None, db: str | None) -> str:
    """``--input``: the file, or for ``-`` standard input spooled to a file in the ledger's folder
    (batchrun/spool.py), so that the same input finds the same job."""
    from batchrun.tabular import input_format as format_of

    if input_path != "-":
        if input_format is not None and input_format != format_of(input_path):
            raise UsageError(f"--input-format {input_format}: {input_path} is read as {format_of(input_path)} "
                             "(by its suffix); --input-format is for --input -")
        return input_path
    from batchrun.ledger import resolve_db_url
    from batchrun.spool import spool_dir, spool_stream

    return str(spool_stream(spool_dir(resolve_db_url(db)), sys.stdin.buffer, input_format or "jsonl"))


def _show_dry_run(report: DryRun, *, as_json: bool) -> None:
    from batchrun.budget import usd

    if as_json:
        click.echo(orjson.dumps(report.to_json()).decode())
        return
    click.echo("dry run: nothing was sent and no job was created")
    click.echo(
        f"  input     {report.input_path}: {report.lines} lines, {report.to_send} items to send, "
        f"{report.rejected} rejected"
    )
    for line, reason in report.rejections:
        click.echo(f"              {report.input_path}:{line}: {reason}")
    if report.rejected > len(report.rejections):
        click.echo(f"              ... and {report.rejected - len(report.rejections)} more")
    click.echo(f"  model     {report.model or '(as in each input line)'}")
    guess = " (no max_tokens set: the provider's default guess)" if report.unbounded_answers else " (max_tokens)"
    if report.to_send and report.prompt_counted == report.to_send:
        how = f"{report.prompt_tokens:,} prompt (counted with tiktoken)"
    elif report.prompt_counted:
        how = (f"~{report.prompt_tokens:,} prompt ({report.prompt_counted:,} of {report.to_send:,} requests counted "
               "with tiktoken, the rest estimated from request size)")
    else:
        how = f"~{report.prompt_tokens:,} prompt (estimated from request size)"
    click.echo(f"  tokens    {how}, up to {report.max_output_tokens:,} output{guess}")
    price = report.price
    if report.cost_min is None or report.cost_max is None:
        models = ", ".join(sorted(report.unpriced_models))
        click.echo(
            f"  cost      unknown: {report.unpriced} requests have no price (model {models}); "
            "add a [pricing] table to the spec"
        )
        return
    rate = f"${price.input:g} in / ${price.output:g} out per million tokens" if price else "each model's list price"
    click.echo(
        f"  cost      {usd(report.cost_min)} (prompts only) to {usd(report.cost_max)} (every answer at its limit), "
        f"at {rate}"
    )
    if report.mode == "batch":
        click.echo(
            f"  batch     {usd(report.batch_min_usd)} to {usd(report.batch_max_usd)} through the provider's batch API "
            "([run] mode = \"batch\": the batch price, answers within 24 h)"
        )
    if report.budget_usd > 0:
        verdict = (
            "the whole input fits even at the maximum" if report.cost_max <= report.budget_usd
            else "the run stops with exit 4 if the spend reaches it; resume with a larger --budget-usd"
        )
        click.echo(f"  budget    {usd(report.budget_usd)}: {verdict}")


@main.command()
@click.argument("job", type=int)
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Export here when the job finishes. Default: where the job was last told to export "
              "(submit or resume --output), with its --format and --errors.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Format of the output (default: the remembered one, else results).")
@click.option("--errors", default=None, type=click.Path(dir_okay=False),
              help="Also write failed/invalid/rejected items here (default: the remembered errors file).")
@click.option("--force", is_flag=True, help="Replace an output file that is not this job's own export.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
@db_option
@override_options
@mode_options
@handle_errors
def resume(job: int, output: str | None, fmt: str | None, errors: str | None, force: bool, as_json: bool,
           db: str | None, quiet: bool, transport: str, wait: bool | None, **kw: Any) -> None:
    """Carry on JOB: pending items and those a dead run left running. Finished items are never sent again.

    When the job finishes it is exported where it was last told to (submit or
    resume --output, with that --format and --errors); an explicit --output wins.

    \b
    Examples:
      batchrun resume 3
      batchrun resume 3 --output results.jsonl
      batchrun resume 3 --budget-usd 20     # after exit 4: the job's new total budget
    """
    from batchrun.scheduler import RunOptions
    from batchrun.submission import resume as resume_job

    _log_to_file(kw.get("log_file"))
    with _open(db, existing=True) as ledger:
        result = resume_job(
            ledger, job, output=output, fmt=fmt, errors=errors, force=force, overrides=_overrides(kw),
            options=RunOptions(command="resume", transport=transport), handle_signals=True, require_key=True,
            batch=_batch_options("resume", wait, quiet or as_json),
            on_start=_progress(quiet or as_json, kw.get("log_file"), kw["progress_interval"]),
        )
    _show_result(result, as_json=as_json, ledger_url=ledger.url)


def _latest_job(ledger: Ledger | StatusReader) -> int:
    listed = ledger.list_jobs()
    if not listed:
        raise UsageError(f"no jobs in ledger {ledger.url}")
    return listed[-1][0].id


@main.command(short_help="Counts, latency, cost and errors of a job (--watch).")
@click.argument("job", type=int, required=False)
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: job_id, total, counts, latency, queue wait, TTFT, tokens, cost, errors. "
              "With --watch, one object a line.")
@click.option("--watch", is_flag=True, help="Refresh until the job is done or Ctrl-C (the job itself carries on).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, metavar="S",
              help="Seconds between refreshes with --watch.")
@db_option
@handle_errors
def status(job: int | None, as_json: bool, watch: bool, interval: float, db: str | None) -> None:
    """Counts by state, throughput, latency/queue wait/TTFT percentiles, tokens, cost and errors of JOB.

    JOB defaults to the newest job. --watch redraws in place on a terminal and
    prints one line per interval otherwise (cron, pipes); it ends when the job
    is done (exit 0) or on Ctrl-C (exit 130).

    \b
    Examples:
      batchrun status 3 --json
      batchrun status 3 --watch --interval 5
    """
    from batchrun.report import job_status, status_lines, watch_status

    if watch:
        with _open(db, existing=True) as ledger:
            job_id = job if job is not None else _latest_job(ledger)
            mode = "json" if as_json else "live" if sys.stdout.isatty() else "line"
            try:
                watch_status(ledger, job_id, interval=interval, out=sys.stdout, mode=mode)
            except KeyboardInterrupt:
                sys.exit(130)  # the shell's code for Ctrl-C; the job itself is untouched
            return
    with _read_only(db) as reader:
        data = job_status(reader, job if job is not None else _latest_job(reader))
        ledger_url = reader.url
    if as_json:
        click.echo(orjson.dumps(data).decode())
        return
    click.echo("\n".join(status_lines(data, ledger_url=ledger_url)))


@main.command(short_help="A job's full report (--html: a page with charts).")
@click.argument("job", type=int)
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="Write one self-contained HTML page (no external assets) with charts instead of the text report.")
@click.option("--force", is_flag=True, help="Replace an existing --html file that is not a batchrun report.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: status --json's keys plus latency_split, ttft_histogram and the histograms.")
@db_option
@handle_errors
def report(job: int, html_path: str | None, force: bool, as_json: bool, db: str | None) -> None:
    """A full report of JOB: states, throughput, latency, queue wait and TTFT percentiles,
    where clean answers' time went (P50/P99 of queue wait, time to first byte, time to last
    byte), a TTFT histogram of streamed answers, tokens, cost, errors by class and by HTTP
    status with an example message, and items by number of requests.

    With --html FILE, instead one page that opens in any browser: latency and TTFT
    histograms, throughput over time and the same tables (stdout: its path).

    \b
    Examples:
      batchrun report 3
      batchrun report 3 --json
      batchrun report 3 --html report-3.html
    """
    from rich.console import Console

    from batchrun.html_report import render_html
    from batchrun.report import job_report, render_report, write_html_report

    with _open(db, existing=True) as ledger:
        data = job_report(ledger, job)
    if html_path:  # the page instead of the text report
        click.echo(f"html: {write_html_report(html_path, render_html(data), force=force)}")
        return
    if as_json:
        click.echo(orjson.dumps(data).decode())
        return
    render_report(data, Console(highlight=False))


@main.command(short_help="Two jobs side by side; how many outputs differ.")
@click.argument("job_a", type=int)
@click.argument("job_b", type=int)
@click.option("--json", "as_json", is_flag=True, help="One JSON object: a, b and outputs (shared, differ, examples).")
@click.option("--examples", type=click.IntRange(min=0), default=5, show_default=True,
              help="How many differing custom_ids to show.")
@db_option
@handle_errors
def compare(job_a: int, job_b: int, as_json: bool, examples: int, db: str | None) -> None:
    """JOB_A and JOB_B side by side: latency and TTFT percentiles, error rate, tokens,
    cost per 1,000 items; and, for the custom_ids both answered, how many outputs differ.

    Outputs are compared as parsed JSON when both jobs have a schema (key order
    and code fences do not count), else as text. Both jobs must be in one ledger.

    \b
    Example (a baseline before and after a model change):
      batchrun submit job.toml --input sample.jsonl --model gpt-4o-mini          # job 1
      batchrun submit job.toml --input sample.jsonl --model gpt-4.1-mini --new   # job 2
      batchrun compare 1 2
    """
    from rich.console import Console

    from batchrun.report import compare_jobs, render_compare

    with _open(db, existing=True) as ledger:
        data = compare_jobs(ledger, job_a, job_b, examples=examples)
    if as_json:
        click.echo(orjson.dumps(data).decode())
        return
    render_compare(data, Console(highlight=False))


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of jobs.")
@db_option
@handle_errors
def list_jobs(as_json: bool, db: str | None) -> None:
    """The jobs in the ledger with their counts."""
    from batchrun.listing import LIST_HEADER, list_line
    from batchrun.listing import list_jobs as listed_jobs

    with _read_only(db) as reader:
        listed = listed_jobs(reader)
    if as_json:
        click.echo(orjson.dumps([job.to_json() for job in listed]).decode())
        return
    if not listed:
        click.echo("no jobs")
        return
    click.echo(LIST_HEADER)
    for job in listed:
        click.echo(list_line(job))


@main.command(name="export")
@click.argument("job", type=int)
@click.option("--output", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="File to write (atomically); - for standard output (the data only).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="results", show_default=True)
@click.option("--errors", default=None, type=click.Path(dir_okay=False), help="Also write failed/invalid/rejected items here.")
@click.option("--force", is_flag=True, help="Replace a file that is not this job's own earlier export.")
@db_option
@handle_errors
def export_cmd(job: int, output: str, fmt: str, errors: str | None, force: bool, db: str | None) -> None:
    """Write JOB's results: one line per input record, keyed by custom_id.

    --format csv or parquet writes one row per record: custom_id, status, one
    column per top-level field of a structured answer (else output), then
    tokens, cost, attempts, latency and the error.

    \b
    Examples:
      batchrun export 3 --output results.jsonl --errors errors.jsonl
      batchrun export 3 --output batch_output.jsonl --format openai-batch
      batchrun export 3 --output results.parquet --format parquet
      batchrun export 3 --output - | jq -c 'select(.status != "succeeded")'
    """
    if output == "-":
        _export_to_stdout(db, job, fmt, errors, force)
        return
    from batchrun.export import export_job

    with _open(db, existing=True) as ledger:
        result = export_job(ledger, job, output, fmt=fmt, errors=errors, force=force, handle_signals=True)
    click.echo(f"output: {result.path} ({result.lines} lines)")
    if result.errors_path:
        click.echo(f"errors: {result.errors_path} ({result.error_lines} lines)")




def _export_to_stdout(db: str | None, job: int, fmt: str, errors: str | None, force: bool) -> None:
    """``export --output -``: the data and nothing else on stdout. A reader that goes away early
    (``| head``) ends the command quietly with 141, as a shell's SIGPIPE would."""
    import os

    from batchrun.export import export_job

    stdout = sys.stdout.buffer
    try:
        with _open(db, existing=True) as ledger:
            export_job(ledger, job, stdout, fmt=fmt, errors=errors, force=force, handle_signals=True)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + 13)  # 128 + SIGPIPE


def _parse_where(expr: str | None, keys: tuple[str, ...] = RETRY_FILTERS) -> dict[str, Any]:
    where: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (expr or "").split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise UsageError(f"--where {expr!r}: expected KEY=VALUE[,KEY=VALUE] with KEY one of {', '.join(keys)}")
        where[key] = int(value) if key == "status_code" and value.strip().isdigit() else value.strip()
    return where


@main.command()
@click.argument("job", type=int)
@click.option("--state", "states", default="failed,invalid_output", show_default=True,
              help="Which finished states to send again (comma-separated): failed, invalid_output, cancelled.")
@click.option("--where", "where", default=None, help="Only items matching KEY=VALUE, e.g. error_class=truncated.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="A new token limit for these items (recorded on them; the job's spec is unchanged).")
@db_option
@handle_errors
def retry(job: int, states: str, where: str | None, max_tokens: int | None, db: str | None) -> None:
    """Put JOB's failed (and invalid) items back to pending, with a fresh attempt budget.

    Costs money: those requests are sent again on the next resume.

    \b
    Examples:
      batchrun retry 3 --where error_class=server_error && batchrun resume 3
      batchrun retry 3 --where error_class=truncated --max-tokens 1000 && batchrun resume 3
    """
    chosen = [s.strip() for s in states.split(",") if s.strip()]
    bad = [s for s in chosen if s not in USER_RETRYABLE_STATES]
    if bad:
        raise UsageError(f"--state {bad[0]!r}: only {', '.join(USER_RETRYABLE_STATES)} can be retried")
    from batchrun.hints import command

    with _open(db, existing=True) as ledger:
        ledger.get_job(job)
        n = ledger.retry(job, chosen, _parse_where(where), max_tokens=max_tokens)
    click.echo(f"{n} items of job {job} back to pending; run: {command(ledger.url, 'resume', job)}")


@main.command()
@click.argument("job", type=int)
@click.option("--schema", "schema_path", type=click.Path(dir_okay=False), default=None,
              help="Check against this JSON Schema file instead of the job's own.")
@click.option("--json", "as_json", is_flag=True, help="Print the changes as one JSON object.")
@db_option
@handle_errors
def revalidate(job: int, schema_path: str | None, as_json: bool, db: str | None) -> None:
    """Re-check JOB's stored answers against its schema (or --schema), with no API calls.

    Items move between succeeded and invalid_output; truncated and refused
    answers stay invalid. The job's spec is not changed.

    \b
    Example:
      batchrun revalidate 3 --schema looser.schema.json
    """
    from batchrun.jobs import revalidate_job
    from batchrun.validate import check_schema

    schema = None
    if schema_path:
        try:
            schema = orjson.loads(Path(schema_path).read_bytes())
            check_schema(schema)
        except FileNotFoundError:
            raise UsageError(f"{schema_path}: no such schema file") from None
        except orjson.JSONDecodeError as exc:
            raise UsageError(f"{schema_path}: not valid JSON: {exc}") from None
        except ValueError as exc:
            raise UsageError(f"{schema_path}: not a valid JSON Schema (draft 2020-12): {exc}") from None
    with _open(db, existing=True) as ledger:
        report = revalidate_job(ledger, job, schema)
    if as_json:
        click.echo(orjson.dumps(report.__dict__).decode())
        return
    click.echo(
        f"checked {report.checked}: {len(report.to_succeeded)} now succeeded, "
        f"{len(report.to_invalid)} now invalid_output, {report.skipped} truncated/refused left as they were"
    )
    for label, ids in (("now succeeded", report.to_succeeded), ("now invalid", report.to_invalid)):
        if ids:
            shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
            click.echo(f"  {label}: {shown}")


@main.command(short_help="A job's items: the request as sent, each attempt, the answer or error.")
@click.argument("job", type=int)
@click.argument("custom_id", required=False)
@click.option("--where", "where", default=None, metavar="KEY=VALUE",
              help=f"Only items matching KEY=VALUE[,KEY=VALUE] (KEY: {', '.join(SHOW_FILTERS)}), "
                   "e.g. state=failed or error_class=schema_invalid.")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Show at most N items.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per item, a line each.")
@db_option
@handle_errors
def show(job: int, custom_id: str | None, where: str | None, limit: int, as_json: bool, db: str | None) -> None:
    """Show JOB's items one by one (CUSTOM_ID's alone): the request as sent,
    each re-ask, each attempt (status, error, latency, tokens, cost), and the
    final answer or the error with its raw text. Nothing is sent.

    \b
    Examples:
      batchrun show 3 r17
      batchrun show 3 --where state=failed --limit 5
      batchrun show 3 --where error_class=schema_invalid --json | jq .reasks
    """
    from batchrun.browse import render_item, show_items

    chosen = _parse_where(where, SHOW_FILTERS)
    if "state" in chosen and chosen["state"] not in ALL_STATES:
        raise UsageError(f"--where state={chosen['state']}: expected one of {', '.join(ALL_STATES)}")
    with _open(db, existing=True) as ledger:
        views = show_items(ledger, job, custom_id, chosen, limit=limit)
    if custom_id is not None and not views:
        raise UsageError(f"job {job} has no item {custom_id!r}" + (f" matching --where {where}" if where else ""))
    if as_json:
        for view in views:
            click.echo(orjson.dumps(view.to_json()).decode())
        return
    if not views:
        click.echo(f"batchrun: no items of job {job}" + (f" match --where {where}" if where else ""), err=True)
        return
    click.echo("\n\n".join(render_item(view) for view in views))


@main.command()
@click.argument("job", type=int)
@db_option
@handle_errors
def cancel(job: int, db: str | None) -> None:
    """Cancel JOB's pending and running items (finished ones are kept); nothing more is sent for them.

    A run working the job right now (submit, resume or a worker, on any
    machine) notices within a fraction of a second and stops sending; answers
    already in flight are recorded as succeeded, since they were paid for.
    cancel waits (up to 10 s) for such runs to end, so that when it returns
    nothing more is sent, and says how many answers came in meanwhile.
    Cancelled items are not sent by a later resume; to send them after all:
    batchrun retry JOB --state cancelled && batchrun resume JOB.

    In batch mode the job's live provider batches are cancelled at the provider too:
    what they finished is kept (the next `batchrun resume JOB` collects it), the rest
    becomes cancelled.
    """
    from batchrun.cancel import RUNS_STOP_WAIT_SECONDS, cancel_job
    from batchrun.hints import command
    from batchrun.ledger.shards import ShardLedger

    with _open(db, existing=True) as ledger:
        record = ledger.get_job(job)
        in_batches = bool(ShardLedger(ledger).shards(job, open_only=True))
        # A batch-mode run waits on the provider, not on answers in flight: no wait for it.
        done = cancel_job(ledger, job, wait_seconds=0.0 if in_batches else RUNS_STOP_WAIT_SECONDS)
        shards = None
        if in_batches:
            from batchrun.batch import cancel_shards

            shards = run_sync(cancel_shards(ledger, record))
    in_flight = done.answered_in_flight
    click.echo(f"{done.cancelled} items of job {job} cancelled"
               + (f"; {in_flight} {'answer' if in_flight == 1 else 'answers'} already in flight "
                  f"{'was' if in_flight == 1 else 'were'} recorded (paid for)" if in_flight else ""))
    if done.run_still_working and not in_batches:
        click.echo(f"batchrun: a run of job {job} has not ended yet (frozen, or waiting on slow answers); it sends "
                   "nothing more once it notices, and records what was in flight", err=True)
    if shards is None:
        return
    if shards.shards:
        click.echo(
            f"batchrun: {shards.shards} provider batches ({shards.items} items) cancelled at the provider; what they "
            f"finished is kept: collect it with `{command(ledger.url, 'resume', job)}`", err=True,
        )
    for problem in shards.problems:
        click.echo(f"batchrun: could not cancel {problem}; the next run cancels it", err=True)


@main.command()
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False),
              help="JSONL input holding the record to send.")
@provider_option
@click.option("--line", type=click.IntRange(min=1), default=1, show_default=True, help="Which line of --input.")
@click.option("--base-url", default=None, help="Override [provider] base_url.")
@click.option("--model", default=None, help="Override [provider] model.")
@click.option("--timeout", type=click.FloatRange(min=0.001), default=None, help="Total seconds for the request.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@handle_errors
def check(spec: str | None, input_path: str, line: int, as_json: bool, **kw: Any) -> None:
    """Send ONE real request built from SPEC and a line of --input, and show what came back.

    The smoke test before a big run: the request is built exactly as submit
    builds it (template, structured output, streaming) and sent once, without
    retries and without touching the ledger. Shows status, latency, time to
    first token (streamed specs), request id, usage, rate-limit headers, and
    the answer checked against the spec's schema. The API key never appears.

    Exit 0 when the request succeeded and the answer is valid, 1 when it
    failed or the answer is invalid, 2 for a bad spec or input line or an API
    key variable that is not set (api_key_env = "" in the spec: no key), 3 when
    the key was refused. Without a SPEC, the line must be a provider's batch
    line (as for submit) and --base-url is required.

    \b
    Examples:
      batchrun check jobs/triage.toml --input jobs/triage.jsonl --line 3
      batchrun check --input batch.jsonl --base-url https://api.openai.com/v1 --model gpt-4o-mini
    """
    from batchrun.check import check_spec, render_check
    from batchrun.providers import missing_api_key

    overrides = _overrides(kw)
    job_spec = _job_spec(spec, overrides)
    missing = missing_api_key(job_spec)
    if missing is not None:
        raise missing
    result = run_sync(check_spec(job_spec, input_path=input_path, line=line))
    click.echo(orjson.dumps(result.to_dict()).decode() if as_json else render_check(result))
    sys.exit(result.exit_code)


@main.command()
@click.argument("jobs", type=int, nargs=-1)
@click.option("--exit-when-idle", is_flag=True,
              help="Exit (0) once the jobs served have no items pending or running. Default: keep polling.")
@click.option("--poll", type=Duration(), default=2.0, show_default=True,
              help="How often to look for new work and for items whose worker died.")
@click.option("--lease", type=Duration(), default=None,
              help="How long a claimed item stays this worker's without a heartbeat: a killed worker's items "
                   "come back after this. Default: the job's lease_seconds (120 s).")
@click.option("--db-retry", type=Duration(), default=180.0, show_default=True,
              help="Ride out a database restart this long (seconds, or 3m) before giving up with exit 75.")
@db_option
@override_options
@handle_errors
def worker(jobs: tuple[int, ...], exit_when_idle: bool, poll: float, lease: float | None, db_retry: float,
           db: str | None, quiet: bool, transport: str, **kw: Any) -> None:
    """Work JOBs (default: every job with work) of a PostgreSQL ledger, beside other workers anywhere.

    A long-lived process: claims items in batches (FOR UPDATE SKIP LOCKED, with
    leases renewed by heartbeat), polls for new jobs and for items a dead
    worker left, and shares --concurrency evenly among the jobs it works. A
    job's --rpm/--tpm is one budget for all its workers, kept in the ledger.
    Other overrides (--base-url, --model, --timeout, ...) apply to every job
    it works. SQLite ledgers are refused: use submit/resume there.

    SIGINT/SIGTERM: stop claiming, finish requests in flight (grace period),
    put the rest back to pending, exit 75 if work is left (0 if none). A
    second signal exits at once (the leases expire and other workers take
    the items). The database may restart meanwhile: ledger calls are retried
    for --db-retry. See README, "Operations: many workers over PostgreSQL".

    \b
    Examples:
      export BATCHRUN_DB=postgresql+psycopg://batchrun@db.internal/batchrun
      batchrun submit jobs/summarize.toml --input jobs/summarize.jsonl --no-run  # store it; workers do the rest
      batchrun worker --concurrency 64                  # every job, until stopped
      batchrun worker 3 7 --exit-when-idle --lease 60s  # jobs 3 and 7, exit when done
      batchrun status 3
    """
    from batchrun.worker import DEFAULT_CONCURRENCY, Worker, WorkerOptions, serve

    _log_to_file(kw.get("log_file"))  # log records only: a worker's jobs come and go, progress is `status`
    concurrency = kw.pop("concurrency") or DEFAULT_CONCURRENCY
    max_runtime = kw.pop("max_runtime") or 0.0
    options = WorkerOptions(
        concurrency=concurrency, poll_interval=poll, exit_when_idle=exit_when_idle, max_runtime=max_runtime,
        lease_seconds=lease, ledger_retry_seconds=db_retry, transport=transport, require_key=True,
    )

    def started(runner: Worker) -> None:
        served = " ".join(map(str, jobs)) if jobs else "every job with work"
        click.echo(f"batchrun: worker on {runner.ledger.url}: {served}, concurrency {concurrency}", err=True)

    result = serve(db, list(jobs) or None, overrides=_overrides(kw), options=options, handle_signals=True,
                   on_start=None if quiet else started)
    done = " ".join(f"{state}={n}" for state, n in sorted(result.done.items()) if n) or "nothing"
    click.echo(f"jobs {' '.join(map(str, result.jobs)) or '-'}: {done}")
    if result.stop_message:
        click.echo(f"batchrun: {result.stop_message}", err=True)
    if result.exit_code == ExitCode.TEMPFAIL:
        click.echo("batchrun: work is left; start a worker again (or let the others finish it)", err=True)
    sys.exit(result.exit_code)


@main.command()
@click.option("--job", "example", type=click.Choice(["summarize", "triage"]), default="summarize", show_default=True,
              help="Which bundled example: review summaries, or ticket triage with a JSON Schema.")
@click.option("--mode", type=click.Choice(MODES), default="online", show_default=True,
              help="batch: through the fake server's batch API (the turnaround scaled to seconds).")
@db_option
@handle_errors
def demo(example: str, mode: str, db: str | None) -> None:
    """Run the bundled example job against a local fake endpoint (nothing leaves this machine).

    Starts an OpenAI-compatible server on 127.0.0.1 with some latency and
    injected faults (500s, 429s, connection resets; for triage also fenced,
    prose-wrapped, truncated and schema-violating answers), runs
    jobs/summarize.toml (or jobs/triage.toml) over its example input with the
    default SQLite ledger (or --db), shows progress and prints where the output is.
    With --mode batch the job goes through the fake server's batch API instead
    (a batch ends in seconds; a 5xx on create after creating, busy polls).
    """
    from batchrun.demo import demo_server, prepare_demo
    from batchrun.hints import command
    from batchrun.scheduler import RunOptions
    from batchrun.submission import resume as resume_job

    with _open(db) as ledger, demo_server() as server:
        job_id, output = prepare_demo(ledger, server.base_url, example, mode)
        click.echo(str(job_id))
        click.echo(f"batchrun: demo endpoint {server.base_url}, ledger {ledger.url}", err=True)
        result = resume_job(ledger, job_id, output=output, options=RunOptions(command="demo"), handle_signals=True,
                            batch=_batch_options("demo", True, False), on_start=_progress(quiet=False))
        if result.error is not None:
            _fail(result.error)
        if result.export:
            click.echo(f"output: {result.export.path} ({result.export.lines} lines)")
        click.echo(" ".join(f"{k}={v}" for k, v in result.counts.items() if v))
        click.echo(f"next: {command(ledger.url, 'status', job_id)}", err=True)
    sys.exit(result.exit_code)


@main.group()
def db() -> None:
    """Ledger maintenance."""


@db.command()
@db_option
@handle_errors
def upgrade(db: str | None) -> None:
    """Create or upgrade the ledger schema to the newest version."""
    with _open(db) as ledger:
        click.echo(f"ledger {ledger.url} is up to date")


if __name__ == "__main__":  # pragma: no cover
    main()
