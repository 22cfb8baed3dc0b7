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
from toolq.dev.fake_model.builders import function_call, http_error, message

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
    assert out.returncode == 2, out.stderr  # it could not start, as with Redis unreachable (was 1)
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
    answer = tmp_path / "answer.txt"
    out = toolq("demo", "--workspace", str(workspace), "-o", str(answer), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (workspace / "hello.txt").read_text() == "Hello from toolq\n"
    # The demo's report is status lines, with the view on stderr; stdout is the final message alone.
    assert f"workspace {workspace}: hello.txt = 'Hello from toolq'" in out.stderr
    assert "every call was paired with exactly one output." in out.stderr
    assert out.stdout == answer.read_text() + "\n" and out.stdout.strip() and out.stdout.strip() in out.stderr


# Issue 26 item 1: stdout is the final message alone (the live view goes to stderr), as `codex exec`
# does, and -o writes it to a file, never through a link and never inside the workspace.

ANSWER = "the answer\nis two lines"


@pytest.fixture
def outside(tmp_path, env) -> tuple[dict[str, str], Path]:
    """A workspace below tmp_path, so that a file in tmp_path lies outside it."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return {**env, "TOOLQ_WORKSPACE": str(workspace)}, workspace


def command_then_answer() -> list:
    return [[function_call("exec_command", {"cmd": "echo from-the-command"}, call_id="call_echo")], [message(ANSWER)]]


def test_stdout_holds_only_the_final_message_and_stderr_the_live_view(fleet, outside):
    env, _ = outside
    with FakeModel(command_then_answer()) as fake:
        out = toolq("run", "hi", env={**env, "OPENAI_BASE_URL": fake.base_url})
    assert out.returncode == 0, out.stderr
    assert out.stdout == ANSWER + "\n"
    view = out.stderr.splitlines()
    assert view[0].startswith("toolq turn turn-")
    (done,) = [line for line in view if "call_echo" in line and "completed" in line]
    assert done.startswith("  ✓ exec_command ")
    assert "    │ from-the-command" in view  # the command's output, though it ended between two updates
    assert view[-1].startswith("turn completed (")


@pytest.mark.parametrize("json_events", [False, True])
def test_o_writes_the_final_message_as_the_model_wrote_it(fleet, outside, tmp_path, json_events):
    env, _ = outside
    answer = tmp_path / "answer.txt"
    answer.write_text("an earlier run's answer, longer than this one's")
    with FakeModel(command_then_answer()) as fake:
        out = toolq("run", *(["--json"] if json_events else []), "--output-last-message", str(answer), "hi",
                    env={**env, "OPENAI_BASE_URL": fake.base_url})
    assert out.returncode == 0, out.stderr
    assert answer.read_text() == ANSWER
    if json_events:  # every line on stdout is an event: no view, no answer
        kinds = [e["type"] for e in events(out.stdout)]
        assert kinds[0] == "turn.started" and kinds[-1] == "turn.completed"
    else:
        assert out.stdout == ANSWER + "\n"


def test_o_refuses_a_link_and_the_workspace_before_the_turn_starts(outside, tmp_path):
    env, workspace = outside
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = tmp_path / "answer.txt"
    link.symlink_to(target)
    with FakeModel([[message(ANSWER)]]) as fake:
        env = {**env, "OPENAI_BASE_URL": fake.base_url}
        refused = [toolq("run", "-o", str(link), "hi", env=env),
                   toolq("run", "-o", str(workspace / "answer.txt"), "hi", env=env)]
        assert fake.requests == []  # refused before the first request
    for out, why in zip(refused, ("is a symbolic link; toolq does not write through one",
                                  "is inside the workspace"), strict=True):
        assert out.returncode == 2 and out.stdout == ""
        (line,) = out.stderr.splitlines()
        assert line.startswith("toolq: --output-last-message ") and why in line, line
    assert target.read_text() == "keep me" and not (workspace / "answer.txt").exists()


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
    """It used to print `turn.started`, then a traceback out of `ledger.start_turn`, and no session;
    then a turn id for a turn that never started."""
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
    assert kinds == ["error", "turn.failed"]  # no turn.started: it never started, no id to look for
    assert "cannot reach Redis at redis://:****@127.0.0.1:" in events(out.stdout)[-1]["error"]["message"]
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert json.loads(session.read_text())[-1]["content"][0]["text"] == "hi"


def test_o_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    from toolq.cli.run import LastMessageFile
    from toolq.core.errors import ConfigurationError

    fifo, folder = tmp_path / "fifo", tmp_path / "folder"
    os.mkfifo(fifo)  # nobody reads it: a blocking open would hang the run
    folder.mkdir()
    for path in (fifo, folder, Path("/dev/null")):
        with pytest.raises(ConfigurationError, match="--output-last-message"):
            LastMessageFile.open(path, tmp_path / "ws")


def test_resume_puts_the_final_message_alone_on_stdout_and_in_o(fleet, outside, tmp_path):
    """A `toolq run` SIGKILLed mid-call, then `toolq resume TURN -o FILE` without --json."""
    import signal
    import time

    env, workspace = outside
    marker = workspace / "ran.txt"  # where the sandboxed command may write
    script = [[function_call("exec_command", {"cmd": f"echo ran >> {marker}; sleep 2; echo finished"},
                             call_id="call_durable")], [message(ANSWER)]]
    answer = tmp_path / "answer.txt"
    with FakeModel(script) as fake:
        env = {**env, "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "test", "TOOLQ_TURN_LEASE": "3"}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
        proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "run", "--json", "go"],
                                env={**base, "TOOLQ_TOOLS_PATH": os.environ["TOOLQ_TOOLS_PATH"], **env},
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        turn_id = json.loads(proc.stdout.readline())["turn_id"]
        end = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < end, "the command never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        end = time.monotonic() + 60
        while (resumed := toolq("resume", turn_id, "-o", str(answer), env=env)).returncode == 2:
            assert "another orchestrator" in resumed.stderr, resumed.stderr  # the dead run's lease, until it expires
            assert time.monotonic() < end, resumed.stderr
            time.sleep(0.5)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout == ANSWER + "\n" and answer.read_text() == ANSWER
    assert "turn completed (" in resumed.stderr.splitlines()[-1]


def test_a_worker_without_a_logfile_says_its_sandbox_once(redis_server):
    """The banner was printed, then logged, both on stderr (a newcomer read it twice)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    env.update(REDIS_URL=redis_server.url, TOOLQ_SIGNING_KEY=c.SIGNING_KEY)
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "worker", "--concurrency", "1",
                             "--name", f"banner-{os.getpid()}@test"], env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if " ready." in line:
                break
    finally:
        proc.terminate()
        proc.wait(60)
    assert any(" ready." in line for line in lines), "".join(lines)[-2000:]
    assert sum("sandbox: " in line for line in lines) == 1, "".join(lines)[-2000:]
