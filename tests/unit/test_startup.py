"""Commands that only read the ledger start without the run machinery."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from batchrun.ledger.basics import resolve_db_url
from batchrun.spec import Overrides, spec_for_batch_input

RUN_MACHINERY = ("aiohttp", "httpx", "httpx_sse", "jsonschema", "alembic", "sqlalchemy.orm")


def fresh_python(code: str) -> str:
    """What ``code`` prints in a new interpreter (nothing imported yet)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_cli_import_leaves_the_http_stack_and_the_orm_out() -> None:
    code = (
        "import sys, batchrun.cli, batchrun.export, batchrun.report\n"
        f"print(','.join(m for m in {RUN_MACHINERY!r} if m in sys.modules))"
    )
    assert fresh_python(code) == ""


def test_export_and_list_start_without_rich() -> None:
    assert fresh_python("import sys, batchrun.cli, batchrun.export\nprint('rich' in sys.modules)") == "False"


def test_the_check_is_not_vacuous() -> None:
    assert fresh_python("import sys, batchrun.providers.http\nprint('aiohttp' in sys.modules and 'httpx' in sys.modules)") == "True"


def test_a_run_without_a_schema_does_not_load_jsonschema() -> None:
    assert fresh_python("import sys, batchrun.jobs, batchrun.scheduler\nprint('jsonschema' in sys.modules)") == "False"


def test_importing_the_cli_leaves_the_garbage_collector_alone() -> None:
    # Only the command (batchrun/__main__.py) raises the threshold for its start-up.
    code = "import gc\nbefore = gc.get_threshold()\nimport batchrun.cli\nprint(gc.get_threshold() == before)"
    assert fresh_python(code) == "True"


def test_import_batchrun_leaves_the_ledger_and_the_http_stack_out() -> None:
    """The public names load on first use (PEP 562): ``import batchrun`` is the errors and states only."""
    heavy = ("sqlalchemy", "httpx", "aiohttp", "rich")
    code = f"import sys, batchrun\nprint(','.join(m for m in {heavy!r} if m in sys.modules))"
    assert fresh_python(code) == ""
    used = f"import sys, batchrun\nbatchrun.submit, batchrun.Ledger\nprint(','.join(m for m in {heavy[:3]!r} if m in sys.modules))"
    assert fresh_python(used) == "sqlalchemy,httpx,aiohttp"


def command_imports(*args: str, db: str | None = None) -> set[str]:
    """The modules a ``batchrun`` command has imported when it is done (run in a new interpreter)."""
    argv = ["batchrun", *args, *(["--db", db] if db else [])]
    code = (
        "import sys\n"
        f"sys.argv = {argv!r}\n"
        "from batchrun.__main__ import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(proc.stderr.split("\n")[-2].split())


def loaded(modules: set[str], *packages: str) -> list[str]:
    return sorted(p for p in packages if p in modules)


def test_help_loads_no_ledger_no_http_no_rich() -> None:
    modules = command_imports("--help")
    assert "batchrun.cli" in modules
    assert loaded(modules, "sqlalchemy", "alembic", "httpx", "aiohttp", "rich", "jsonschema", "tenacity", "asyncio") == []
    # The choices come from batchrun.formats: neither the spec parser nor the writers load (~30 ms).
    assert "batchrun.formats" in modules
    assert loaded(modules, "batchrun.spec", "batchrun.export", "batchrun.tabular", "tomllib") == []


def test_the_command_loads_httpx_without_its_command_line(tmp_path: Path) -> None:
    """httpx imports its own CLI (rich's console, pygments) when click and rich are installed;
    the command's start-up keeps it out (25-70 ms)."""
    job = Path(__file__).resolve().parents[2] / "jobs"
    modules = command_imports("submit", str(job / "summarize.toml"), "--input", str(job / "summarize.jsonl"),
                              "--dry-run", db=str(tmp_path / "ledger.db"))
    assert "httpx" in modules  # the check is not vacuous
    assert loaded(modules, "pygments", "rich.syntax", "rich.console") == []
    assert "pygments" in fresh_python("import sys, httpx\nprint(' '.join(sys.modules))").split()  # without it, it would


@pytest.mark.slow
def test_status_and_list_read_a_sqlite_ledger_without_sqlalchemy(tmp_path: Path) -> None:
    """``status`` and ``list`` on a SQLite ledger at the schema head take the quick reader (sqlite3,
    read-only); ``status --watch`` and a ledger they do not know take the ledger (SQLAlchemy)."""
    from batchrun.ledger import Ledger
    from batchrun.ledger.engine import create_ledger_engine

    db = str(tmp_path / "l.db")
    with Ledger.open(db) as ledger:
        job_id = ledger.create_job(spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m")),
                                   input_path="in.jsonl", input_hash="h")
        # An item left running by a dead run: the text status then hints `resume ... --db` (batchrun.hints).
        ledger.insert_items(job_id, [{"line": 1, "custom_id": "a", "url": "/v1/chat/completions", "body": "{}",
                                      "state": "running"}])
    for args in (("status",), ("status", "--json"), ("list",), ("list", "--json")):
        modules = command_imports(*args, db=db)
        assert "batchrun.ledger.quick" in modules and "batchrun.report" in modules or args[0] == "list", args
        assert "batchrun.hints" in modules or args != ("status",), args  # the dead run's hint was written
        assert "batchrun.listing" in modules or args[0] == "status", args  # the check is not vacuous
        assert loaded(modules, "sqlalchemy", "alembic", "httpx", "aiohttp", "rich", "jsonschema", "asyncio",
                      "batchrun.ledger.store", "batchrun.scheduler", "batchrun.providers.http",
                      "batchrun.export", "batchrun.tabular", "tomllib", "hashlib", "socket") == [], args
    # On a ledger of an older schema (here 0008, before the counts were kept) the same commands
    # go through the ledger, which upgrades it as before.
    from alembic import command

    from batchrun.ledger.engine import SCHEMA_HEAD, alembic_config

    old = tmp_path / "old.db"
    cfg = alembic_config()
    engine = create_ledger_engine(resolve_db_url(old))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0008")
    engine.dispose()
    modules = command_imports("list", "--json", db=str(old))
    assert "sqlalchemy" in modules and "batchrun.ledger.store" in modules
    assert loaded(modules, "httpx", "aiohttp", "rich", "batchrun.scheduler", "batchrun.providers.http") == []
    conn = sqlite3.connect(old)
    assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(SCHEMA_HEAD,)]
    conn.close()
    assert "sqlalchemy" not in command_imports("list", "--json", db=str(old))  # at head now: the quick reader
