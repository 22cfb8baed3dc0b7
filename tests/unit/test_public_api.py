"""The public surface (issue 11), pinned so it changes only on purpose (like pydantic-ai's
`test_public_interface_contracts.py`), and the import graph that keeps the two sides apart."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import toolq

PACKAGE = Path(toolq.__file__).parent
PUBLIC = ["CallState", "Environment", "Fleet", "RespondToModel", "Runtime", "Session", "Settings", "ToolCallView",
          "ToolContext", "ToolReturn", "TurnDiff", "TurnEvent", "TurnOutcome", "tool"]


def test_the_public_names_are_pinned_and_each_has_a_docstring():
    assert toolq.__all__ == PUBLIC == sorted(toolq._EXPORTS)
    for name in PUBLIC:
        obj = getattr(toolq, name)
        doc = getattr(obj, "__doc__", None) if name != "TurnEvent" else "a discriminated union"
        assert doc and doc.strip(), f"toolq.{name} has no docstring"
    import toolq.testing as testing

    for name in ("run_call", "arun_call", "FakeModel"):
        assert getattr(testing, name).__doc__, f"toolq.testing.{name} has no docstring"


def test_fleet_offers_connect_tool_specs_and_run_calls():
    for name in ("connect", "tool_specs", "run_calls"):
        assert getattr(toolq.Fleet, name).__doc__, name


def _imported_after(code: str) -> dict:
    probe = (f"import sys, json\n{code}\n"
             "from toolq.core.catalog import CATALOG\n"
             "print(json.dumps({'modules': sorted(sys.modules), 'tools': [str(s.tool_name) for s in CATALOG]}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_importing_toolq_and_the_barrier_loads_no_celery_and_registers_no_tool():
    after = _imported_after("import toolq\nfrom toolq import tool, ToolContext, ToolReturn, RespondToModel\n"
                            "import toolq.orchestrator.barrier, toolq.orchestrator.binding, toolq.orchestrator.transport.memory")
    loaded = [m for m in after["modules"] if m.split(".")[0] in ("celery", "kombu", "billiard")
              or m.startswith(("toolq.workers.app", "toolq.workers.tools"))]
    assert loaded == [], loaded
    assert after["tools"] == [], "importing toolq registered built-in tools"


def test_the_toolq_run_path_loads_no_celery_until_a_call_is_sent():
    """Celery (0.1 s of imports) is loaded by the first dispatch, not by `toolq run` starting: the
    first model request needs none, and a turn without tool calls never loads it."""
    after = _imported_after("import toolq.cli.main, toolq.cli.run, toolq.local.embedded\n"
                            "import toolq.orchestrator.turn, toolq.orchestrator.fleet, toolq.orchestrator.transport.dispatch\n"
                            "import toolq.orchestrator.mcp_tools, toolq.workers.mcp.fleet, toolq.workers.config")
    loaded = [m for m in after["modules"] if m.split(".")[0] in ("celery", "kombu", "billiard", "amqp")]
    assert loaded == [], loaded


def test_the_toolq_run_path_loads_no_jsonschema_nor_the_mcp_worker_side():
    """The orchestrator follows the fleet's MCP tools from its catalog: the MCP host's client,
    its config and jsonschema (45 ms of a one-request `toolq run`) are the worker's alone."""
    after = _imported_after("import toolq.cli.main as cli\ncli.import_quietly('toolq.cli.run')\n"
                            "import toolq.orchestrator.fleet, toolq.orchestrator.mcp_tools, toolq.workers.mcp.fleet\n"
                            "from toolq.workers.loader import load_catalog\nload_catalog([])")
    loaded = [m for m in after["modules"] if m.split(".")[0] in ("jsonschema", "referencing", "mcp")
              or m.startswith(("toolq.workers.mcp.worker", "toolq.workers.mcp.host_client", "toolq.workers.mcp.config"))]
    assert loaded == [], loaded


def test_the_command_line_imports_its_runtime_with_the_gc_on_again_and_no_httpx_command_line():
    after = _imported_after("import gc, toolq.cli.main as cli\ncli.import_quietly('toolq.cli.run')\n"
                            "assert gc.isenabled() and gc.get_freeze_count() > 0")
    assert "toolq.cli.run" in after["modules"]
    assert not {"click", "pygments", "rich"} & {m.split(".")[0] for m in after["modules"]}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any level (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


#: dispatch.py is the orchestrator's door into Celery.
CELERY_ALLOWED = {"orchestrator/transport/dispatch.py"}
#: The layers below the commands: none builds a Celery app or registers the built-in tools.
BELOW_THE_COMMANDS = ("core", "local", "orchestrator")


def test_no_orchestrator_module_imports_celery_but_dispatch():
    offenders = {_rel(p): sorted(m for m in _imports(p) if m.split(".")[0] in ("celery", "kombu"))
                 for layer in BELOW_THE_COMMANDS for p in (PACKAGE / layer).rglob("*.py")}
    assert {f: m for f, m in offenders.items() if m and f not in CELERY_ALLOWED} == {}


def test_the_orchestrator_reaches_the_workers_only_through_their_import_safe_modules():
    """`workers.app` builds the Celery app and `workers.tools` registers the built-ins: only the
    `toolq worker` command (cli/main.py) and the catalog loader may import them."""
    offenders = {}
    for p in (p for layer in BELOW_THE_COMMANDS for p in (PACKAGE / layer).rglob("*.py")):
        bad = sorted(m for m in _imports(p) if m.startswith(("toolq.workers.app", "toolq.workers.tools")))
        if bad:
            offenders[_rel(p)] = bad
    assert offenders == {}


def test_the_catalog_does_not_import_the_tools_that_import_it():
    catalog = PACKAGE / "core" / "catalog.py"
    assert not any(m.startswith("toolq.workers.tools") for m in _imports(catalog))
    assert "toolq.workers.tools" not in catalog.read_text()  # nor by name, through importlib
