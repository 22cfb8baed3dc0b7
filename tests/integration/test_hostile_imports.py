"""Issue 24 item 1, as the attacker would: the model plants Python modules in its workspace,
which is also the current directory of every toolq command the user runs there, and waits for a
trusted process to import one (unsandboxed, with the fleet's secrets).

The workspace gets a module named after every top-level module this interpreter could import
lazily (the standard library's and site-packages', toolq's own package too); each writes a marker
outside the workspace when imported. The model also adds `sniffio.py` and `h11.py` with
`apply_patch` mid-turn (the original finding). Then every command and process kind runs from the
workspace: `toolq run` on the embedded stack (its workers, session host, cells and an MCP host
with a real MCP server), a worker started in the workspace and a `toolq run` against it, `toolq
batch`, `turns`, `status`, `workers`, `config`, `cancel`, `demo`. No marker may appear.
"""

from __future__ import annotations

import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import tests.integration.conftest as c
from tests.integration import unprivileged
from tests.integration.test_hostile_exec import locked_redis  # noqa: F401 - fixture
from tests.integration.test_mcp import EDGES
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import WorkerProcess

pytestmark = pytest.mark.integration

TOOLQ = str(Path(sys.executable).with_name("toolq"))
#: What the model adds itself, mid-turn (not planted beforehand).
ADDED = ("sniffio", "h11")


def importable_names() -> set[str]:
    """Every top-level module or package this interpreter can import from its path."""
    names = {m.name for m in pkgutil.iter_modules() if m.name.isidentifier()}
    return (names | {"toolq", "tests", "sitecustomize", "usercustomize"}) - set(sys.builtin_module_names) - set(ADDED)


def plant(folder: Path, markers: Path, package: bool = True) -> int:
    """A module that leaves a marker for every importable name; with `package`, a `toolq/` package
    too (one that `python -m toolq...` finds before toolq runs: only `-P` or the console script
    avoid it, so it is left out where `python -m` itself is the attack)."""
    body = f"open({str(markers)!r} + '/' + __name__, 'w').close()\nraise ImportError('planted by the model')\n"
    names = importable_names() - (set() if package else {"toolq"})
    for name in names:
        (folder / f"{name}.py").write_text(body)
    if package:
        (folder / "toolq").mkdir()  # a package shadows a module
        (folder / "toolq" / "__init__.py").write_text(body)
    return len(names)


def add_file(path: str, body: str) -> str:
    return "*** Begin Patch\n*** Add File: " + path + "\n" + "".join(f"+{line}\n" for line in body.splitlines()) + \
        "*** End Patch\n"


@pytest.fixture
def planted(tmp_path):
    workspace, markers = tmp_path / "ws", tmp_path / "markers"
    workspace.mkdir()
    markers.mkdir()
    assert plant(workspace, markers) > 300  # the standard library alone has more
    return workspace, markers


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_no_toolq_process_imports_what_the_model_planted(planted, tmp_path, redis_server):
    workspace, markers = planted
    mcp_config = tmp_path / "mcp.toml"
    mcp_config.write_text(f'[mcp_servers.edges]\ncommand = "{sys.executable}"\nargs = ["{EDGES}", "edges", '
                          f'"{tmp_path}"]\n')
    body = f"open({str(markers)!r} + '/' + __name__, 'w').close()\n"
    turn = [[b.custom_tool_call("apply_patch", add_file(f"{name}.py", body), f"call_add_{name}")
             for name in ADDED] + [b.function_call("exec_command", {"cmd": "ls sniffio.py h11.py"}, "call_ls")],
            [b.function_call("noop", {}, "call_mcp", namespace="edges"),
             b.function_call("exec_command", {"cmd": "echo second step"}, "call_echo")],
            [b.message("done")]]
    base = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL", "PYTHONPATH")}
    base.update(OPENAI_API_KEY="test", TOOLQ_REQUEST_MAX_RETRIES="0", TOOLQ_TOOLS=c.TEST_TOOLS,
                TOOLQ_SIGNING_KEY=c.SIGNING_KEY)
    with FakeModel(turn, loop=True) as fake:
        env = {**base, "OPENAI_BASE_URL": fake.base_url, "TOOLQ_MCP_CONFIG": str(mcp_config)}
        # The embedded stack, from the workspace: the orchestrator, its workers, session host, MCP host.
        embedded = run([TOOLQ, "run", "--json", "go"], workspace, env, timeout=180)
        assert embedded.returncode == 0, embedded.stderr[-3000:]
        assert (workspace / "sniffio.py").exists() and (workspace / "h11.py").exists()  # the model's writes landed
        events = [json.loads(line) for line in embedded.stdout.splitlines()]
        done = [e for e in events if e["type"] == "item.completed" and e["item"]["id"] == "call_mcp" and e["item"]["success"]]
        assert done, embedded.stdout[-3000:]  # the MCP server answered: its host ran
        # A worker started in the workspace (an image whose WORKDIR is the workspace), and a run on it.
        fleet_env = {**base, "OPENAI_BASE_URL": fake.base_url, "REDIS_URL": redis_server.url}
        worker = InWorkspace(redis_server.url, workspace, queues=["toolq"], concurrency=1, tools=[c.TEST_TOOLS],
                             env={"TOOLQ_SIGNING_KEY": c.SIGNING_KEY}, logdir=tmp_path)
        worker.start()
        try:
            external = run([TOOLQ, "run", "--json", "go"], workspace, fleet_env, timeout=180)
            assert external.returncode == 0, external.stderr[-3000:]
            turn_id = json.loads(external.stdout.splitlines()[0])["turn_id"]  # in the fleet's ledger
            batch = tmp_path / "batch.jsonl"
            batch.write_text(json.dumps({"prompt": "go"}) + "\n")
            assert run([TOOLQ, "batch", str(batch), "--out", str(tmp_path / "out.jsonl")], workspace,
                       fleet_env, timeout=180).returncode == 0
            for args in (["turns"], ["status", turn_id], ["workers"], ["config"]):
                assert run([TOOLQ, *args], workspace, fleet_env).returncode == 0, args
            run([TOOLQ, "cancel", "no-such-turn"], workspace, fleet_env)
            # `python -m toolq...` by hand, in a folder where every other name is planted.
            by_hand = tmp_path / "by-hand"
            by_hand.mkdir()
            plant(by_hand, markers, package=False)
            for args in (["turns"], ["status", turn_id], ["config"]):
                assert run([sys.executable, "-m", "toolq.cli.main", *args], by_hand, fleet_env).returncode == 0
        finally:
            worker.stop()
    demo = run([TOOLQ, "demo", "--workspace", str(workspace)], workspace, base, timeout=180)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert sorted(os.listdir(markers)) == []


class InWorkspace(WorkerProcess):
    """`toolq worker`, started the way a user or an image starts it: the console script, from the workspace."""

    def __init__(self, redis_url: str, workspace: Path, **kw) -> None:
        super().__init__(redis_url, **kw)
        self.cwd = str(workspace)

    def argv(self) -> list[str]:
        argv = super().argv()
        return [TOOLQ, *argv[argv.index("worker"):]]  # the console script, not `python -P -m ...`


class UserInWorkspace(unprivileged.UserWorkerProcess, InWorkspace):
    """The same, as the unprivileged user (its argv wraps the console script's)."""


def test_a_worker_run_as_nobody_in_its_workspace_imports_nothing_from_it(locked_redis):  # noqa: F811
    """The unprivileged worker: started in the workspace it owns; the model adds `sniffio.py` and
    `h11.py` there, and two turns run on it (its pool, session host and cells). A Redis of this
    module's own: the suite's root workers on the shared one must not take its calls."""
    redis_server = locked_redis
    if why := unprivileged.unavailable():
        pytest.skip(why)
    workspace, logdir = unprivileged.owned_dir("toolq-ws-"), unprivileged.owned_dir("toolq-worker-")
    markers = Path(tempfile.mkdtemp(prefix="toolq-markers-", dir="/tmp"))
    markers.chmod(0o1777)  # the user's imports must be able to leave their marker
    try:
        plant(workspace, markers)
        body = f"open({str(markers)!r} + '/' + __name__, 'w').close()\n"
        turn = [[b.custom_tool_call("apply_patch", add_file(f"{name}.py", body), f"call_add_{name}")
                 for name in ADDED] + [b.function_call("exec_command", {"cmd": "ls sniffio.py h11.py"}, "call_ls")],
                [b.function_call("exec_command", {"cmd": "echo second step"}, "call_echo")],
                [b.message("done")]]
        worker = UserInWorkspace(redis_server.url, workspace, queues=["toolq"], concurrency=1,
                                 tools=[c.TEST_TOOLS], env={"TOOLQ_SIGNING_KEY": c.SIGNING_KEY},
                                 logdir=logdir)
        env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL", "PYTHONPATH")}
        env.update(OPENAI_API_KEY="test", TOOLQ_REQUEST_MAX_RETRIES="0", TOOLQ_SIGNING_KEY=c.SIGNING_KEY,
                   REDIS_URL=redis_server.url)
        with FakeModel(turn, loop=True) as fake:
            worker.start()
            try:
                for _ in range(2):
                    out = run([TOOLQ, "run", "--json", "go"], workspace, {**env, "OPENAI_BASE_URL": fake.base_url},
                              timeout=180)
                    assert out.returncode == 0, out.stderr[-3000:]
                    assert '"call_ls"' in out.stdout and "sniffio.py" in out.stdout, out.stdout[-3000:]
            finally:
                worker.stop()
        assert (workspace / "sniffio.py").stat().st_uid == unprivileged.ids()[0]  # the user's command wrote it
        assert sorted(os.listdir(markers)) == []
    finally:
        for folder in (workspace, logdir, markers):
            shutil.rmtree(folder, ignore_errors=True)


def test_a_workspace_that_holds_the_import_path_is_refused(tmp_path):
    """A virtualenv inside the project, or tool modules in the workspace: a command could write
    the code toolq imports next. Refused in one line, before any call."""
    tools = tmp_path / "project" / "tools"
    tools.mkdir(parents=True)
    env = {**os.environ, "TOOLQ_TOOLS_PATH": str(tools), "OPENAI_API_KEY": "test"}
    env.pop("REDIS_URL", None)
    for workspace in (tmp_path / "project", tools):
        out = run([TOOLQ, "run", "--workspace", str(workspace), "hi"], tmp_path, env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and "import path" in out.stderr and "Traceback" not in out.stderr
