"""`toolq mcp-server` driven by the official `mcp` client SDK, against real Redis and real workers
(the shared `fleet`): tools listed and called over stdio and streamable HTTP, a call cancelled by
`notifications/cancelled` (its process gone), streamed output as progress notifications, a
task-augmented call polled to its result through a second replica, and the bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError

import tests.integration.conftest as c
from tests import markers
from tests.integration.test_cancel import pids_matching, wait_until
from tests.integration.test_environments import unmount_under
from toolq.local.embedded import free_port

# The SDK's client-side tasks API warns that tasks leave the spec's core for an extension in mcp 2.0.
pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore:The experimental tasks API:DeprecationWarning")]

TOKEN = "t0ken-" + "x" * 24


def server_env(redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TOOLQ_MCP_SERVER_TOKEN"}
    return {**env, **c.WORKER_ENV, "REDIS_URL": redis_url}


def server_args(workspace: Path, *extra: str, where: str = "--workspace") -> list[str]:
    return ["-m", "toolq.cli.main", "mcp-server", "--tools", c.TEST_TOOLS, where, str(workspace), *extra]


@asynccontextmanager
async def over_stdio(redis_url: str, workspace: Path, where: str = "--workspace") -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=server_args(workspace, where=where),
                                   env=server_env(redis_url))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@dataclass
class HttpServer:
    url: str
    proc: asyncio.subprocess.Process


@asynccontextmanager
async def http_server(redis_url: str, workspace: Path, *extra: str,
                      env: dict[str, str] | None = None) -> AsyncIterator[HttpServer]:
    """A `toolq mcp-server --listen http://127.0.0.1:0` process, once it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *server_args(workspace, "--listen", "http://127.0.0.1:0", *extra),
        env={**server_env(redis_url), **(env or {})}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    assert proc.stderr is not None
    seen = b""
    try:
        while not (m := re.search(rb"listening on (http://\S+)", seen)):
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert line, f"toolq mcp-server exited: {seen.decode(errors='replace')}"
            seen += line
        yield HttpServer(m.group(1).decode(), proc)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test killed it
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    said = (seen + await proc.stderr.read()).decode(errors="replace")
    assert "Traceback" not in said, said  # clients coming and going are no error


@asynccontextmanager
async def over_http(url: str, headers: dict[str, str] | None = None) -> AsyncIterator[ClientSession]:
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=300)))
        read, write, _ = await stack.enter_async_context(streamable_http_client(url, http_client=http))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        yield session


def long_sleep(k: int) -> str:
    """A command found in /proc by its own text (this test run's pid in it) while it runs."""
    return f"sleep 300.{markers.PROCESS}{k}"


def text_of(result: types.CallToolResult) -> str:
    return "".join(b.text for b in result.content if isinstance(b, types.TextContent))


async def check_calls(session: ClientSession, workspace: Path) -> None:
    """The tool list is the fleet's, and a built-in, a user tool, a namespaced one and apply_patch run."""
    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert {"exec_command", "write_stdin", "apply_patch", "sleep_echo", "notes__file_note"} <= set(tools)
    assert not {"tool_search", "process_start", "process_write", "process_terminate", "fs"} & set(tools)
    assert tools["apply_patch"].inputSchema["required"] == ["input"]
    assert tools["exec_command"].execution is not None and tools["exec_command"].execution.taskSupport == "optional"

    done = await session.call_tool("exec_command", {"cmd": "echo hello-from-$((40 + 2))"})
    assert not done.isError and "hello-from-42" in text_of(done)
    assert done.meta is not None and done.meta["toolq/turn"].startswith("turn-")

    failed = await session.call_tool("exec_command", {"cmd": "exit 3"})
    assert failed.isError and "exit code 3" in text_of(failed).lower().replace("process exited with code", "exit code")

    echoed = await session.call_tool("sleep_echo", {"text": "user tool"})
    assert not echoed.isError and json.loads(text_of(echoed))["text"] == "user tool"
    noted = await session.call_tool("notes__file_note", {"title": "t", "type": "memo"})
    assert text_of(noted) == "filed memo 't'"

    patch = "*** Begin Patch\n*** Add File: added.txt\n+made through MCP\n*** End Patch\n"
    patched = await session.call_tool("apply_patch", {"input": patch})
    assert not patched.isError, text_of(patched)
    assert (workspace / "added.txt").read_text() == "made through MCP\n"
    wrong = await session.call_tool("apply_patch", {"input": 5})
    assert wrong.isError
    unknown = await session.call_tool("no_such_tool", {})
    assert unknown.isError and "unknown tool" in text_of(unknown)


def test_tools_listed_and_called_over_stdio(fleet, redis_server, tmp_path):
    async def go():
        async with over_stdio(redis_server.url, tmp_path) as session:
            await check_calls(session, tmp_path)
            # One MCP session is one conversation: a command left running is written to by a later call.
            started = await session.call_tool("exec_command", {"cmd": "read line; echo got-$line",
                                                               "yield_time_ms": 500, "tty": True})
            found = re.search(r"session ID (\d+)", text_of(started))
            assert found, text_of(started)
            answered = await session.call_tool("write_stdin", {"session_id": int(found.group(1)), "chars": "x\n",
                                                               "yield_time_ms": 2000})
            assert "got-x" in text_of(answered)

    asyncio.run(asyncio.wait_for(go(), 120))


def test_tools_listed_and_called_over_streamable_http(fleet, redis_server, tmp_path):
    async def go():
        async with http_server(redis_server.url, tmp_path) as server, over_http(server.url) as session:
            await check_calls(session, tmp_path)
            url = server.url
            # On loopback, a page a browser loaded from elsewhere cannot reach it (DNS rebinding).
            ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
            async with httpx.AsyncClient() as http:
                assert (await http.post(url, json=ping, headers={"Host": "attacker.example"})).status_code == 421
                assert (await http.post(url, json=ping, headers={"Origin": "http://attacker.example"})).status_code \
                    == 403

    asyncio.run(asyncio.wait_for(go(), 120))


def test_a_cancelled_call_kills_its_process(fleet, redis_server, tmp_path):
    marker = long_sleep(7)

    async def go():
        async with over_stdio(redis_server.url, tmp_path) as session:
            call = asyncio.create_task(session.call_tool("exec_command", {"cmd": marker, "yield_time_ms": 60000}))
            await wait_until(lambda: pids_matching(marker), what="the command's process")
            request_id = session._request_id - 1  # the call's: the SDK numbers requests in order
            await session.send_notification(types.ClientNotification(types.CancelledNotification(
                params=types.CancelledNotificationParams(requestId=request_id, reason="test"))))
            with pytest.raises(McpError):
                await call
            await wait_until(lambda: not pids_matching(marker), timeout=15, what="the process to be killed")
            # The session goes on: the next call runs.
            again = await session.call_tool("exec_command", {"cmd": "echo still-here"})
            assert "still-here" in text_of(again)

    asyncio.run(asyncio.wait_for(go(), 120))


def test_streamed_output_comes_as_progress_notifications(fleet, redis_server, tmp_path):
    async def go():
        pieces: list[str] = []

        async def progress(done: float, total: float | None, message: str | None) -> None:
            pieces.append(message or "")

        async with over_stdio(redis_server.url, tmp_path) as session:
            result = await session.call_tool("exec_command", {"cmd": "echo first-part; sleep 2; echo second-part",
                                                              "yield_time_ms": 30000}, progress_callback=progress)
        assert "second-part" in text_of(result)
        assert "first-part" in "".join(pieces)

    asyncio.run(asyncio.wait_for(go(), 120))


def test_a_task_runs_on_and_any_replica_answers_for_it(fleet, redis_server, tmp_path):
    marker = long_sleep(8)

    async def go():
        async with over_stdio(redis_server.url, tmp_path) as first, \
                http_server(redis_server.url, tmp_path) as server, over_http(server.url) as second:
            created = await first.experimental.call_tool_as_task("exec_command",
                                                                 {"cmd": "sleep 1; echo task-done"}, ttl=60000)
            task_id = created.task.taskId
            assert task_id.startswith("turn-") and created.task.status == "working"
            async for status in second.experimental.poll_task(task_id):  # another replica, another session
                last = status
            assert last.status == "completed"
            result = await second.experimental.get_task_result(task_id, types.CallToolResult)
            assert "task-done" in text_of(result) and not result.isError
            assert (await first.experimental.get_task(task_id)).status == "completed"
            with pytest.raises(McpError, match="already completed"):
                await first.experimental.cancel_task(task_id)

            long = await first.experimental.call_tool_as_task("exec_command", {"cmd": marker,
                                                                               "yield_time_ms": 60000})
            await wait_until(lambda: pids_matching(marker), what="the task's process")
            cancelled = await second.experimental.cancel_task(long.task.taskId)
            assert cancelled.status == "cancelled"
            await wait_until(lambda: not pids_matching(marker), timeout=15, what="the task's process killed")
            assert (await first.experimental.get_task(long.task.taskId)).status == "cancelled"
            with pytest.raises(McpError):
                await second.experimental.get_task("turn-000000000000")

            # A task outlives the client session that started it: the client goes away, a new one reads it.
            async with over_http(server.url) as leaving:
                kept = await leaving.experimental.call_tool_as_task("exec_command",
                                                                    {"cmd": "sleep 2; echo outlived-its-session"})
            async with over_http(server.url) as later:
                result = await later.experimental.get_task_result(kept.task.taskId, types.CallToolResult)
                assert "outlived-its-session" in text_of(result)
                assert (await later.experimental.get_task(kept.task.taskId)).status == "completed"

    asyncio.run(asyncio.wait_for(go(), 150))


def test_http_needs_the_bearer_token_when_one_is_set(fleet, redis_server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def go():
        async with http_server(redis_server.url, workspace, "--token-file", str(token_file)) as server:
            url = server.url
            async with httpx.AsyncClient() as http:
                refused = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
                assert refused.status_code == 401
                wrong = await http.post(url, json={}, headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401
            async with over_http(url, {"Authorization": f"Bearer {TOKEN}"}) as session:
                assert "exec_command" in {t.name for t in (await session.list_tools()).tools}

    asyncio.run(asyncio.wait_for(go(), 120))


def test_off_loopback_without_a_token_it_refuses_in_one_line(redis_server, tmp_path):
    done = subprocess.run([sys.executable, *server_args(tmp_path, "--listen", "http://0.0.0.0:0")],
                          env=server_env(redis_server.url), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "bearer token" in done.stderr, done.stderr
    bad = subprocess.run([sys.executable, *server_args(tmp_path, "--listen", "ws://nowhere")],
                         env=server_env(redis_server.url), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--listen" in bad.stderr, bad.stderr
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    away = subprocess.run([sys.executable, *server_args(tmp_path)], env=server_env(nowhere), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert away.returncode == 2 and away.stderr.count("\n") == 1 and "cannot reach Redis" in away.stderr, away.stderr


def test_with_upload_each_session_works_in_an_environment_of_its_own(redis_env, worker, tmp_path):
    host = worker(["toolq"], concurrency=2, redis_url=redis_env.url, name="mcp-env@test",
                  env={"TOOLQ_HOST_ID": "mcp-env", "TOOLQ_ENV_ROOT": str(tmp_path / "root")})
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello from the upload\n")

    async def go():
        async with over_stdio(redis_env.url, folder, where="--upload") as session:
            done = await session.call_tool("exec_command", {"cmd": "cat notes.txt; echo mine > made.txt; pwd"})
            assert "hello from the upload" in text_of(done) and str(folder) not in text_of(done)
            again = await session.call_tool("exec_command", {"cmd": "cat made.txt"})  # the same environment
            assert "mine" in text_of(again)
        assert not (folder / "made.txt").exists()  # a copy on the host, never the folder itself

    try:
        asyncio.run(asyncio.wait_for(go(), 150))
        envs = subprocess.run([sys.executable, "-m", "toolq.cli.main", "envs", "--json"], capture_output=True,
                              text=True, env=server_env(redis_env.url), timeout=60, check=True)
        states = [json.loads(line)["state"] for line in envs.stdout.splitlines()]
        assert states and all(s == "destroyed" for s in states), envs.stdout  # gone with the session
    finally:
        host.stop(grace=3)
        unmount_under(tmp_path)


def test_a_stopping_server_cancels_what_it_runs(fleet, redis_server, tmp_path):
    marker = long_sleep(9)

    async def go():
        async with http_server(redis_server.url, tmp_path) as server, over_http(server.url) as other:
            async with http_server(redis_server.url, tmp_path) as stopping, over_http(stopping.url) as session:
                task = await session.experimental.call_tool_as_task("exec_command", {"cmd": marker,
                                                                                     "yield_time_ms": 60000})
                await wait_until(lambda: pids_matching(marker), what="the task's process")
            # SIGTERM: the server cancelled its task's turn on its way out, the process with it.
            await wait_until(lambda: not pids_matching(marker), timeout=15, what="the task's process killed")
            assert (await other.experimental.get_task(task.task.taskId)).status == "cancelled"

    asyncio.run(asyncio.wait_for(go(), 150))


def test_a_task_whose_server_died_is_failed(fleet, redis_server, tmp_path):
    marker = long_sleep(6)

    async def go():
        async with http_server(redis_server.url, tmp_path) as server, over_http(server.url) as other:
            async with http_server(redis_server.url, tmp_path, env={"TOOLQ_TURN_LEASE": "2"}) as dying:
                async with over_http(dying.url) as session:
                    task = await session.experimental.call_tool_as_task("exec_command", {"cmd": marker,
                                                                                         "yield_time_ms": 60000})
                    await wait_until(lambda: pids_matching(marker), what="the task's process")
                    dying.proc.kill()  # no goodbye: its turn's lease lapses
                    await dying.proc.wait()
            task_id = task.task.taskId
            for _ in range(300):
                if (status := await other.experimental.get_task(task_id)).status != "working":
                    break
                await asyncio.sleep(0.1)
            assert status.status == "failed" and "stopped before it ended" in (status.statusMessage or "")
            result = await other.experimental.get_task_result(task_id, types.CallToolResult)
            assert result.isError
        subprocess.run([sys.executable, "-m", "toolq.cli.main", "cancel", task_id], env=server_env(redis_server.url),
                       check=True, capture_output=True, timeout=60)
        await wait_until(lambda: not pids_matching(marker), timeout=15, what="the orphan's process killed")

    asyncio.run(asyncio.wait_for(go(), 150))


def test_toolq_cancel_from_a_shell_ends_a_running_call(fleet, redis_server, tmp_path):
    marker = long_sleep(5)
    env = server_env(redis_server.url)

    async def go():
        async with over_stdio(redis_server.url, tmp_path) as session:
            call = asyncio.create_task(session.call_tool("exec_command", {"cmd": marker, "yield_time_ms": 60000}))
            await wait_until(lambda: pids_matching(marker), what="the command's process")
            listed = subprocess.run([sys.executable, "-m", "toolq.cli.main", "calls", "--json"], env=env, check=True,
                                    capture_output=True, text=True, timeout=60).stdout
            # The MCP call is a turn of its own, its call id made from the turn's (`toolq calls` shows both).
            (turn_id,) = [row["turn_id"] for row in map(json.loads, listed.splitlines())
                          if row["tool"] == "exec_command" and row["call_id"] == "call_" + row["turn_id"][5:]]
            turns = subprocess.run([sys.executable, "-m", "toolq.cli.main", "turns", "--json"], env=env, check=True,
                                   capture_output=True, text=True, timeout=60).stdout
            assert [row["prompt"] for row in map(json.loads, turns.splitlines()) if row["turn_id"] == turn_id] == [
                "(mcp-server: exec_command)"]  # `toolq turns` says which front door, not "(Fleet.run_calls)"
            subprocess.run([sys.executable, "-m", "toolq.cli.main", "cancel", turn_id], env=env, check=True,
                           capture_output=True, timeout=60)
            result = await call
            assert result.isError and result.meta is not None and result.meta["toolq/turn"] == turn_id
            assert "aborted" in text_of(result)
            await wait_until(lambda: not pids_matching(marker), timeout=15, what="the process to be killed")

    asyncio.run(asyncio.wait_for(go(), 120))


def cold_stack(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder to upload (notes.txt in it), and a shell's environment with no REDIS_URL (a front
    door then starts its own stack) whose workers each take 3 s to boot."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello from the upload\n")
    xdg, tmp = tmp_path / "xdg", tmp_path / "tmp"
    for d in (xdg, tmp):
        d.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")
           and not k.startswith(("TOOLQ_EXEC_SERVER_", "TOOLQ_MCP_SERVER_"))}
    env.update(XDG_RUNTIME_DIR=str(xdg), TMPDIR=str(tmp), TOOLQ_ENV_ROOT=str(tmp_path / "root"),
               TOOLQ_TOOLS="tests.integration.slow_boot_tools", TOOLQ_TEST_WORKER_BOOT_DELAY="3",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return folder, env


def test_with_upload_on_a_cold_embedded_stack_the_first_call_waits_for_its_workers(tmp_path):
    """No REDIS_URL: the server starts its own Redis and workers, which boot slowly (3 s each); the
    session's environment waits for a worker host as a call waits for a worker, not failing at once."""
    folder, env = cold_stack(tmp_path)
    params = StdioServerParameters(command=sys.executable, env=env,
                                   args=["-m", "toolq.cli.main", "mcp-server", "--tools",
                                         "tests.integration.slow_boot_tools", "--upload", str(folder)])

    async def go():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            done = await session.call_tool("exec_command", {"cmd": "cat notes.txt"})
            assert not done.isError and "hello from the upload" in text_of(done), text_of(done)

    try:
        asyncio.run(asyncio.wait_for(go(), 150))
    finally:
        unmount_under(tmp_path)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stopped_http_server_answers_its_calls_in_flight_as_aborted(fleet, redis_server, tmp_path, sig):
    """A plain call in flight when the server is stopped: its turn is cancelled at once (as `toolq
    cancel` does, its process killed), the client gets the aborted output, and the turn is
    recorded cancelled, not left to run to its yield."""
    marker = long_sleep(4 if sig == "SIGINT" else 3)
    env = server_env(redis_server.url)

    async def go():
        async with http_server(redis_server.url, tmp_path) as server, over_http(server.url) as session:
            call = asyncio.create_task(session.call_tool("exec_command", {"cmd": marker, "yield_time_ms": 60000}))
            await wait_until(lambda: pids_matching(marker), what="the command's process")
            server.proc.send_signal(getattr(signal, sig))
            result = await call
            assert result.isError and "aborted" in text_of(result), text_of(result)
            assert result.meta is not None
            await wait_until(lambda: not pids_matching(marker), timeout=15, what="the process to be killed")
            await asyncio.wait_for(server.proc.wait(), 60)
            return result.meta["toolq/turn"]

    turn_id = asyncio.run(asyncio.wait_for(go(), 120))
    listed = subprocess.run([sys.executable, "-m", "toolq.cli.main", "turns", "--json"], env=env, check=True,
                            capture_output=True, text=True, timeout=60).stdout
    (row,) = [row for row in map(json.loads, listed.splitlines()) if turn_id in row.values()]
    assert "cancelled" in row.values(), row
