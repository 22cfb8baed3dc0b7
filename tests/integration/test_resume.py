"""Durable turns (issue 13): a `toolq run` SIGKILLed mid-call leaves an orphaned turn that
`toolq resume` finishes from Redis alone, without running the call again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import tests.integration.conftest as c
from toolq.orchestrator.fake_model import builders as b
from toolq.orchestrator.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems

pytestmark = pytest.mark.integration


def toolq(*args: str, env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolq.orchestrator.cli", *args], env=env, capture_output=True,
                          text=True, timeout=90, **kw)


def turn_state(turn_id: str, env: dict[str, str]) -> str | None:
    out = toolq("turns", "--json", env=env)
    return next((r["state"] for r in map(json.loads, out.stdout.splitlines()) if r["turn_id"] == turn_id), None)


def test_a_sigkilled_run_is_orphaned_and_resume_finishes_it_without_running_the_call_again(fleet, tmp_path):
    marker = tmp_path / "ran.txt"
    cmd = f"echo ran >> {marker}; sleep 3; echo finished"
    script = [[b.function_call("exec_command", {"cmd": cmd}, "call_durable")], [b.message("all done")]]
    session = tmp_path / "session.json"
    with FakeModel(script) as fake:
        env = {**os.environ, "REDIS_URL": fleet[0].redis_url, "OPENAI_BASE_URL": fake.base_url,
               "OPENAI_API_KEY": "test", "TOOLQ_SIGNING_KEY": c.SIGNING_KEY, "TOOLQ_TURN_LEASE": "2",
               "PYTHONPATH": c.WORKER_ENV["PYTHONPATH"]}
        proc = subprocess.Popen([sys.executable, "-m", "toolq.orchestrator.cli", "run", "--json", "--workspace",
                                 str(tmp_path), "go"], env=env, stdout=subprocess.PIPE, text=True)
        turn_id = json.loads(proc.stdout.readline())["turn_id"]
        end = time.monotonic() + 30
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < end, "the command never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no handler runs: only Redis knows the turn now
        proc.wait(10)
        proc.stdout.close()

        # the dead run's lease is still live: nobody else may drive the turn yet
        early = toolq("resume", turn_id, env=env)
        assert early.returncode == 2 and "another orchestrator" in early.stderr, early.stderr

        end = time.monotonic() + 15
        while turn_state(turn_id, env) != "orphaned":
            assert time.monotonic() < end, f"the turn never showed as orphaned: {turn_state(turn_id, env)}"
            time.sleep(0.3)

        resumed = toolq("resume", turn_id, "--json", "--session", str(session), env=env)
        assert resumed.returncode == 0, resumed.stderr
        events = [json.loads(line) for line in resumed.stdout.splitlines()]
        assert events[-1]["type"] == "turn.completed"
        assert len(fake.requests) == 2, "the first request was not asked again"
        second = fake.requests[1]["input"]
    assert pairing_problems(second) == []
    (out,) = [i["output"] for i in second if i["type"] == "function_call_output"]
    assert "finished" in out, out
    assert marker.read_text() == "ran\n", "the call ran twice"
    saved = json.loads(session.read_text())
    assert saved[0]["content"][0]["text"] == "go" and saved[-1]["role"] == "assistant"
    assert turn_state(turn_id, env) == "completed"
