"""Commands that only read the ledger start without the run machinery."""

from __future__ import annotations

import subprocess
import sys

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
