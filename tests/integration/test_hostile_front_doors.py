"""Red team of the front doors (issue 29): `toolq exec-server`, `toolq mcp-server` and the
worker's front-door tools, attacked as an attacker would, on real Redis and real workers.

Each test is one attack and asserts that it fails. The attackers: a browser page the user visits
(a cross-site WebSocket to a loopback exec-server, DNS rebinding), the exec-server's client itself
(hostile ids, paths, env, frames), someone who can write to the fleet's Redis (forged and replayed
process events), and the commands the client runs (what they leave in the workspace, and races
against the worker's file operations)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

import tests.integration.conftest as c
from tests.integration import unprivileged
from tests.integration.test_exec_server import (  # noqa: F401 - fixtures
    Client,
    exec_server,
    finished,
    process_start,
    run,
    server,
    server_env,
    uri,
    workspace,
)
from tests.integration.test_front_door_tools import Door, door_worker  # noqa: F401 - fixtures
from tests.integration.test_hostile_exec import hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.core.front_doors import process_stream_key
from toolq.frontdoors.exec_server.session import process_key

pytestmark = pytest.mark.integration

TIMEOUT = 60.0


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[1]


# ---- the network: who may talk to the exec-server ---------------------------------------------

def test_a_browser_page_cannot_drive_a_loopback_exec_server(server, workspace):
    """A page on any site may open a WebSocket to 127.0.0.1 (no CORS for WebSockets): it sends an
    `Origin` header, which Codex never does. With no token, a loopback server must refuse it, or any
    page the user visits runs commands in the workspace and reads its files back."""
    port = port_of(server.url)
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example"):
        with pytest.raises(InvalidStatus) as e, connect(f"ws://127.0.0.1:{port}", origin=origin):  # type: ignore[arg-type]
            pass
        assert e.value.response.status_code == 403, origin
    # DNS rebinding: the page's own name now resolves to 127.0.0.1, so the browser sends its Host
    with socket.create_connection(("127.0.0.1", int(port))) as sock, pytest.raises(InvalidStatus) as e, \
            connect(f"ws://evil.example:{port}", sock=sock):
        pass
    assert e.value.response.status_code == 403
    # Codex (no Origin, a loopback Host) and a page served from loopback itself still get in
    for host, origin in (("127.0.0.1", None), ("localhost", None), ("127.0.0.1", f"http://localhost:{port}")):
        with Client.connect(f"ws://{host}:{port}", origin=origin) as client:
            client.initialize()
            assert run(client, workspace, "echo in") == (b"in\n", 0)


def test_the_token_never_reaches_the_servers_log(fleet, redis_server, workspace, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("tok-RIGHT-5b1e\n")
    with exec_server(redis_server.url, workspace, "--token-file", str(token_file)) as srv:
        port = port_of(srv.url)
        with pytest.raises(InvalidStatus) as e, connect(f"ws://127.0.0.1:{port}/?token=tok-WRONG-77aa"):
            pass
        assert e.value.response.status_code == 401
        with Client.connect(f"ws://127.0.0.1:{port}/?token=tok-RIGHT-5b1e") as client:
            client.initialize()
            assert run(client, workspace, "echo t") == (b"t\n", 0)
        logged = "".join(srv.stderr)
    assert "tok-RIGHT" not in logged and "tok-WRONG" not in logged


# ---- the client: hostile frames, ids, paths and environments ----------------------------------

def test_hostile_frames_get_one_error_each_and_the_connection_goes_on(server, workspace):
    with Client.connect(server.url) as client:
        client.initialize()
        for frame in ("[" * 200_000, "{" * 100_000, "x" * (8 << 20), "[1, 2]", '{"id": {"a": 1}, "method": "m"}',
                      '{"id": 7, "method": 12}', '"just a string"'):
            client.ws.send(frame)
            reply = json.loads(client.ws.recv(timeout=TIMEOUT))
            assert "error" in reply and reply["error"]["code"] in (-32700, -32600), (frame[:20], reply)
        # a binary frame holding a request, and a request with params of the wrong shape
        client.ws.send(json.dumps({"id": 900, "method": "fs/readFile", "params": {"path": uri(workspace / "x")}})
                       .encode())
        assert client.answer(900)["error"]["code"] == -32004
        for params in (None, [], {"path": 5}, {"path": {"$gt": ""}}, "file:///etc/passwd"):
            assert "error" in client.call("fs/readFile", params), params
        assert run(client, workspace, "echo still") == (b"still\n", 0)


def test_hostile_process_ids_stay_in_their_own_redis_key_and_duplicates_are_refused(server, workspace):
    ids = ["../../etc/passwd", "a b\r\nDEL *", "*", "x" * 10_000, "é\u0000\u202e", "", ":", "toolq:proc:*"]
    with Client.connect(server.url) as client:
        client.initialize()
        starts = []
        for i, pid in enumerate(ids):
            p = process_start(workspace, f"echo id{i}")
            p["processId"] = pid
            reply = client.call("process/start", p)
            if "result" in reply:
                starts.append((i, pid))
            else:  # refused in one answer: an empty id, one past 1,000 characters
                assert reply["error"]["code"] == -32602 and (not pid or len(pid) > 1000), reply
        assert len(starts) == len(ids) - 2
        for i, pid in starts:
            output, code = finished(client.until(pid, "process/closed"))
            assert (output, code) == (f"id{i}\n".encode(), 0), pid[:40]
        running = process_start(workspace, "sleep 30")
        client.result("process/start", running)
        assert client.error("process/start", running)["code"] == -32600  # the same id again
        client.result("process/terminate", {"processId": running["processId"]})
        finished(client.until(running["processId"], "process/closed"))


def test_file_uris_that_climb_out_of_the_root_are_never_served(server, workspace):
    outside = workspace.parent / "secret.txt"
    outside.write_text("SECRET\n")
    w = str(workspace)
    hello = base64.b64encode(b"pwned\n").decode()
    with Client.connect(server.url) as client:
        client.initialize()
        # links a command leaves, pointing at the worker's own secrets and out of the workspace
        assert run(client, workspace, "ln -s /proc/self/environ env; ln -s /proc/self/root root; "
                                      "ln -s /proc/self/cwd/../secret.txt up; ln -s ../secret.txt rel; "
                                      "ln -s /proc/self/fd fds; mkfifo fifo; echo made") == (b"made\n", 0)
        for path in (f"file://{w}/%2e%2e/secret.txt", f"file://{w}/sub%2f..%2f..%2fsecret.txt",
                     f"file://{w}/./../secret.txt", f"file://{w}/env", f"file://{w}/root/etc/shadow",
                     f"file://{w}/up", f"file://{w}/rel", f"file://{w}/fds/0", f"file://{w}/fifo",
                     f"file://localhost{w}/%2E%2E/secret.txt", f"file://{w}/" + "a/" * 3000 + "x"):
            reply = client.call("fs/readFile", {"path": path, "sandbox": None})
            assert "error" in reply, path[:80]
            assert "SECRET" not in json.dumps(reply) and "TOOLQ_SIGNING_KEY" not in json.dumps(reply)
        for path in (f"file://{w}/a%00b", f"http://127.0.0.1{w}/x", f"file://evil.example{w}/x", "x",
                     f"file://{w}/x?y", f"file://{w}/x#y", "file:relative"):
            assert "error" in client.call("fs/readFile", {"path": path, "sandbox": None}), path
        for method, params in (
                ("fs/writeFile", {"path": f"file://{w}/%2e%2e/pwned", "dataBase64": hello}),
                ("fs/writeFile", {"path": f"file://{w}/rel", "dataBase64": hello}),
                ("fs/writeFile", {"path": f"file://{w}/up", "dataBase64": hello}),
                ("fs/writeFile", {"path": f"file://{w}/root/tmp/pwned", "dataBase64": hello}),
                ("fs/writeFile", {"path": f"file://{w}/.git/hooks/pre-commit", "dataBase64": hello}),
                ("fs/copy", {"sourcePath": f"file://{w}/rel", "destinationPath": f"file://{w}/stolen"}),
                ("fs/copy", {"sourcePath": f"file://{w}/env", "destinationPath": f"file://{w}/stolen"}),
                ("fs/remove", {"path": f"file://{w}/%2e%2e/secret.txt", "recursive": True, "force": True}),
                ("fs/remove", {"path": f"file://{w}/..", "recursive": True, "force": True}),
                ("fs/createDirectory", {"path": f"file://{w}/root/tmp/pwned-dir", "recursive": True})):
            assert "error" in client.call(method, {**params, "sandbox": None}), (method, params)
        assert outside.read_text() == "SECRET\n" and not (workspace.parent / "pwned").exists()
        assert not (workspace / "stolen").exists() and not Path("/tmp/pwned").exists()
        # a command's cwd out of the root, or through a link out of it
        for cwd in (f"file://{w}/%2e%2e", f"file://{w}/root", f"file://{w}/root/tmp", "file:///"):
            p = process_start(workspace, "pwd", cwd=cwd)
            reply = client.call("process/start", p)
            if "result" in reply:
                output, _ = finished(client.until(p["processId"], "process/closed"))
                assert output.strip() in (b"", w.encode()) or output.startswith(w.encode()), (cwd, output)
            else:
                assert reply["error"]["code"] == -32603, reply


def test_a_clients_env_reaches_the_command_only(server, workspace):
    """`env` is set by `env NAME=VALUE ...` inside the sandbox: a name cannot become an option of
    `env` (`--chdir=/`, `-i`), split the assignment (`A=B`) or carry a NUL, and the names the
    sandbox sets (HOME, PATH, TMPDIR) stay the sandbox's."""
    hostile = {"--chdir": "/", "-i": "x", "-S": "echo injected", "A=B": "c", "NUL": "a\u0000b", "HOME": "/evil",
               "PATH": "/evil", "LD_PRELOAD": "/nonexistent/x.so", "BASH_ENV": "/nonexistent/evil",
               "TOOLQ_SESSION_SOCKET": "/tmp/x", "GOOD": "yes"}
    with Client.connect(server.url) as client:
        client.initialize()
        p = process_start(workspace, 'echo "pwd=$PWD home=$HOME path=$PATH good=$GOOD"; pwd -P')
        p["env"] = hostile
        client.result("process/start", p)
        output, code = finished(client.until(p["processId"], "process/closed"))
        text = output.decode(errors="replace")
        assert code == 0, text
        assert "good=yes" in text and "home=/evil" not in text and "path=/evil" not in text, text
        assert f"pwd={workspace}" in text and "injected" not in text, text
        assert run(client, workspace, "echo next") == (b"next\n", 0)


# ---- Redis: someone who can write to the fleet's Redis -------------------------------------------

def test_forged_and_replayed_process_events_are_never_pushed(server, workspace, redis_server):
    """An entry XADDed into a process's stream: unsigned, signed for another process's stream, or a
    genuine earlier entry of the same stream replayed. None reaches the client."""
    r = redis.Redis.from_url(redis_server.url)
    with Client.connect(server.url) as client:
        session = client.initialize()["sessionId"]
        turn = server.turn_of(session)
        victim, other = process_start(workspace, "echo one; sleep 4; echo two"), \
            process_start(workspace, "echo OTHER; sleep 8")
        victim["processId"], other["processId"] = "rt-victim", "rt-other"
        client.result("process/start", victim)
        client.result("process/start", other)
        client.until("rt-victim", "process/output")
        client.until("rt-other", "process/output")
        key, other_key = (process_stream_key(turn, process_key(p)) for p in ("rt-victim", "rt-other"))
        genuine = [fields for _, fields in r.xrange(key)]
        foreign = [fields for _, fields in r.xrange(other_key)]
        assert genuine and foreign
        forged_body = {"kind": "output", "n": len(genuine) + 1, "stream": "stdout",
                       "data": base64.b64encode(b"FORGED\n").decode()}
        r.xadd(key, {"event": json.dumps(forged_body, sort_keys=True, separators=(",", ":")), "sig": "0" * 64})
        r.xadd(key, {"event": json.dumps({"kind": "exit", "n": len(genuine) + 1, "exit_code": 0}), "sig": ""})
        for fields in genuine + foreign:  # replays: the victim's own output again, the other's output
            r.xadd(key, fields)
        output, code = finished(client.until("rt-victim", "process/closed"))
        assert (output, code) == (b"one\ntwo\n", 0)
        client.result("process/terminate", {"processId": "rt-other"})
        finished(client.until("rt-other", "process/closed"))
    r.close()
