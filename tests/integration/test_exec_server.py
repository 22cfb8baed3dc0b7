"""`toolq exec-server` against real Redis and real workers (the shared `fleet`), driven by a Python
WebSocket client that speaks the protocol as Codex CLI 0.171.0 does (frames modeled on the
recordings of the reference: initialize, the ancestors' `.git` probes pipelined, process/start
with `bash -lc`, apply_patch's fs/* sequence, a resume after a dropped connection)."""

from __future__ import annotations

import base64
import itertools
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

import tests.integration.conftest as c
from tests.integration.test_cancel import pids_matching
from tests.integration.test_codex_exec_server import host  # noqa: F401  # a worker host for environments

pytestmark = pytest.mark.integration

TIMEOUT = 60.0


def server_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLQ_EXEC_SERVER_")}
    return {**env, **c.WORKER_ENV, "REDIS_URL": redis_url, **extra}


class Server:
    """A `toolq exec-server` process; its stderr lines are collected as they come."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.stderr: list[str] = []
        self.url = ""
        self.redis_url = ""
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.decode(errors="replace"))

    def turn_of(self, session_id: str) -> str:
        """The session's turn, as the server logs it when the session opens."""
        end = time.monotonic() + TIMEOUT
        while time.monotonic() < end:
            for line in self.stderr:
                if f"session {session_id}: turn " in line:
                    return line.split(": turn ", 1)[1].split()[0]
            time.sleep(0.02)
        raise AssertionError(f"no turn logged for {session_id}: {''.join(self.stderr)}")


@contextmanager
def exec_server(redis_url: str, workspace: Path | None, *extra: str, **env: str) -> Iterator[Server]:
    """`toolq exec-server` on `workspace` (None: `extra` names the source, e.g. `--upload DIR`)."""
    where = ["--workspace", str(workspace)] if workspace is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "exec-server", *where,
                             *extra], env=server_env(redis_url, **env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    server = Server(proc)
    server.redis_url = redis_url
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().decode()
        assert first.startswith("toolq exec-server: listening on ws://"), (first, "".join(server.stderr))
        server.url = first.rsplit(" ", 1)[1].strip()
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Client:
    """The Codex side: ids from 1 per connection, requests pipelined, notifications kept by process."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.answers: dict[int, dict[str, Any]] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}

    @classmethod
    @contextmanager
    def connect(cls, url: str, **kw: Any) -> Iterator[Client]:
        with connect(url, max_size=None, compression=None, **kw) as ws:
            yield cls(ws)

    def send(self, method: str, params: Any) -> int:
        id_ = next(self.ids)
        self.ws.send(json.dumps({"id": id_, "method": method, "params": params}))
        return id_

    def notify(self, method: str, params: Any = None) -> None:
        self.ws.send(json.dumps({"method": method, "params": params if params is not None else {}}))

    def _read_one(self) -> None:
        message = json.loads(self.ws.recv(timeout=TIMEOUT))
        if "id" in message and "method" not in message:
            self.answers[message["id"]] = message
        else:
            self.events.setdefault(message["params"]["processId"], []).append(message)

    def answer(self, id_: int) -> dict[str, Any]:
        while id_ not in self.answers:
            self._read_one()
        return self.answers.pop(id_)

    def call(self, method: str, params: Any) -> dict[str, Any]:
        return self.answer(self.send(method, params))

    def result(self, method: str, params: Any) -> Any:
        reply = self.call(method, params)
        assert "result" in reply, reply
        return reply["result"]

    def error(self, method: str, params: Any) -> dict[str, Any]:
        reply = self.call(method, params)
        assert "error" in reply, reply
        return reply["error"]

    def initialize(self, resume: str | None = None) -> dict[str, Any]:
        result = self.result("initialize", {"clientName": "codex-environment", "resumeSessionId": resume})
        self.notify("initialized")
        return result

    def until(self, process_id: str, kind: str) -> list[dict[str, Any]]:
        """The process's notifications until one of `kind` (e.g. process/closed) came."""
        while not any(e["method"] == kind for e in self.events.get(process_id, [])):
            self._read_one()
        return self.events[process_id]


def process_start(root: Path, command: str, *, tty: bool = False, pipe_stdin: bool = False,
                  cwd: str | None = None) -> dict[str, Any]:
    """process/start as Codex 0.171.0 sends it (`c_session_stdin`, env shortened)."""
    return {"processId": f"{secrets.randbelow(99999)}-{uuid.uuid4()}",
            "metadata": {"threadId": str(uuid.uuid4()), "toolCallId": "call_x"},
            "argv": ["/bin/bash", "-lc", command], "cwd": cwd or uri(root),
            "envPolicy": {"inherit": "all", "ignoreDefaultExcludes": True, "exclude": [], "set": {},
                          "includeOnly": []},
            "env": {"LC_ALL": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", "PAGER": "cat", "CODEX_CI": "1"},
            "tty": tty, "pipeStdin": pipe_stdin, "arg0": None, "sandbox": None, "enforceManagedNetwork": False,
            "managedNetwork": None}


def uri(path: Path | str) -> str:
    return f"file://{path}"


def finished(events: list[dict[str, Any]]) -> tuple[bytes, int]:
    """A process's output and exit code, once it closed; its seqs are 1..n with no gap, `closed` last."""
    seqs = [e["params"]["seq"] for e in events]
    assert seqs == list(range(1, len(events) + 1)), seqs
    assert events[-1]["method"] == "process/closed"
    exited = [e["params"] for e in events if e["method"] == "process/exited"]
    assert len(exited) == 1 and exited[0]["sandboxDenied"] is False
    output = b"".join(base64.b64decode(e["params"]["chunk"]) for e in events if e["method"] == "process/output")
    return output, exited[0]["exitCode"]


def run(client: Client, root: Path, command: str, **kw: Any) -> tuple[bytes, int]:
    params = process_start(root, command, **kw)
    assert client.result("process/start", params) == {"processId": params["processId"]}
    out = finished(client.until(params["processId"], "process/closed"))
    # after closed, Codex always cleans up with a terminate
    assert client.result("process/terminate", {"processId": params["processId"]}) == {"running": False}
    return out


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def server(fleet, redis_server, workspace) -> Iterator[Server]:
    with exec_server(redis_server.url, workspace) as s:
        yield s


def test_codex_start_up_then_echo_hi_streams_output_exited_and_closed_in_one_seq(server, workspace):
    with Client.connect(server.url) as client:
        assert client.error("process/start", process_start(workspace, "true"))["code"] == -32600  # before initialize
        info = client.initialize()
        assert info["environmentInfo"] == {"shell": {"name": "bash", "path": "/bin/bash"}, "cwd": uri(workspace)}
        # git-root discovery: every ancestor's .git, pipelined, answered -32004 (no fleet call for outside ones)
        ancestors = [workspace, *workspace.parents]
        ids = [client.send("fs/getMetadata", {"path": uri(p / ".git") if str(p) != "/" else "file:///.git",
                                              "sandbox": None}) for p in ancestors]
        for id_ in ids:
            assert client.answer(id_)["error"] == {"code": -32004, "message": "No such file or directory (os error 2)"}
        client.notify("something/else")  # ignored, the connection goes on
        assert run(client, workspace, "echo hi") == (b"hi\n", 0)
        assert client.error("no/such/method", {})["code"] == -32601
    # the command was a toolq call: in the ledger, as `toolq status` shows it
    turn = server.turn_of(info["sessionId"])
    done = subprocess.run([sys.executable, "-m", "toolq.cli.main", "status", turn, "--json"],
                          env=server_env(server.redis_url), capture_output=True, text=True, timeout=TIMEOUT)
    calls = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert [call["tool"] for call in calls] == ["process_start"], (done.stdout, done.stderr)


def test_a_big_output_streams_whole_in_chunks_of_at_most_8192_bytes(server, workspace):
    with Client.connect(server.url) as client:
        client.initialize()
        output, code = run(client, workspace, "seq 1 300000")
        assert code == 0 and output == "".join(f"{i}\n" for i in range(1, 300001)).encode()
        p = next(iter(client.events.values()))
        assert max(len(base64.b64decode(e["params"]["chunk"])) for e in p if e["method"] == "process/output") <= 8192


def test_parallel_processes_each_complete_with_their_own_output(server, workspace):
    with Client.connect(server.url) as client:
        client.initialize()
        starts = [process_start(workspace, f"sleep 0.5; echo out{i}") for i in range(3)]
        ids = [client.send("process/start", p) for p in starts]  # back to back, as Codex sends parallel calls
        for id_, p in zip(ids, starts, strict=True):
            assert client.answer(id_)["result"] == {"processId": p["processId"]}
        for i, p in enumerate(starts):
            assert finished(client.until(p["processId"], "process/closed")) == (f"out{i}\n".encode(), 0)


def test_a_tty_session_is_written_to_and_a_closed_stdin_says_so(server, workspace):
    with Client.connect(server.url) as client:
        client.initialize()
        p = process_start(workspace, "read line; echo \"got:$line\"", tty=True)
        client.result("process/start", p)
        assert client.result("process/write", {"processId": p["processId"], "chunk": base64.b64encode(b"hello\n")
                                               .decode(), "writeId": "1"}) == {"status": "accepted"}
        output, code = finished(client.until(p["processId"], "process/closed"))
        assert b"got:hello" in output and code == 0
        assert all(e["params"]["stream"] == "pty" for e in client.events[p["processId"]]
                   if e["method"] == "process/output")
        plain = process_start(workspace, "sleep 30")
        client.result("process/start", plain)
        assert client.result("process/write", {"processId": plain["processId"], "chunk": "eAo=", "writeId": "1"}) \
            == {"status": "stdinClosed"}
        assert client.result("process/write", {"processId": "nope", "chunk": "eA==", "writeId": "1"}) \
            == {"status": "unknownProcess"}
        client.result("process/terminate", {"processId": plain["processId"]})


def test_terminate_kills_a_running_process_which_exits_137(server, workspace):
    marker = f"toolq-es-term-{secrets.token_hex(4)}"
    with Client.connect(server.url) as client:
        client.initialize()
        p = process_start(workspace, f"echo up; exec -a {marker} sleep 600")
        client.result("process/start", p)
        client.until(p["processId"], "process/output")
        assert client.result("process/terminate", {"processId": p["processId"]}) == {"running": True}
        output, code = finished(client.until(p["processId"], "process/closed"))
        assert (output, code) == (b"up\n", 137)
        assert client.result("process/terminate", {"processId": p["processId"]}) == {"running": False}
        assert client.result("process/terminate", {"processId": "nope"}) == {"running": False}
    assert pids_matching(marker) == []


def test_a_failing_command_passes_its_exit_code_and_stderr(server, workspace):
    with Client.connect(server.url) as client:
        client.initialize()
        output, code = run(client, workspace, "echo out; echo err >&2; exit 3")
        assert code == 3 and b"out\n" in output and b"err\n" in output
        output, code = run(client, workspace, "no-such-command-here")
        assert code == 127 and b"not found" in output


def test_a_missing_or_outside_cwd_is_spawn_not_found(server, workspace):
    (workspace / "sub").mkdir()
    with Client.connect(server.url) as client:
        client.initialize()
        for cwd in (uri(workspace / "nope"), uri(workspace.parent), "file:///etc"):
            error = client.error("process/start", process_start(workspace, "true", cwd=cwd))
            assert error["code"] == -32603 and error["data"] == {"kind": "spawnNotFound"}, error
        assert run(client, workspace, "pwd", cwd=uri(workspace / "sub"))[0].strip().endswith(b"/sub")
        assert client.error("process/start", {"processId": "x"}) == {"code": -32602, "message": "missing field `argv`"}
        # Codex's -s read-only: a workspace toolq's cell cannot keep unwritable is refused, never run weaker
        read_only = {"permissions": {"type": "managed", "file_system": {"type": "restricted", "entries": [
            {"path": {"type": "special", "value": {"kind": "root"}}, "access": "read"}]}, "network": "restricted"}}
        error = client.error("process/start", {**process_start(workspace, "touch x"), "sandbox": read_only})
        assert error["code"] == -32603 and "read-only" in error["message"]
        error = client.error("fs/writeFile", {"path": uri(workspace / "x"), "dataBase64": "eA==", "sandbox": read_only})
        assert error["code"] == -32603 and not (workspace / "x").exists()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_apply_patch_adds_updates_and_deletes_files_through_fs(server, workspace):
    nested = workspace / "sub" / "dir" / "new.txt"
    with Client.connect(server.url) as client:
        client.initialize()
        p = {"path": uri(nested), "sandbox": None}
        # Add (d_apply_patch): getMetadata, readFile, writeFile all -32004, then the parent made, then written
        assert client.error("fs/getMetadata", p)["code"] == -32004
        assert client.error("fs/readFile", p)["code"] == -32004
        written = client.call("fs/writeFile", {**p, "dataBase64": b64(b"nested\n")})
        if "error" in written:  # a missing parent: -32004, on which Codex makes the folder and writes again
            assert written["error"]["code"] == -32004
            assert client.result("fs/createDirectory", {"path": uri(nested.parent), "recursive": True,
                                                        "sandbox": None}) == {}
            assert client.result("fs/writeFile", {**p, "dataBase64": b64(b"nested\n")}) == {}
        assert nested.read_bytes() == b"nested\n"
        # Update: read, metadata, read, write
        assert client.result("fs/readFile", p) == {"dataBase64": b64(b"nested\n")}
        meta = client.result("fs/getMetadata", p)
        assert (meta["isFile"], meta["isDirectory"], meta["isSymlink"], meta["size"]) == (True, False, False, 7)
        assert client.result("fs/writeFile", {**p, "dataBase64": b64(b"there\n")}) == {}
        assert nested.read_bytes() == b"there\n"
        # Delete: metadata, read, metadata, remove
        assert client.result("fs/remove", {**p, "recursive": False, "force": False}) == {}
        assert not nested.exists()
        assert client.error("fs/readFile", p)["code"] == -32004
        # a directory is no file; a plain path is no URI; a write outside the workspace is refused
        assert client.error("fs/readFile", {"path": uri(workspace / "sub"), "sandbox": None})["code"] == -32600
        assert client.error("fs/getMetadata", {"path": str(workspace), "sandbox": None})["code"] == -32602
        outside = workspace.parent / "outside.txt"
        assert client.error("fs/writeFile", {"path": uri(outside), "dataBase64": b64(b"x"),
                                             "sandbox": None})["code"] == -32603
        assert not outside.exists()
        listing = client.result("fs/readDirectory", {"path": uri(workspace / "sub"), "sandbox": None})
        assert [e["fileName"] for e in listing["entries"]] == ["dir"]


def test_a_dropped_connection_resumes_the_session_and_catches_up_with_process_read(server, workspace):
    with Client.connect(server.url) as first:
        session = first.initialize()["sessionId"]
        p = process_start(workspace, "echo started; sleep 2; echo after-drop; sleep 1; echo end")
        first.result("process/start", p)
        seen = first.until(p["processId"], "process/output")
        last = seen[-1]["params"]["seq"]
        first.ws.socket.close()  # no close frame: the TCP connection just goes away, as Codex's does
    with Client.connect(server.url) as second:
        assert second.initialize(resume=session)["sessionId"] == session  # ids start again at 1
        caught = second.result("process/read", {"processId": p["processId"], "afterSeq": last, "maxBytes": None,
                                                "waitMs": 0})
        events = seen + [{"method": "process/output", "params": {"processId": p["processId"], **chunk}}
                         for chunk in caught["chunks"]]
        if not caught["closed"]:
            second.events[p["processId"]] = []
            events += second.until(p["processId"], "process/closed")
        output, code = finished(events)
        assert (output, code) == (b"started\nafter-drop\nend\n", 0)
        # a resume naming a session that is gone gets a new one
        with Client.connect(server.url) as third:
            assert third.initialize(resume="no-such-session")["sessionId"] not in (session, "no-such-session")


def start_sleeper(client: Client, workspace: Path, marker: str) -> tuple[str, dict[str, Any]]:
    """A new session (its id) running `sleep 600` named `marker` (its process/start), once it printed."""
    session = client.initialize()["sessionId"]
    p = process_start(workspace, f"echo up; exec -a {marker} sleep 600")
    client.result("process/start", p)
    client.until(p["processId"], "process/output")
    assert pids_matching(marker)
    return session, p


def test_an_abandoned_session_is_reaped_and_nothing_is_left_running(fleet, redis_server, workspace):
    marker = f"toolq-es-reap-{secrets.token_hex(4)}"
    with exec_server(redis_server.url, workspace, TOOLQ_EXEC_SERVER_RESUME="1") as server:
        with Client.connect(server.url) as client:
            session, _ = start_sleeper(client, workspace, marker)
            client.ws.socket.close()
        end = time.monotonic() + TIMEOUT
        while pids_matching(marker) and time.monotonic() < end:
            time.sleep(0.1)
        assert pids_matching(marker) == [], "".join(server.stderr)
        with Client.connect(server.url) as again:
            assert again.initialize(resume=session)["sessionId"] != session  # reaped: a new session


def test_toolq_cancel_of_the_sessions_turn_ends_its_processes(server, workspace, redis_server):
    marker = f"toolq-es-cancel-{secrets.token_hex(4)}"
    with Client.connect(server.url) as client:
        session = client.initialize()["sessionId"]
        p = process_start(workspace, f"echo up; exec -a {marker} sleep 600")
        client.result("process/start", p)
        client.until(p["processId"], "process/output")
        turn = server.turn_of(session)
        done = subprocess.run([sys.executable, "-m", "toolq.cli.main", "cancel", turn],
                              env=server_env(redis_server.url), capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        output, code = finished(client.until(p["processId"], "process/closed"))
        assert code in (-1, 137) and output.startswith(b"up\n")
        output, code = run(client, workspace, "echo again")  # the turn is over: later commands say so
        assert code == -1 and b"[toolq: " in output and b"again" not in output
    end = time.monotonic() + TIMEOUT
    while pids_matching(marker) and time.monotonic() < end:
        time.sleep(0.1)
    assert pids_matching(marker) == []


def test_stdio_mode_speaks_one_message_a_line_and_ends_with_stdin(fleet, redis_server, workspace):
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "exec-server", "--listen", "stdio",
                             "--workspace", str(workspace)], env=server_env(redis_server.url),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        def send(message: dict[str, Any]) -> None:
            proc.stdin.write(json.dumps(message).encode() + b"\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]

        send({"id": 1, "method": "initialize", "params": {"clientName": "codex-environment", "resumeSessionId": None}})
        assert "sessionId" in json.loads(proc.stdout.readline())["result"]
        send({"method": "initialized", "params": {}})
        p = process_start(workspace, "echo via-stdio")
        send({"id": 2, "method": "process/start", "params": p})
        events, answered = [], False
        while not (events and events[-1]["method"] == "process/closed"):
            message = json.loads(proc.stdout.readline())
            if message.get("id") == 2:
                answered = message["result"] == {"processId": p["processId"]}
            else:
                events.append(message)
        assert answered and finished(events) == (b"via-stdio\n", 0)
        proc.stdin.close()
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_off_loopback_a_token_is_required(fleet, redis_server, workspace, tmp_path):
    refused = subprocess.run([sys.executable, "-m", "toolq.cli.main", "exec-server", "--listen", "ws://0.0.0.0:0",
                              "--workspace", str(workspace)], env=server_env(redis_server.url),
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "needs a token" in refused.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with exec_server(redis_server.url, workspace, "--listen", "ws://0.0.0.0:0", "--token-file",
                     str(token_file)) as server:
        port = server.url.rsplit(":", 1)[1]
        with pytest.raises(InvalidStatus) as e, Client.connect(f"ws://127.0.0.1:{port}"):
            pass
        assert e.value.response.status_code == 401
        with Client.connect(f"ws://127.0.0.1:{port}/?token=s3cret-token") as client:
            client.initialize()
            assert run(client, workspace, "echo ok") == (b"ok\n", 0)
        with Client.connect(f"ws://127.0.0.1:{port}",
                            additional_headers={"Authorization": "Bearer s3cret-token"}) as client:
            client.initialize()


def test_bad_options_a_wrong_redis_and_a_port_in_use_are_one_line_and_exit_2(redis_server, workspace):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ws = ["--workspace", str(workspace)]
    cases = [(redis_server.url, ["--git", "https://example.com/r.git"], "need --root"),
             (redis_server.url, ["--git", "https://example.com/r.git", *ws], "exclusive"),
             (redis_server.url, ["--listen", "http://127.0.0.1:1", *ws], "--listen takes"),
             (redis_server.url, ["--upload", str(workspace / "missing")], "not a folder"),
             ("redis://127.0.0.1:1/0", ws, "cannot reach Redis"),
             (redis_server.url, ["--listen", f"ws://127.0.0.1:{port}", *ws], "address already in use")]
    try:
        for url, args, said in cases:
            done = subprocess.run([sys.executable, "-m", "toolq.cli.main", "exec-server", *args],
                                  env=server_env(url), capture_output=True, text=True, timeout=TIMEOUT)
            assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
            assert said in done.stderr and done.stdout == "", (args, done.stderr)
    finally:
        taken.close()


def envs_of(redis_url: str) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "toolq.cli.main", "envs", "--json"], env=server_env(redis_url),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@pytest.mark.usefixtures("host")
def test_upload_gives_each_session_an_environment_of_its_own_destroyed_when_it_is_reaped(redis_env, tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "seed.txt").write_text("seed\n")
    with exec_server(redis_env.url, None, "--upload", str(folder), TOOLQ_EXEC_SERVER_RESUME="1") as server:
        with Client.connect(server.url) as one, Client.connect(server.url) as two:
            assert one.initialize()["environmentInfo"]["cwd"] == uri(folder)  # the client names it by DIR's path
            two.initialize()
            assert run(one, folder, "cat seed.txt; echo made > made.txt") == (b"seed\n", 0)
            assert not (folder / "made.txt").exists()  # written in the environment, not in DIR
            assert one.result("fs/readFile", {"path": uri(folder / "made.txt"), "sandbox": None}) == \
                {"dataBase64": b64(b"made\n")}
            assert run(two, folder, "cat made.txt")[1] != 0  # the other session's environment has no such file
            live = [e for e in envs_of(redis_env.url) if e.get("state") not in ("destroyed", "lost")]
            assert len(live) == 2, live
            one.ws.socket.close()
            two.ws.socket.close()
        end = time.monotonic() + TIMEOUT
        while [e for e in envs_of(redis_env.url) if e.get("state") not in ("destroyed", "lost")] \
                and time.monotonic() < end:
            time.sleep(0.5)
        assert [e for e in envs_of(redis_env.url) if e.get("state") not in ("destroyed", "lost")] == []


def test_a_link_out_of_the_workspace_is_never_followed_by_fs(server, workspace, tmp_path):
    """Workspace content is hostile: a command's link leading out reads and writes nothing outside
    (the worker's confined file operations; the server's mapping is lexical and never resolves it)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("k3pt-0utside\n")
    with Client.connect(server.url) as client:
        client.initialize()
        assert run(client, workspace, f"ln -s {outside} out; ln -s {outside}/secret.txt s.txt")[1] == 0
        for path in (workspace / "out" / "secret.txt", workspace / "s.txt"):
            reply = client.call("fs/readFile", {"path": uri(path), "sandbox": None})
            assert "error" in reply and b64(b"k3pt-0utside\n") not in json.dumps(reply), reply
            reply = client.call("fs/writeFile", {"path": uri(path), "dataBase64": b64(b"pwned\n"), "sandbox": None})
            assert "error" in reply, reply
        reply = client.call("fs/writeFile", {"path": uri(workspace / "out" / "new.txt"), "dataBase64": b64(b"x"),
                                             "sandbox": None})
        assert "error" in reply, reply
        assert client.result("fs/getMetadata", {"path": uri(workspace / "s.txt"), "sandbox": None})["isSymlink"]
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "k3pt-0utside\n"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stopped_server_tells_each_client_how_its_processes_ended(fleet, redis_server, workspace, sig):
    """Ctrl-C (or SIGTERM) while a command runs: before the connection goes, the client gets the
    command's output, toolq's reason on stderr, exited -1 and closed (Codex then finishes the
    command instead of trying to resume); the process is killed and the turn recorded cancelled."""
    import signal

    marker = f"toolq-es-stop-{secrets.token_hex(4)}"
    with exec_server(redis_server.url, workspace) as server:
        with Client.connect(server.url) as client:
            session, p = start_sleeper(client, workspace, marker)
            server.proc.send_signal(getattr(signal, sig))
            output, code = finished(client.until(p["processId"], "process/closed"))
            assert code == -1 and output.startswith(b"up\n") and b"[toolq: toolq exec-server stopped]" in output
        assert server.proc.wait(timeout=TIMEOUT) == 0
    assert pids_matching(marker) == []
    turn = server.turn_of(session)
    listed = subprocess.run([sys.executable, "-m", "toolq.cli.main", "turns", "--json"],
                            env=server_env(redis_server.url), capture_output=True, text=True, timeout=TIMEOUT)
    (row,) = [row for row in map(json.loads, listed.stdout.splitlines()) if turn in row.values()]
    assert "cancelled" in row.values() and row["prompt"] == "(exec-server: processes)", row


def test_upload_on_a_cold_embedded_stack_waits_for_its_workers(tmp_path):
    """No REDIS_URL: the server starts its own Redis and workers, which boot slowly (3 s each); the
    session's environment waits for a worker host as a command waits for a worker."""
    from tests.integration.test_environments import unmount_under
    from tests.integration.test_mcp_server import cold_stack

    folder, env = cold_stack(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "exec-server", "--upload", str(folder)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    server = Server(proc)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().decode()
        assert first.startswith("toolq exec-server: listening on ws://"), (first, "".join(server.stderr))
        with Client.connect(first.rsplit(" ", 1)[1].strip()) as client:
            client.initialize()
            output, code = run(client, folder, "cat notes.txt")
            assert (output, code) == (b"hello from the upload\n", 0), "".join(server.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)
        unmount_under(tmp_path)
