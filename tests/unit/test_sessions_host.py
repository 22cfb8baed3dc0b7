"""The session host on its own (no worker, no Redis): sessions, tty, the conversation check, and
a caller that hangs up killing its command. The fleet side is in tests/integration/test_sessions.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.flower_args import FLOWER_ARGS_CHARS as FLOWER_COMMAND_CHARS
from toolq.orchestrator.transport.dispatch import flower_args
from toolq.workers.exec_output import format_exec_output
from toolq.workers.sessions import host_client as client
from toolq.workers.sessions import start
from toolq.workers.sessions.host import STDIN_CLOSED
from toolq.workers.sessions.protocol import ExecRequest, WriteRequest
from toolq.workers.tools.write_stdin import WriteStdinArgs


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.delenv("TOOLQ_SESSION_SOCKET", raising=False)
    start.start(instance="test", hostname="test@host", redis_url="")
    start.wait_ready()
    yield tmp_path
    start.stop()


def run(ws, cmd: str, *, conversation="c1", tty=False, yield_ms=300.0, cancelled=lambda: False):
    req = ExecRequest(conversation=conversation, cmd=cmd, cwd=str(ws), workspace=str(ws), env=dict(os.environ),
                      tty=tty, yield_ms=yield_ms)
    return client.call(req, cancelled, timeout=20)


def write(session_id: int, chars: str = "", *, conversation="c1", yield_ms=300.0):
    return client.call(WriteRequest(conversation=conversation, session_id=session_id, chars=chars,
                                    yield_ms=yield_ms), lambda: False, timeout=20)


def pgrep(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0


def test_a_finished_command_exits_and_a_running_one_becomes_a_session(host):
    done = run(host, "echo hi")
    assert (done.exit_code, done.session_id, client.output_text(done)) == (0, None, "hi\n")
    live = run(host, "echo a; sleep 1; echo b")
    assert live.session_id is not None and live.exit_code is None and client.output_text(live) == "a\n"
    rest = write(live.session_id, yield_ms=5000)
    assert (rest.exit_code, client.output_text(rest)) == (0, "b\n")
    assert write(live.session_id).error == f"write_stdin failed: Unknown process id {live.session_id}"


def test_tty_keeps_stdin_open_and_a_pipe_session_refuses_writes(host):
    cat = run(host, "cat", tty=True)
    assert client.output_text(write(cat.session_id, "ping\n")) == "ping\r\nping\r\n"
    pipe = run(host, "sleep 5")
    assert write(pipe.session_id, "x").error == STDIN_CLOSED


def test_another_conversation_cannot_reach_a_session(host):
    # An attacker who guesses the id (they are small integers) but not the conversation.
    victim = run(host, "cat", tty=True, conversation="victim")
    stolen = write(victim.session_id, "rm -rf ~\n", conversation="attacker")
    assert stolen.error == f"write_stdin failed: Unknown process id {victim.session_id}"
    assert client.output_text(write(victim.session_id, "", conversation="victim", yield_ms=250)) == ""


def test_a_caller_that_hangs_up_before_the_yield_kills_its_command(host):
    mark = "sleep 4242.25"
    t0 = time.monotonic()
    with pytest.raises(client.Cancelled):
        run(host, mark, yield_ms=10_000, cancelled=lambda: time.monotonic() - t0 > 0.5)
    deadline = time.monotonic() + 5
    while pgrep(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pgrep(mark), "a cancelled exec_command left its process running"


def test_a_command_answered_within_the_first_wait_costs_no_cancel_check(host, monkeypatch):
    # Each check is a Redis round trip on a worker; the call was checked just before it started.
    checks: list[float] = []
    with monkeypatch.context() as m:
        m.setattr(client, "STEP", 5.0)  # the first wait outlasts `true` even on a loaded machine
        assert run(host, "true", cancelled=lambda: checks.append(1) or False).exit_code == 0
    assert checks == []
    assert run(host, "sleep 0.3", yield_ms=5000, cancelled=lambda: checks.append(1) or False).exit_code == 0
    assert len(checks) >= 3  # a command still running is checked every STEP


@pytest.mark.parametrize("subreaper", [False, True])
def test_only_a_subreaper_host_looks_for_orphans_after_a_command(tmp_path, monkeypatch, subreaper):
    # Elsewhere its only children are the leaders: reading every thread's children list
    # (~20 files) after each command was a quarter of the host's CPU per command.
    from toolq.core.settings import Settings
    from toolq.workers import isolation
    from toolq.workers.sessions import host as host_module

    looked: list[int] = []
    monkeypatch.setattr(isolation, "_current", None)
    monkeypatch.setattr(host_module.reaper, "is_subreaper", lambda: subreaper)
    monkeypatch.setattr(host_module.reaper, "children", lambda pid: looked.append(pid) or [])
    h = host_module.Host(Settings.load({"TOOLQ_SANDBOX": "none"}), "i", "h", None)
    ours, theirs = socket.socketpair()
    req = ExecRequest(conversation="c", cmd="true", cwd=str(tmp_path), workspace=str(tmp_path),
                      env=dict(os.environ), yield_ms=5000)
    assert h.handle_exec(req, theirs).exit_code == 0
    ours.close(), theirs.close()
    assert bool(looked) is subreaper


def test_the_socket_is_private_to_the_worker_user(host):
    path = client.socket_path()
    assert path and os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(b'{"op": "exec", "garbage": true}\n')  # a bad request gets no reply, and no process
    sock.settimeout(2)
    assert sock.recv(100) == b""
    sock.close()


@pytest.mark.parametrize("key", [b"", b"0" * 64, None], ids=["none", "wrong", "truncated"])
def test_a_request_without_the_worker_key_runs_nothing(host, tmp_path, key):
    # A process of the worker's own uid (a Landlock command finds the socket in /proc/net/unix)
    # must not get a command started, least of all with a workspace of its choosing.
    real = client._key
    assert real
    forged = ExecRequest(conversation="c", cmd=f"touch {tmp_path}/ran", cwd="/", workspace="/", env={},
                         yield_ms=2000)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(client.socket_path())
    sock.sendall((real[:-1] if key is None else key) + b"\n" + forged.model_dump_json().encode() + b"\n")
    sock.settimeout(5)
    try:
        answer = sock.recv(100)
    except ConnectionResetError:  # hung up with the request unread
        answer = b""
    assert answer == b""
    sock.close()
    assert not (tmp_path / "ran").exists()
    assert run(tmp_path, f"touch {tmp_path}/ran").exit_code == 0  # the worker's own request, with its key
    assert (tmp_path / "ran").exists()


def test_stopping_the_host_kills_every_session(tmp_path, monkeypatch):
    monkeypatch.delenv("TOOLQ_SESSION_SOCKET", raising=False)
    start.start(instance="test", hostname="test@host", redis_url="")
    start.wait_ready()
    mark = "sleep 4343.25"
    assert run(tmp_path, mark).session_id is not None
    start.stop()
    deadline = time.monotonic() + 5
    while pgrep(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pgrep(mark)


@pytest.mark.parametrize("chars,given,expected", [("x", None, 250), ("x", 10, 250), ("x", 99_999, 30_000),
                                                  ("", None, 5_000), ("", 400_000, 300_000), ("", 7000, 7000)])
def test_write_stdin_clamps_yield_time_as_codex(chars, given, expected):
    assert WriteStdinArgs(session_id=1, chars=chars, yield_time_ms=given).yield_ms() == expected


def test_a_running_session_reads_as_codex_text():
    text = format_exec_output("out\n", None, 0.25, 100, session_id=7)
    assert text.split("\n")[1:] == ["Wall time: 0.2500 seconds", "Process running with session ID 7",
                                    "Original token count: 1", "Output:", "out", ""]


def _inv(name: str, arguments: str) -> ToolInvocation:
    return ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName(name=name),
                          payload=FunctionPayload(arguments=arguments), deadline=0)


def _flower(name: str, arguments: str) -> str:
    from toolq.workers.loader import load_catalog

    spec = load_catalog().get(ToolName(name=name))
    assert spec is not None
    return flower_args(_inv(name, arguments), spec)


def test_flower_shows_the_command_line_cut_short_and_nothing_else():
    long = "echo " + "x" * 1000
    shown = _flower("exec_command", json.dumps({"cmd": long, "workdir": "secret-dir"}))
    assert "echo xxx" in shown and len(shown) < FLOWER_COMMAND_CHARS + 80 and "secret-dir" not in shown
    assert _flower("write_stdin", '{"session_id": 3, "chars": "hello"}') == "(call_id='c', turn='t', session_id=3, chars=5)"
    assert "secret" not in _flower("read_file", '{"path": "secret"}')
    assert _flower("exec_command", "not json") == "(call_id='c', turn='t')"


class Heard:
    """An `OutputStream` stand-in: what the host streamed, and when."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, bytes]] = []

    def write(self, data: bytes) -> None:
        self.chunks.append((time.monotonic(), data))

    def tick(self) -> None:
        pass


def test_a_streaming_request_hears_the_output_as_it_comes_and_the_reply_is_unchanged(host):
    heard = Heard()
    req = ExecRequest(conversation="c1", cmd="echo one; sleep 0.6; echo two", cwd=str(host), workspace=str(host),
                      env=dict(os.environ), yield_ms=5000, stream=True)
    reply = client.call(req, lambda: False, timeout=20, output=heard)
    replied = time.monotonic()
    assert b"".join(c for _, c in heard.chunks) == b"one\ntwo\n"
    assert replied - heard.chunks[0][0] > 0.4  # "one" came while the command still ran
    assert (reply.exit_code, client.output_text(reply)) == (0, "one\ntwo\n")  # the reply has it all
    quiet = Heard()
    client.call(req.model_copy(update={"stream": False}), lambda: False, timeout=20, output=quiet)
    assert quiet.chunks == []


def test_a_streaming_write_hears_the_sessions_output_while_it_waits(host):
    live = run(host, "echo a; sleep 0.5; echo b; sleep 1.0; echo c", yield_ms=200)
    assert live.session_id is not None and client.output_text(live) == "a\n"
    time.sleep(0.5)  # "b" comes before the poll: it shows with what the poll waits for, as in its reply
    heard = Heard()
    poll = WriteRequest(conversation="c1", session_id=live.session_id, yield_ms=5000, stream=True)
    reply = client.call(poll, lambda: False, timeout=20, output=heard)
    replied = time.monotonic()
    assert b"".join(c for _, c in heard.chunks) == b"b\nc\n"
    assert replied - heard.chunks[0][0] > 0.3  # "b" came while the poll still waited
    assert (reply.exit_code, client.output_text(reply)) == (0, "b\nc\n")
    cat = run(host, "cat", tty=True)
    typed = Heard()
    client.call(WriteRequest(conversation="c1", session_id=cat.session_id, chars="ping\n", yield_ms=400,
                             stream=True), lambda: False, timeout=20, output=typed)
    assert b"".join(c for _, c in typed.chunks) == b"ping\r\nping\r\n"  # a write streams too
    quiet = Heard()
    client.call(WriteRequest(conversation="c1", session_id=cat.session_id, chars="x\n", yield_ms=400),
                lambda: False, timeout=20, output=quiet)
    assert quiet.chunks == []


def test_a_host_that_did_not_start_is_replaced_and_the_worker_goes_on(tmp_path, monkeypatch):
    """The worker launches its host at setup and waits for it only before its first call: one that
    died booting is said in the log, and the watcher's replacement takes the calls."""
    monkeypatch.delenv("TOOLQ_SESSION_SOCKET", raising=False)
    launched = []
    real = start._launch

    def first_dies(path, env):
        launched.append(path)
        if len(launched) == 1:
            return subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        return real(path, env)

    monkeypatch.setattr(start, "_launch", first_dies)
    start.start(instance="test", hostname="test@host", redis_url="")
    try:
        start.wait_ready()  # logs, does not raise
        deadline = time.monotonic() + 15
        while len(launched) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(100):  # the replacement listens once it has booted
            try:
                done = run(tmp_path, "echo back")
                break
            except client.HostUnavailable:
                time.sleep(0.1)
        assert client.output_text(done) == "back\n" and len(launched) == 2
    finally:
        start.stop()


class _Held:
    def __init__(self, processes: int, memory: int = 0) -> None:
        self.processes, self.memory = processes, memory

    def held(self) -> tuple[int, int]:
        return self.processes, self.memory


class _Running:
    def __init__(self, conversation: str, started: float, processes: int, session_id: int | None) -> None:
        self.conversation, self.started, self.session_id = conversation, started, session_id
        self.slot, self.killed_for, self.killed = _Held(processes), None, False

    def kill(self) -> None:
        self.killed = True


def test_a_conversation_past_its_bound_loses_its_newest_sessions_only():
    import threading

    from toolq.workers.isolation.policy import Limits
    from toolq.workers.sessions.host import Host

    host = Host.__new__(Host)  # only the bound's bookkeeping: no sandbox, socket or Redis
    host.lock = threading.Lock()
    host.slots = type("S", (), {"lim": Limits(2048, 256, 300, 1024, conversation_processes=150)})()
    a = [_Running("a", started=k, processes=60, session_id=k + 1) for k in range(4)]  # 240 together
    inside_call = _Running("a", started=9, processes=10, session_id=None)  # bounded by its call's limits
    b = [_Running("b", started=k, processes=120, session_id=k + 1) for k in range(1)]
    host.running = {*a, inside_call, *b}
    host._enforce_conversation_bounds([*a, *b], ended=set())
    killed = [p.session_id for p in a if p.killed]
    assert killed == [3, 4], killed  # 250 -> 190 -> 130: the newest two, no more
    assert all("TOOLQ_SANDBOX_CONVERSATION_PROCESSES" in p.killed_for for p in a if p.killed)
    assert not inside_call.killed and not any(p.killed for p in b)
