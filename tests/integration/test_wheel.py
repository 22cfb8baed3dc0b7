"""The installed package (issue 11 item 1): the wheel, installed (not editable) into a fresh venv,
runs `toolq worker` and `toolq run` from a project that has its own `workers/` and
`orchestrator/` packages. Everything toolq installs lives under `toolq`, so nothing clashes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, SIGNING_KEY
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess

pytestmark = pytest.mark.integration

#: What a checkout holds that a build must not see (the dev venv, caches, earlier builds).
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build", "dist", "__pycache__", ".pytest_cache")

PROJECT_TOOL = '''
import json
import workers.app  # the project's own Celery app, not toolq's
import orchestrator
import toolq
from pydantic import BaseModel
from toolq import ToolContext, tool


class NoArgs(BaseModel):
    pass


@tool
def where_am_i(args: NoArgs, ctx: ToolContext) -> str:
    """Say where toolq and the project's packages were imported from."""
    return json.dumps({"toolq": toolq.__file__, "workers": workers.app.__file__, "marker": workers.app.MARKER,
                       "orchestrator": orchestrator.__file__})
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with toolq's wheel installed; returns its bin dir."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(base / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (base / "dist").glob("toolq-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # Offline and fast: the dependencies are this interpreter's, put on the new venv's path by a
    # .pth line. Only .pth files in a site directory run, so the dev venv's editable toolq finder
    # does not: `toolq` can only come from the wheel installed below (the test checks where from).
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "toolq_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", python]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True,
                   timeout=300)
    # The wheel's declared dependencies are all there (what `pip install` would have resolved).
    subprocess.run([*pip, "check"], check=True, capture_output=True, timeout=120)
    return venv / "bin"


def make_project(root: Path) -> Path:
    """A Celery project with its own `workers` and `orchestrator` packages, and a toolq tool."""
    (root / "workers").mkdir(parents=True)
    (root / "workers" / "__init__.py").write_text("")
    (root / "workers" / "app.py").write_text("MARKER = 'the project workers package'\n")
    (root / "orchestrator").mkdir()
    (root / "orchestrator" / "__init__.py").write_text("")
    (root / "project_tools.py").write_text(textwrap.dedent(PROJECT_TOOL))
    return root


class InstalledWorker(WorkerProcess):
    """`toolq worker` from the venv's own script, run in the project directory."""

    def __init__(self, bin_dir: Path, project: Path, redis_url: str, **kw) -> None:
        super().__init__(redis_url, tools=["project_tools"], **kw)
        self.bin_dir, self.project = bin_dir, project

    def argv(self) -> list[str]:
        argv = super().argv()
        return [str(self.bin_dir / "toolq"), *argv[argv.index("worker"):]]  # not `python -P -m toolq.cli.main`

    def start(self, wait: bool = True) -> InstalledWorker:
        self.log.write_text("")
        self.proc = subprocess.Popen(self.argv(), env=clean_env(REDIS_URL=self.redis_url, TOOLQ_SIGNING_KEY=SIGNING_KEY,
                                                                TOOLQ_TOOLS_PATH=str(self.project)), cwd=self.project,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready(timeout=60)
        return self


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH, no dev venv on PATH: only what the installed package brings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CELERY_BROKER_URL")
           and not k.startswith("TOOLQ_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return {**env, **extra}


def test_the_installed_wheel_runs_worker_and_run_beside_a_projects_own_workers_package(installed, tmp_path):
    project = make_project(tmp_path / "project")
    workspace = tmp_path / "ws"  # not the project: its code is on toolq's import path (TOOLQ_TOOLS_PATH)
    workspace.mkdir()
    script = [[b.function_call("where_am_i", {}, "call_where")], [b.message("done")]]
    with RedisServer() as server, FakeModel(script) as fake, \
            InstalledWorker(installed, project, server.url, name="wheel@test", logdir=tmp_path).start():
        proc = subprocess.run(
            [str(installed / "toolq"), "run", "--json", "--tools", "project_tools", "--workspace", str(workspace),
             "where are you?"],
            env=clean_env(REDIS_URL=server.url, OPENAI_BASE_URL=fake.base_url, OPENAI_API_KEY="test",
                          TOOLQ_SIGNING_KEY=SIGNING_KEY, TOOLQ_TOOLS_PATH=str(project)),
            cwd=project, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    (call,) = [e["item"] for e in events if e["type"] == "item.completed" and e["item"].get("type") == "tool_call"]
    assert (call["status"], call["worker"]) == ("completed", "wheel@test"), call
    where = json.loads(call["output"])
    assert where["toolq"].startswith(str(installed.parent)), "toolq came from somewhere other than the wheel"
    assert where["marker"] == "the project workers package"
    assert Path(where["workers"]).parent == project / "workers"
    assert Path(where["orchestrator"]).parent == project / "orchestrator"
    assert events[-1]["type"] == "turn.completed"
