"""Outputs that never guess (issue 27, item 1): when toolq's own plumbing fails under a call (Redis
away while it runs, the session host or the MCP host killed with the call in its hands), the
call's output is the tool's own result or toolq's statement of what it knows, never an
infrastructure exception's text as the tool's failure (`toolq/core/honest.py`). Real prefork
workers, real Redis, the fake model; each test injects its fault at one point of a call's path.
The start, permit and end-record points are swept round trip by round trip in
`tests/unit/test_execute_end.py`; a killed MCP host in `test_mcp.py`."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from tests.integration.test_faults import final, wait_for_pid
from toolq.core.honest import INFRASTRUCTURE_TEXT, Known, honest, known_form
from toolq.dev.fake_model import builders as b
from toolq.local.embedded import RedisServer

pytestmark = pytest.mark.integration

#: Redis with AOF: what the worker stores after the outage (the call's result) is what the
#: orchestrator reads, so the test can tell a real result from a guessed one.
DURABLE = ["--appendonly", "yes", "--appendfsync", "always"]


def outage_after(pidfile: Path, server: RedisServer, seconds: float = 2.0):
    """Once the call runs, Redis is killed, stays away `seconds`, and comes back on its port."""
    async def during(session, runtime):
        await asyncio.to_thread(wait_for_pid, pidfile)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(seconds)
        await asyncio.to_thread(server.start)
    return during


def test_a_user_tool_asking_for_cancels_while_redis_is_away_keeps_its_own_result(tmp_path, worker, drive):
    """The tool's `ctx.cancelled()` met no Redis: it used to raise into the tool, whose output read
    "tool patient failed: ConnectionError: Error 111 ..." although the tool was fine."""
    with RedisServer(args=DURABLE) as server:
        worker(["faults"], redis_url=server.url)
        run = drive([[b.function_call("patient", {"seconds": 4}, "call_p")], final()], redis_url=server.url,
                    during=outage_after(tmp_path / "patient-call_p.pid", server), timeout=90, turn_timeout=60)
    (out,) = run.outputs_of(1)
    assert honest(out["output"], "waited it out"), out["output"]
    assert run.outcome.status == "completed"


def test_a_command_running_while_redis_is_away_keeps_its_own_output(tmp_path, worker, drive):
    """exec_command's wait for its session host polls for cancels the same way (the campaign's
    32 "tool exec_command failed: ConnectionError" outputs)."""
    pidfile = tmp_path / "cmd.pid"
    with RedisServer(args=DURABLE) as server:
        worker(["toolq"], redis_url=server.url)
        cmd = f"echo $$ > {pidfile}; sleep 4; echo ran-to-the-end"
        run = drive([[b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 10_000}, "call_x")], final()],
                    redis_url=server.url, during=outage_after(pidfile, server), timeout=90, turn_timeout=60)
    (out,) = run.outputs_of(1)
    assert honest(out["output"], "ran-to-the-end"), out["output"]


def session_host_of(worker_pid: int) -> int:
    """The worker's session host: its child running `toolq.workers.sessions.host`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and b"toolq.workers.sessions.host" in cmdline:
            return int(entry.name)
    raise AssertionError(f"worker {worker_pid} runs no session host")


def test_a_session_host_killed_mid_command_says_the_outcome_is_unknown(tmp_path, worker, drive):
    """The host had the command when it died: it may have run, partly or fully. It used to read
    "exec_command failed: the session host hung up before it answered". The worker starts a new
    host, and the next command of the turn runs."""
    pidfile = tmp_path / "cmd.pid"
    with RedisServer() as server:
        w = worker(["toolq"], redis_url=server.url)

        async def kill_the_host(session, runtime):
            await asyncio.to_thread(wait_for_pid, pidfile)
            os.kill(session_host_of(w.proc.pid), signal.SIGKILL)

        cmd = f"echo $$ > {pidfile}; sleep 30"
        run = drive([[b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 20_000}, "call_k")],
                     [b.function_call("exec_command", {"cmd": "echo after"}, "call_after")], final()],
                    redis_url=server.url, during=kill_the_host, timeout=90)
    (out,) = run.outputs_of(1)
    assert out["output"].startswith("exec_command was interrupted and its outcome is unknown: the session host "
                                    "hung up before it answered, on worker "), out["output"]
    assert known_form(out["output"]) is Known.INTERRUPTED
    items = {e["item"]["id"]: e["item"] for e in run.events if e["type"] == "item.completed"}
    assert items["call_k"]["state"] == "lost"
    assert "after" in run.outputs_of(2)[-1]["output"]
    assert run.outcome.status == "completed"


def test_a_session_host_that_is_gone_before_the_request_says_not_run(tmp_path, worker, drive):
    """No host listening (killed, not yet restarted): the request never reached it, so the command
    did not run, and the output says so."""
    with RedisServer() as server:
        w = worker(["toolq"], redis_url=server.url)
        host = session_host_of(w.proc.pid)
        # Stop it (not kill): the worker's supervisor sees no exit, so nothing restarts it meanwhile.
        os.kill(host, signal.SIGSTOP)
        try:
            sock = next(Path(p) for p in _socket_paths(host))
            sock.rename(sock.with_name(sock.name + ".away"))
            run = drive([[b.function_call("exec_command", {"cmd": "echo never"}, "call_n")], final()],
                        redis_url=server.url, timeout=60)
        finally:
            os.kill(host, signal.SIGCONT)
    (out,) = run.outputs_of(1)
    assert out["output"].startswith("exec_command was not run: the session host does not answer"), out["output"]
    assert known_form(out["output"]) is Known.NOT_RUN
    items = {e["item"]["id"]: e["item"] for e in run.events if e["type"] == "item.completed"}
    assert items["call_n"]["state"] == "rejected"


def _socket_paths(pid: int) -> list[str]:
    """The unix sockets the process listens on, by path (from /proc/net/unix and its fds)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.append(fields[7])
    assert paths, f"process {pid} listens on no unix socket"
    return paths


def descendants(pid: int) -> dict[int, bytes]:
    """Every process under `pid`, with its command line."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = cmdlines.get(child, b"")
            todo.append(child)
    return out


def test_a_sandbox_cell_killed_mid_command_is_told_as_such(tmp_path, worker, drive):
    """The command's sandbox (its bwrap cell) SIGKILLed while the command runs: the output says
    what happened to the command (killed), never an exception of toolq's as the tool's failure,
    and the worker's next command gets a new cell."""
    pidfile = tmp_path / "cmd.pid"
    with RedisServer() as server:
        w = worker(["toolq"], redis_url=server.url)

        async def kill_the_cell(session, runtime):
            await asyncio.to_thread(wait_for_pid, pidfile)
            cells = [p for p, cmd in descendants(w.proc.pid).items() if cmd.split(b"\0")[0].endswith(b"/bwrap")]
            if not cells:
                pytest.skip("this worker's commands run in no bwrap cell here (Landlock)")
            for cell in cells:
                os.kill(cell, signal.SIGKILL)

        cmd = f"echo $$ > {pidfile}; sleep 30"
        run = drive([[b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 20_000}, "call_c")],
                     [b.function_call("exec_command", {"cmd": "echo after"}, "call_after")], final()],
                    redis_url=server.url, during=kill_the_cell, timeout=90)
    (out,) = run.outputs_of(1)
    assert not INFRASTRUCTURE_TEXT.search(out["output"]), out["output"]
    # The cell's death killed the command (SIGKILL: 128 + 9), and that is what the output says.
    assert "Process exited with code 137" in out["output"], out["output"]
    assert "after" in run.outputs_of(2)[-1]["output"]


def test_a_result_lost_on_the_way_back_is_not_called_stopped(tmp_path, worker, drive):
    """The worker ran the call and recorded its end in the ledger, but its result store (a Redis of
    its own, TOOLQ_RESULT_URL) was away past Celery's retries: the orchestrator never heard. At the
    deadline it used to say "call timed out ... and was stopped", which was not so; it reads the
    ledger and says the call ended on that worker and its output is unknown."""
    with RedisServer() as broker, RedisServer() as results:
        worker(["faults"], redis_url=broker.url, env={"TOOLQ_RESULT_URL": results.url})

        async def results_away(session, runtime):
            await asyncio.to_thread(wait_for_pid, tmp_path / "hang-call_r.pid")
            await asyncio.to_thread(results.kill)

        run = drive([[b.function_call("short_hang", {"seconds": 1}, "call_r")], final()], redis_url=broker.url,
                    result_url=results.url, during=results_away, timeout=120)
    (out,) = run.outputs_of(1)
    assert out["output"].startswith("short_hang was interrupted and its outcome is unknown: it ended completed on worker "), \
        out["output"]
    assert "its result never reached the orchestrator" in out["output"]
    items = {e["item"]["id"]: e["item"] for e in run.events if e["type"] == "item.completed"}
    assert items["call_r"]["state"] == "lost"
