"""A fleet mixing toolq versions (issue 25: the house moves, the contract does not): a worker of
the release before the reshaping (commit 22e3d8d, taken from this repository's history) serves
this tree's orchestrator, a turn of exec_command, its session by write_stdin, a user tool and
apply_patch. Task names, tool digests and the wire formats are what both sides must agree on."""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.integration.conftest import SIGNING_KEY, TEST_TOOLS, WORKER_ENV, run_session, settings_for
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "22e3d8d"  # issue 24's last landing, before toolq/core/ and the capabilities


@pytest.fixture(scope="module")
def released_tree(tmp_path_factory) -> Path:
    """The released tree's files (toolq/ and the test tools it loads), from git."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", RELEASE, "toolq", "tests"],
                                 capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"release {RELEASE} is not in this checkout's git history ({e}); the mixed fleet cannot run")
    where = tmp_path_factory.mktemp("release")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    return where


def test_a_worker_of_the_previous_release_serves_this_orchestrator(released_tree, tmp_path):
    with RedisServer() as redis:
        worker = WorkerProcess(redis.url, name="released@test", concurrency=2, tools=[TEST_TOOLS], logdir=tmp_path,
                               env={**WORKER_ENV, "PYTHONPATH": str(released_tree), "TOOLQ_SIGNING_KEY": SIGNING_KEY})
        worker.start()
        try:
            script = [[b.function_call("exec_command", {"cmd": "echo started; sleep 1.5; echo ended",
                                                        "yield_time_ms": 500}, "c_exec"),
                       b.function_call("sleep_echo", {"ms": 10, "text": "user tool"}, "c_user"),
                       b.custom_tool_call("apply_patch", "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n",
                                          "c_patch")],
                      [b.function_call("write_stdin", {"session_id": 1, "chars": "", "yield_time_ms": 5000}, "c_poll")],
                      [b.message("done")]]
            workspace = tmp_path / "ws"
            workspace.mkdir()
            with FakeModel(script) as fake:
                (outcome,), _ = asyncio.run(run_session(settings_for(redis.url, fake, workspace), ["go"], []))
                outputs = {i["call_id"]: str(i.get("output")) for body in fake.requests
                           for i in body["input"] if i.get("type", "").endswith("_output")}
        finally:
            worker.stop()
    assert outcome.status == "completed", outcome
    assert "Process running with session ID 1" in outputs["c_exec"] and "started" in outputs["c_exec"]
    assert '"text": "user tool"' in outputs["c_user"]
    assert "A a.txt" in outputs["c_patch"] and (workspace / "a.txt").read_text() == "hi\n"
    assert "Process exited with code 0" in outputs["c_poll"] and "ended" in outputs["c_poll"]
