"""Commands that only read the ledger start without the run machinery."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_status_and_list_load_the_ledger_but_not_the_run_machinery(tmp_path: Path) -> None:
    from batchrun.ledger import Ledger

    db = str(tmp_path / "l.db")
    with Ledger.open(db) as ledger:
        ledger.create_job(spec_for_batch_input(Overrides(base_url="http://127.0.0.1:9/v1", model="m")),
                          input_path="in.jsonl", input_hash="h")
    for args in (("status",), ("status", "--json"), ("list",), ("list", "--json")):
        modules = command_imports(*args, db=db)
        assert "sqlalchemy" in modules and "batchrun.ledger.store" in modules, args  # the check is not vacuous
        assert loaded(modules, "alembic", "httpx", "aiohttp", "rich", "jsonschema", "sqlalchemy.orm",
                      "batchrun.scheduler", "batchrun.providers.http") == [], args
