"""`toolq run`, `toolq demo` and `toolq fake-model` as a user runs them: real processes, a real
Redis, the fake model (or nothing at all) over TCP. What the user sees is asserted line by line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tests.integration.conftest as c
from toolq.dev.fake_model import FakeModel
from toolq.dev.fake_model.builders import http_error, message

pytestmark = pytest.mark.integration


def toolq(*args: str, env: dict[str, str], stdin: str | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    base["TOOLQ_TOOLS_PATH"] = os.environ["TOOLQ_TOOLS_PATH"]  # the tests' tool modules (tests/conftest.py)
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], input=stdin, capture_output=True,
                          text=True, env={**base, **env}, timeout=timeout)


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def env(redis_server, tmp_path) -> dict[str, str]:
    return {"REDIS_URL": redis_server.url, "TOOLQ_WORKSPACE": str(tmp_path), "TOOLQ_SIGNING_KEY": c.SIGNING_KEY}


def test_an_unreachable_endpoint_is_named_in_every_retry_line_and_in_the_final_error(env):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    out = toolq("run", "--json", "hi", env={**env, "OPENAI_BASE_URL": url, "TOOLQ_REQUEST_MAX_RETRIES": "0",
                                            "TOOLQ_STREAM_MAX_RETRIES": "2"})
    assert out.returncode == 1, out.stderr
    said = [e["message"] for e in events(out.stdout) if e["type"] == "error"]
    assert len(said) == 3 and said[0].startswith("Reconnecting... 1/2 (") and said[1].startswith("Reconnecting... 2/2 (")
    for line in said:
        assert f"cannot reach {url}/responses (ConnectError" in line
    last = events(out.stdout)[-1]
    assert isinstance(last.pop("timestamp"), float)
    assert last == {"type": "turn.failed", "turn_id": events(out.stdout)[0]["turn_id"], "error": {"message": said[-1]}}


@pytest.mark.parametrize("status, fix", [(401, "set OPENAI_API_KEY to a valid key for this server"),
                                         (403, "the key in OPENAI_API_KEY may not use this model or endpoint")])
def test_an_authentication_error_ends_the_run_on_the_first_answer(env, status, fix):
    body = {"error": {"message": "Incorrect API key provided: sk-wrong.", "type": "invalid_request_error",
                      "param": None, "code": "invalid_api_key"}}
    with FakeModel([[http_error(status, body)]] * 6) as fake:
        out = toolq("run", "--json", "hi", env={**env, "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "sk-wrong"})
    assert out.returncode == 1 and len(fake.requests) == 1
    said = [e["message"] for e in events(out.stdout) if e["type"] == "error"]
    assert len(said) == 1 and "\n" not in said[0]  # no Reconnecting lines: a wrong key stays wrong
    assert said[0].startswith(f"{status} ") and f" from {fake.base_url}/responses: Incorrect API key provided" in said[0]
    assert fix in said[0]


def test_the_prompt_can_come_from_stdin(env):
    with FakeModel([[message("ok")]]) as fake:
        out = toolq("run", "--json", env={**env, "OPENAI_BASE_URL": fake.base_url}, stdin="count the files\nin src\n")
    assert out.returncode == 0, out.stderr
    assert fake.requests[0]["input"][0]["content"][0]["text"] == "count the files\nin src"
    assert events(out.stdout)[-1]["type"] == "turn.completed"


@pytest.fixture
def one_message_script(tmp_path) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(["hello again"]))
    return path


def serve(script: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "fake-model", "--script", str(script),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_fake_model_loop_serves_its_script_to_run_after_run(env, one_message_script):
    proc, url = serve(one_message_script, "--loop")
    try:
        runs = [toolq("run", "--json", "hi", env={**env, "OPENAI_BASE_URL": url}) for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    for out in runs:
        assert out.returncode == 0, out.stdout
        assert [e["item"]["text"] for e in events(out.stdout) if e["type"] == "item.completed"] == ["hello again"]


def test_without_loop_the_next_run_is_told_the_script_is_exhausted(env, one_message_script):
    proc, url = serve(one_message_script)
    try:
        first = toolq("run", "--json", "hi", env={**env, "OPENAI_BASE_URL": url})
        second = toolq("run", "--json", "hi", env={**env, "OPENAI_BASE_URL": url})
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert first.returncode == 0
    assert second.returncode == 1
    said = [e for e in events(second.stdout) if e["type"] in ("error", "item.completed")]
    assert len(said) == 1 and said[0]["type"] == "error"  # not a message the "model" spoke, and no retries
    assert "script exhausted" in said[0]["message"] and "--loop" in said[0]["message"]


def test_demo_works_in_the_workspace_it_is_given(env, fleet, tmp_path):
    workspace = tmp_path / "my demo"
    workspace.mkdir()
    out = toolq("demo", "--workspace", str(workspace), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (workspace / "hello.txt").read_text() == "Hello from toolq\n"
    assert f"workspace {workspace}: hello.txt = 'Hello from toolq'" in out.stdout


@pytest.mark.parametrize("command", [["turns"], ["status", "turn-0123456789ab"], ["cancel", "turn-0123456789ab"],
                                     ["turns", "--json"]])
def test_redis_down_is_one_line_naming_the_url_and_exit_2(tmp_path, command):
    url = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"
    out = toolq(*command, env={"REDIS_URL": url, "TOOLQ_WORKSPACE": str(tmp_path), "TOOLQ_SIGNING_KEY": c.SIGNING_KEY})
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert "cannot reach Redis at redis://:****@127.0.0.1:" in line and "hunter2" not in line


def test_a_turn_that_starts_while_redis_is_down_fails_with_one_terminal_event_and_saves_the_session(tmp_path):
    """It used to print `turn.started`, then a traceback out of `ledger.start_turn`, and no session."""
    url = f"redis://:hunter2@127.0.0.1:{closed_port()}/0"
    session, workspace = tmp_path / "session.json", tmp_path / "ws"  # the session file outside the workspace
    workspace.mkdir()
    with FakeModel([[message("never asked")]]) as fake:
        out = toolq("run", "--json", "--session", str(session), "hi",
                    env={"REDIS_URL": url, "TOOLQ_WORKSPACE": str(workspace), "TOOLQ_SIGNING_KEY": c.SIGNING_KEY,
                         "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "test"})
        assert fake.requests == []
    assert out.returncode == 2, out.stderr
    kinds = [e["type"] for e in events(out.stdout)]
    assert kinds == ["turn.started", "error", "turn.failed"]
    assert "cannot reach Redis at redis://:****@127.0.0.1:" in events(out.stdout)[-1]["error"]["message"]
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert json.loads(session.read_text())[-1]["content"][0]["text"] == "hi"
