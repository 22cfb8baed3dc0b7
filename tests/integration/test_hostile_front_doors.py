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
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests import markers
from tests.integration import test_exec_server as es
from tests.integration import test_hostile_exec as he
from tests.integration import unprivileged
from tests.integration.test_cancel import pids_matching
from tests.integration.test_exec_server import Client, exec_server, finished, process_start, run, uri
from tests.integration.test_front_door_tools import Door
from tests.integration.test_hostile_exec import hostile_workers
from toolq.core.front_doors import process_stream_key
from toolq.frontdoors.exec_server.session import process_key

# the fixtures of those modules, used here too
server, workspace, locked_redis = es.server, es.workspace, he.locked_redis

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
        with pytest.raises(InvalidStatus) as e, connect(f"ws://127.0.0.1:{port}", origin=origin):
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
        r.xadd(key, {"event": "[" * 100_000, "sig": "0" * 64})  # deep JSON: it ended the stream's reader
        r.xadd(key, {"event": b"\xff\xfe", "sig": b"\xff"})
        for fields in genuine + foreign:  # replays: the victim's own output again, the other's output
            r.xadd(key, fields)
        output, code = finished(client.until("rt-victim", "process/closed"))
        assert (output, code) == (b"one\ntwo\n", 0)
        client.result("process/terminate", {"processId": "rt-other"})
        finished(client.until("rt-other", "process/closed"))
    r.close()


# ---- the workspace: what commands leave, and races against the worker's file operations ----------

@pytest.fixture(scope="module", params=["bwrap-root", "bwrap-nobody", "landlock-root"])
def rt_worker(request, locked_redis, tmp_path_factory):
    backend, user = request.param.split("-")
    yield from hostile_workers(backend, locked_redis, tmp_path_factory, user=user == "nobody",
                               TOOLQ_SANDBOX_CPU_SECONDS="120")


def nested_repo(ws: Path, worker: Any) -> Path:
    """`keep/.git`, a repository made before the turn (the sandbox binds it read-only)."""
    git = ws / "keep" / ".git"
    (git / "hooks").mkdir(parents=True)
    (git / "config").write_text("[core]\n")
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    if worker.user:
        for p in [ws, *ws.rglob("*")]:
            os.chown(p, *unprivileged.ids(), follow_symlinks=False)
    return git


def test_a_recursive_remove_never_takes_a_git_moved_in_after_its_check(rt_worker, tmp_path):
    """fs remove (recursive) looks for a `.git` in the tree, then removes it. A command moving a
    folder that holds a protected repository into the tree between the two must not get the
    worker, outside the sandbox, to delete what the sandbox keeps read-only."""
    if rt_worker.backend == "landlock":
        pytest.skip("Landlock cannot keep a nested .git read-only from the command itself (docs/security.md)")
    ws = rt_worker.workspace(tmp_path)
    git = nested_repo(ws, rt_worker)
    shuffle = ("end=$((SECONDS+45)); while [ $SECONDS -lt $end ] && [ ! -e stop ]; do mkdir -p victim/d; "
               "mv keep victim/d/keep 2>/dev/null; mv victim/d/keep keep 2>/dev/null; done; echo shuffled")

    async def scenario() -> tuple[int, int]:
        async with Door(rt_worker, ws) as door:
            mover = asyncio.create_task(door.start("mover", ["bash", "-c", shuffle]))
            removed = denied = 0
            try:
                for _ in range(400):
                    if not (ws / "keep" / ".git").exists() and not (ws / "victim/d/keep/.git").exists():
                        await asyncio.sleep(0.05)  # between the two mv: look again
                        if not (ws / "keep" / ".git").exists() and not (ws / "victim/d/keep/.git").exists():
                            break
                    got = await door.fs("remove", "victim", recursive=True, force=True)
                    if "ok" in got:
                        removed += 1
                    else:
                        denied += 1
            finally:
                (ws / "stop").touch()
                await mover
            return removed, denied

    removed, denied = run_async(scenario())
    assert removed and denied  # both orders were hit
    where = git if git.exists() else ws / "victim/d/keep/.git"
    assert (where / "config").read_text() == "[core]\n" and (where / "HEAD").exists(), (removed, denied)


def test_a_copy_into_itself_through_a_link_ends(rt_worker, tmp_path):
    """`copy a -> alias/b` where `alias` is a link to `a` the command made: the lexical check does
    not see that the destination is inside the source. The walk must not copy forever."""
    ws = rt_worker.workspace(tmp_path)

    async def scenario() -> None:
        async with Door(rt_worker, ws) as door:
            made = await door.start("mk", ["bash", "-c", "mkdir -p a && echo x > a/f && ln -s a alias"])
            assert made["exit_code"] == 0
            got = await door.fs("copy", "a", to="alias/b", recursive=True)
            assert "ok" in got or "error" in got
            depth = max(len(p.relative_to(ws).parts) for p in ws.rglob("*"))
            assert depth < 64, depth
            assert (await door.fs("readFile", "a/f"))["ok"]["dataBase64"] == base64.b64encode(b"x\n").decode()

    run_async(scenario())


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_git_directory_of_another_name_is_not_removed_nor_written(rt_worker, tmp_path):
    """`sub/.git` is a file naming `../gd` (`git init --separate-git-dir`): git reads `gd` as it
    reads a `.git`, and the sandbox binds it read-only; the worker's fs must not change it either."""
    ws = rt_worker.workspace(tmp_path)
    gd = ws / "gd"
    for d in ("objects", "refs/heads", "hooks"):
        (gd / d).mkdir(parents=True)
    (gd / "HEAD").write_text("ref: refs/heads/main\n")
    (gd / "config").write_text("[core]\n")
    (ws / "sub").mkdir()
    (ws / "sub" / ".git").write_text("gitdir: ../gd\n")
    if rt_worker.user:
        for p in [ws, *ws.rglob("*")]:
            os.chown(p, *unprivileged.ids(), follow_symlinks=False)
    hook = base64.b64encode(b"#!/bin/sh\ntouch /tmp/pwned\n").decode()

    async def scenario() -> None:
        async with Door(rt_worker, ws) as door:
            for op, path, kw in (("remove", "gd", {"recursive": True}), ("remove", "gd/hooks", {"recursive": True}),
                                 ("remove", "gd/config", {}), ("writeFile", "gd/config", {"data": hook}),
                                 ("writeFile", "gd/hooks/post-checkout", {"data": hook}),
                                 ("copy", "sub/.git", {"to": "gd/hooks/pre-commit"}),
                                 ("createDirectory", "gd/hooks/x", {}), ("remove", "sub", {"recursive": True})):
                got = await door.fs(op, path, **kw)
                assert got.get("error", {}).get("kind") == "denied", (op, path, got)

    run_async(scenario())
    assert (gd / "config").read_text() == "[core]\n" and sorted(os.listdir(gd / "hooks")) == []
    assert (ws / "sub" / ".git").is_file()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_client_that_stops_reading_does_not_grow_the_servers_memory_without_bound(server, workspace,
                                                                                      redis_server):
    """A client starts processes that print 16 MB each (about the most a stream keeps) and never
    reads its socket: the server must not queue every frame for it (it did: its memory grew with
    the output); past a bound it drops the connection, and the kept session can be resumed."""
    r = redis.Redis.from_url(redis_server.url)
    with Client.connect(server.url) as client:
        session = client.initialize()["sessionId"]
        turn = server.turn_of(session)
        assert run(client, workspace, "echo warm") == (b"warm\n", 0)
        before = rss_kib(server.proc.pid)
        ids = []
        for _ in range(20):  # 320 MB, unread; what is kept: the queue's bound and 4 MiB a process
            p = process_start(workspace, "head -c 16000000 /dev/zero")
            ids.append(client.send("process/start", p))
        deadline = time.monotonic() + 240
        started = False
        while time.monotonic() < deadline:  # every stream written and then deleted by the server
            keys = r.keys(f"toolq:proc:{turn}:*")
            started = started or bool(keys)
            if started and not keys:
                break
            time.sleep(0.5)
        grown = rss_kib(server.proc.pid) - before
    r.close()
    # Unbounded, it held 1.8 times the output (287 MiB for 160 MB: 550 MiB for these 320 MB); bounded,
    # the queue's 32 MiB and what each process keeps for a resume, plus the stream reads in flight and
    # what the allocator keeps of their buffers (308 MiB seen once on a loaded machine)
    assert grown < 420_000_000 >> 10, f"the server grew by {grown >> 10} MiB for a client that does not read"
    assert any("unread; its connection is dropped" in line for line in server.stderr)
    with Client.connect(server.url) as again:  # the session was kept: the client may come back
        assert again.initialize(resume=session)["sessionId"] == session
        assert run(again, workspace, "echo back") == (b"back\n", 0)


def test_fs_never_writes_through_a_hard_link_a_fifo_or_a_socket(rt_worker, tmp_path):
    """A hard link to a file outside (made before the turn: a `git clone` of a local repository
    shares inodes so), a FIFO and a socket a command made: fs writes none of them through, and
    never waits on the FIFO."""
    ws = rt_worker.workspace(tmp_path)
    outside = Path(unprivileged.owned_dir("toolq-rt-out-") if rt_worker.user else tmp_path.parent / "rt-outside")
    outside.mkdir(exist_ok=True)
    victim = outside / "victim.txt"
    victim.write_text("intact\n")
    os.link(victim, ws / "hard")
    if rt_worker.user:
        for p in [ws, outside, victim]:
            os.chown(p, *unprivileged.ids())
    data = base64.b64encode(b"pwned\n").decode()

    async def scenario() -> None:
        async with Door(rt_worker, ws) as door:
            made = await door.start("mk", ["bash", "-c", "mkfifo fifo && python3 -c \"import socket; "
                                           "socket.socket(socket.AF_UNIX).bind('sock')\"; echo ok"])
            assert made["exit_code"] == 0 and (ws / "fifo").exists()
            # (Landlock refuses a command's AF_UNIX socket: no `sock` there)
            for op, path, kw in (("writeFile", "hard", {"data": data}), ("writeFile", "fifo", {"data": data}),
                                 ("writeFile", "sock", {"data": data}), ("readFile", "fifo", {}),
                                 ("readFile", "sock", {}), ("copy", "fifo", {"to": "f2"}),
                                 ("copy", "sock", {"to": "s2"}), ("copy", "hard", {"to": "fifo"})):
                if "sock" in path and not (ws / "sock").is_socket():
                    continue
                got = await door.fs(op, path, **kw)
                assert "error" in got or (op == "copy" and path == "hard"), (op, path, got)
            assert await door.fs("remove", "hard") == {"ok": {}}  # the name goes, never the file it shares

    try:
        run_async(scenario())
        assert victim.read_text() == "intact\n"
    finally:
        shutil.rmtree(outside, ignore_errors=True)


# ---- toolq mcp-server: one client against another, and the tools no client is offered ------------

def test_an_mcp_client_reaches_neither_another_clients_sessions_nor_the_front_door_tools(fleet, redis_server,
                                                                                         tmp_path):
    from mcp import types as mcp_types

    from tests.integration.test_mcp_server import http_server, over_http, text_of

    async def go() -> None:
        async with http_server(redis_server.url, tmp_path) as srv, over_http(srv.url) as alice, \
                over_http(srv.url) as mallory:
            held = await alice.call_tool("exec_command", {"cmd": "read line; echo alice-got:$line", "tty": True,
                                                          "yield_time_ms": 500})
            assert not held.isError and "session" in text_of(held).lower(), text_of(held)
            for sid in range(6):  # session ids are a per-conversation counter: guessable, never shared
                stolen = await mallory.call_tool("write_stdin", {"session_id": sid, "chars": "mallory\n",
                                                                "yield_time_ms": 200})
                assert "alice-got" not in text_of(stolen)
            for name, args in (("fs", {"op": "readFile", "path": "x"}), ("process_start", {"argv": ["id"],
                               "stream_key": "toolq:proc:t:k"}), ("process_write", {"session_id": 1, "data": ""}),
                               ("process_terminate", {"session_id": 1}), ("tool_search", {"query": "x"}),
                               ("functions__exec_command", {"cmd": "id"}), ("__fs", {})):
                refused = await mallory.call_tool(name, args)
                assert refused.isError and "unknown tool" in text_of(refused), (name, text_of(refused))
            found = re.search(r"session id:? (\d+)", text_of(held), re.IGNORECASE)
            assert found, text_of(held)
            sid = int(found.group(1))
            own = await alice.call_tool("write_stdin", {"session_id": sid, "chars": "alice\n", "yield_time_ms": 2000})
            assert "alice-got:alice" in text_of(own), text_of(own)
            assert isinstance(own, mcp_types.CallToolResult)

    asyncio.run(asyncio.wait_for(go(), 180))


# ---- the fleet: what one client may hold of it ---------------------------------------------------

@pytest.mark.xfail(strict=True, reason="open: a front door's process holds a worker pool child for its whole life "
                                       "(process_start streams from the pool child until the exit), so one client's "
                                       "long-running processes, up to TOOLQ_MAX_PARALLEL_CALLS of them, take every "
                                       "pool child of a small fleet and every other client's calls wait")
def test_one_clients_long_processes_do_not_starve_another_clients_calls(server, workspace):
    """The shared fleet has 2 workers x 2 pool children. One client starts 4 processes that run on
    (Codex's dev servers, watchers); another client's `echo` must be served while all 4 still run."""
    marker = f"sleep 25.{markers.PROCESS}7"  # long enough to be seen running; short, as the test waits it out
    with Client.connect(server.url) as hog, Client.connect(server.url) as other:
        hog.initialize()
        other.initialize()
        held = [process_start(workspace, marker) for _ in range(4)]
        for p in held:
            hog.result("process/start", p)
        time.sleep(3)  # let them start (no timing asserted: the order of events below is)
        p = process_start(workspace, "echo served")
        other.result("process/start", p)
        events: list[dict[str, Any]] = []
        while pids_matching(marker):  # served while they run, or not before one of them ends
            try:
                message = json.loads(other.ws.recv(timeout=5))
            except TimeoutError:
                continue
            if message.get("params", {}).get("processId") == p["processId"]:
                events.append(message)
                if message["method"] == "process/closed":
                    break
        # Starved, the echo got a pool child only once a held process had exited (and its exit was
        # pushed to the hog); served alongside them, the hog has heard of no exit yet.
        exits = []
        while True:
            try:
                message = json.loads(hog.ws.recv(timeout=1))
            except TimeoutError:
                break
            if message.get("method") == "process/exited":
                exits.append(message)
        for q in held:
            hog.send("process/terminate", {"processId": q["processId"]})
        assert events and finished(events) == (b"served\n", 0) and not exits, exits


def test_process_start_writes_only_its_own_turns_streams(rt_worker, tmp_path):
    """`process_start` is never offered, but a model that names it gets it: its `stream_key` must
    not let it append events, signed with the fleet's key, to another turn's process stream (a
    Codex client elsewhere would take them for its command's output) or to any other key."""
    ws = rt_worker.workspace(tmp_path)
    r = redis.Redis.from_url(rt_worker.redis.url)
    victim = process_stream_key("turn-0123456789ab", "victim")

    async def scenario() -> None:
        async with Door(rt_worker, ws) as door:
            for key in (victim, "toolq:ledger:forged", "toolq:proc:" + door.turn + "x:k", "plain-key",
                        process_stream_key(door.turn, "k") + "/x", "toolq:proc:" + door.turn + ":"):
                text = await door.call("process_start", {"argv": ["echo", "injected"], "stream_key": key})
                assert "injected" not in text and r.exists(key) == 0, (key, text)
            own = await door.start("mine", ["echo", "mine"])  # its own turn's stream: served
            assert own["exit_code"] == 0

    try:
        run_async(scenario())
    finally:
        r.close()


def test_process_read_and_write_with_hostile_numbers_get_one_answer_each(server, workspace):
    with Client.connect(server.url) as client:
        client.initialize()
        p = process_start(workspace, "echo one; echo two", tty=True)
        client.result("process/start", p)
        client.until(p["processId"], "process/closed")
        pid = p["processId"]
        for params in ({"afterSeq": -5, "maxBytes": -1, "waitMs": -1}, {"afterSeq": 2 ** 63, "maxBytes": 2 ** 64,
                       "waitMs": 2 ** 63}, {"afterSeq": "1", "maxBytes": None, "waitMs": None},
                       {"afterSeq": 1.5, "maxBytes": 0, "waitMs": 0}, {"afterSeq": None, "maxBytes": None,
                       "waitMs": 10 ** 9}):
            reply = client.call("process/read", {"processId": pid, **params})
            assert ("result" in reply) != ("error" in reply), (params, reply)
        for chunk in ("", "!!notbase64", "A" * 3, None, 5):
            reply = client.call("process/write", {"processId": pid, "chunk": chunk, "writeId": "w"})
            assert ("result" in reply) != ("error" in reply), (chunk, reply)
        assert run(client, workspace, "echo fine") == (b"fine\n", 0)


def test_a_folder_swapped_for_a_link_out_while_fs_writes_never_leads_out(rt_worker, tmp_path):
    """A command swaps `d` between a folder and a link to a folder outside in a tight loop while
    the client writes, copies into and makes folders in `d`: nothing lands outside."""
    ws = rt_worker.workspace(tmp_path)
    outside = Path(unprivileged.owned_dir("toolq-rt-swap-") if rt_worker.user else tmp_path.parent / "rt-swap-out")
    outside.mkdir(exist_ok=True)
    if rt_worker.user:
        os.chown(outside, *unprivileged.ids())
    (ws / "src.txt").write_text("x\n")
    if rt_worker.user:
        os.chown(ws / "src.txt", *unprivileged.ids())
    swap = (f"ln -s {outside} out; end=$((SECONDS+45)); while [ $SECONDS -lt $end ] && [ ! -e stop ]; do "
            "mkdir -p real; mv -T real d 2>/dev/null; mv -T d real 2>/dev/null; ln -sfn out d2; mv -T d2 d 2>/dev/null; "
            "rm -f d 2>/dev/null; done; echo swapped")
    data = base64.b64encode(b"pwned\n").decode()

    async def scenario() -> None:
        async with Door(rt_worker, ws) as door:
            mover = asyncio.create_task(door.start("swap", ["bash", "-c", swap]))
            try:
                for i in range(150):
                    await door.fs("writeFile", f"d/w{i}", data=data)
                    await door.fs("createDirectory", f"d/m{i}/n", recursive=True)
                    await door.fs("copy", "src.txt", to=f"d/c{i}")
            finally:
                (ws / "stop").touch()
                await mover

    try:
        run_async(scenario())
        assert os.listdir(outside) == []
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_a_clients_text_reaches_the_servers_log_without_terminal_controls(server, workspace):
    """What the client names (a method, a session id to resume, a process id) is logged on the
    operator's terminal: escape sequences in it (a screen clear, OSC 52 clipboard writes, a window
    title, a bidi override) must not reach the terminal raw."""
    evil = "\x1b[2J\x1b]52;c;cHduZWQ=\x07\x1b]0;owned\x07\u202eevil\x9b31m"
    with Client.connect(server.url) as client:
        client.notify(f"x/{evil}")
        client.initialize(resume=f"s-{evil}")
        p = process_start(workspace, "exit 0")
        p["processId"] = f"p-{evil}"
        client.result("process/start", p)
        client.until(p["processId"], "process/closed")
        client.ws.send(json.dumps({"id": 1, "method": f"m/{evil}", "params": {}}))
        client.ws.recv(timeout=TIMEOUT)
        time.sleep(1)  # let the log lines come (no timing asserted)
    logged = "".join(server.stderr)
    assert "\x1b" not in logged and "\x07" not in logged and "\u202e" not in logged and "\x9b" not in logged, logged


def test_a_forged_mcp_task_record_is_no_task(fleet, redis_server, tmp_path):
    """Someone who can write to Redis plants task records: unsealed, sealed for another id, deep
    JSON. Each is "not found" to every client, and the server goes on."""
    from mcp.shared.exceptions import McpError

    from tests.integration.test_mcp_server import http_server, over_http
    from toolq.frontdoors.mcp_server.tasks import task_key

    r = redis.Redis.from_url(redis_server.url)
    record = {"record": {"task_id": "turn-aaaaaaaaaaaa", "status": "completed", "created": 0, "updated": 0,
                         "ttl_ms": 60000, "result": {"content": [{"type": "text", "text": "FORGED"}]}}}
    planted = {"turn-aaaaaaaaaaaa": json.dumps(record), "turn-bbbbbbbbbbbb": "[" * 100_000,
               "turn-cccccccccccc": '{"record": 5, "sig": "00"}'}
    for task_id, value in planted.items():
        r.set(task_key(task_id), value, ex=600)

    async def go() -> None:
        async with http_server(redis_server.url, tmp_path) as srv, over_http(srv.url) as client:
            for task_id in planted:
                for ask in (client.experimental.get_task, client.experimental.cancel_task):
                    with pytest.raises(McpError):
                        await ask(task_id)
            done = await client.call_tool("exec_command", {"cmd": "echo alive"})
            assert not done.isError

    try:
        asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        r.close()
