"""Codex's unified exec on the fleet: exec_command sessions that outlive their call, write_stdin
that reaches the worker holding them, and every session dying with its conversation or worker.

Real prefork workers (each with its session host), real Redis, the fake model. Texts are Codex's
(docs/reference/codex-behaviour.md#write_stdin).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import re
import signal
import subprocess
import threading
import time

import pytest

from tests.integration.conftest import TEST_TOOLS, settings_for
from toolq.cli.status import status_cmd
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.turn import Runtime, Session
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration

SESSION_OUTPUT = re.compile(
    r"Chunk ID: [0-9a-f]{6}\nWall time: \d+\.\d{4} seconds\n(Process running with session ID (\d+)|"
    r"Process exited with code (-?\d+))\nOriginal token count: \d+\nOutput:\n(.*)",
    re.DOTALL,
)
STDIN_CLOSED = ("write_stdin failed: stdin is closed for this session; rerun exec_command with tty=true "
                "to keep stdin open")


def parts(text: str) -> tuple[int | None, int | None, str]:
    """(session id while running, exit code once exited, output)."""
    m = SESSION_OUTPUT.fullmatch(text)
    assert m, f"not Codex's unified exec format:\n{text!r}"
    return (int(m[2]) if m[2] else None), (int(m[3]) if m[3] else None), m[4]


def exec_call(call_id: str, cmd: str, **kw):
    return b.function_call("exec_command", {"cmd": cmd, **kw}, call_id)


def write(call_id: str, session_id: int, chars: str = "", **kw):
    return b.function_call("write_stdin", {"session_id": session_id, "chars": chars, **kw}, call_id)


def final(text="done"):
    return [b.message(text)]


def marker() -> str:
    """A sleep no other process runs, to find (or miss) a session's process with pgrep."""
    return f"sleep {random.randint(100000, 999999)}.5"


def running(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode == 0


def gone_within(pattern: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not running(pattern):
            return True
        time.sleep(0.1)
    return False


class Conversation:
    """Several turns of one `Session` against a scripted model; `between(i)` runs before turn i>0."""

    def __init__(self, redis_url: str, workspace, script: list, turns: int = 1, between=None, timeout: float = 90,
                 **settings_kw) -> None:
        with FakeModel(script) as fake:
            settings = settings_for(redis_url, fake, workspace, **settings_kw)
            self.events: list[dict] = []
            self.turn_ids: list[str] = []
            asyncio.run(asyncio.wait_for(self._run(settings, turns, between), timeout))
            self.fake = fake
        for body in fake.requests:
            assert pairing_problems(body["input"]) == [], body["input"]

    async def _run(self, settings, turns: int, between) -> None:
        runtime = await Runtime.create(settings, catalog=load_catalog([TEST_TOOLS]))
        session = Session(runtime)
        try:
            for i in range(turns):
                if between is not None and i:
                    await asyncio.to_thread(between, self, i)
                outcome = await session.run_turn(f"turn {i}", lambda e: self.events.append(e.to_json()))
                self.turn_ids.append(outcome.turn_id)
        finally:
            await session.close()
            await runtime.aclose()

    def outputs(self) -> dict[str, str]:
        last = self.fake.requests[-1]["input"]
        return {o["call_id"]: o["output"] for o in last if o.get("type") == "function_call_output"}


@pytest.fixture
def own_redis():
    """A Redis of its own, so the one worker a test starts is the only one that can hold a session."""
    with RedisServer() as server:
        yield server


# --- sessions, as Codex has them ------------------------------------------------------------------


def test_a_command_running_at_yield_time_becomes_a_session_that_polls_to_its_exit(fleet, redis_server, tmp_path):
    conv = Conversation(redis_server.url, tmp_path, [
        [exec_call("start", "echo start; sleep 2; echo end", yield_time_ms=500)],
        [write("poll", 1, yield_time_ms=10_000)],
        [write("again", 1)],
        final(),
    ])
    out = conv.outputs()
    assert parts(out["start"]) == (1, None, "start\n")
    session, code, text = parts(out["poll"])
    assert (session, code, text) == (None, 0, "end\n")  # the poll returned at the exit, not after 10 s
    assert float(re.search(r"Wall time: ([\d.]+)", out["poll"])[1]) < 5
    assert out["again"] == "write_stdin failed: Unknown process id 1"


def test_tty_round_trips_input_and_a_pipe_session_refuses_writes(fleet, redis_server, tmp_path):
    conv = Conversation(redis_server.url, tmp_path, [
        # Ids are handed out as the yields pass: staggered, so they are 1, 2, 3 in this order.
        [exec_call("cat", "cat", tty=True, yield_time_ms=250),
         exec_call("pipe", "sleep 5", yield_time_ms=1200),
         exec_call("py", "python3 -i", tty=True, yield_time_ms=2500)],
        [write("hello", 1, "hello\n"), write("expr", 3, "print(6*7)\n", yield_time_ms=1000),
         write("closed", 2, "x")],
        [write("eof", 1, "\x04", yield_time_ms=2000), write("bye", 3, "exit()\n", yield_time_ms=3000)],
        final(),
    ])
    out = conv.outputs()
    assert [parts(out[c])[0] for c in ("cat", "pipe", "py")] == [1, 2, 3]  # unique in the conversation
    assert parts(out["hello"])[2] == "hello\r\nhello\r\n"  # the terminal's echo, then cat's copy
    assert "42\r\n>>> " in parts(out["expr"])[2]
    assert out["closed"] == STDIN_CLOSED
    assert parts(out["eof"])[1] == 0 and parts(out["bye"])[1] == 0


def test_unknown_session_gets_codex_text(fleet, redis_server, tmp_path):
    conv = Conversation(redis_server.url, tmp_path, [[write("w", 77)], final()])
    assert conv.outputs()["w"] == "write_stdin failed: Unknown process id 77"


# --- a session lives on one worker, and its calls find it ----------------------------------------


def test_polls_reach_the_worker_holding_each_session_while_others_are_busy(fleet, redis_server, tmp_path):
    ticks = "for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.4; done"
    conv = Conversation(redis_server.url, tmp_path, [
        # Two sessions: with two workers, each poll reaching the right one by chance is 1 in 4.
        [exec_call("a", ticks, yield_time_ms=250), exec_call("b", ticks, yield_time_ms=250)],
        [exec_call("busy1", "sleep 1.5"), exec_call("busy2", "sleep 1.5"), exec_call("busy3", "sleep 1.5"),
         write("pa", 1, yield_time_ms=5000), write("pb", 2, yield_time_ms=5000)],
        final(),
    ])
    out = conv.outputs()
    for start, poll in (("a", "pa"), ("b", "pb")):
        session, _, first = parts(out[start])
        assert session in (1, 2)
        _, code, rest = parts(out[poll])
        assert code == 0, out[poll]
        assert (first + rest).split() == "tick 1 tick 2 tick 3 tick 4 tick 5 tick 6".split()


def test_a_session_started_in_one_turn_is_polled_in_the_next(fleet, redis_server, tmp_path):
    conv = Conversation(redis_server.url, tmp_path, [
        [exec_call("start", "cat", tty=True, yield_time_ms=300)],
        final("turn one done"),
        [write("later", 1, "still here\n")],
        final(),
    ], turns=2)
    assert parts(conv.outputs()["later"])[2] == "still here\r\nstill here\r\n"


def test_status_lists_the_live_sessions_of_the_turns_conversation(fleet, redis_server, tmp_path):
    seen = {}

    def status(conv, _):
        for as_json in (False, True):
            out = io.StringIO()
            assert status_cmd(Settings(redis_url=redis_server.url), conv.turn_ids[0], as_json=as_json, out=out) == 0
            seen[as_json] = out.getvalue()

    Conversation(redis_server.url, tmp_path, [
        [exec_call("start", "sleep 30  # the dev server", yield_time_ms=250)],
        final(),
        final(),
    ], turns=2, between=status)
    assert "1 live exec_command session(s)" in seen[False] and "sleep 30 # the dev server" in seen[False]
    (line,) = [json.loads(text) for text in seen[True].splitlines() if '"session"' in text]
    assert line["session_id"] == 1 and line["worker"].startswith("fleet") and line["command"].startswith("sleep 30")


def test_the_end_of_the_conversation_kills_every_session(fleet, redis_server, tmp_path):
    a, b_ = marker(), marker()
    Conversation(redis_server.url, tmp_path, [
        [exec_call("a", a, yield_time_ms=250), exec_call("b", f"{b_} & wait", yield_time_ms=250)],
        final(),
    ])
    assert gone_within(a, 5) and gone_within(b_, 5), "a session outlived its conversation"


def test_two_conversations_on_one_worker_each_keep_their_session_1(worker, own_redis, tmp_path):
    """Each conversation numbers its sessions from 1. On one worker, a second conversation's session
    1 (started, then exited) once took the first's place in the host: its write_stdin found no
    session, and its process outlived its conversation (found by a red-team helper)."""
    worker(["toolq"], concurrency=2, redis_url=own_redis.url)
    kept = marker()
    done: dict[str, Conversation] = {}

    def run(name: str, script: list) -> None:
        (tmp_path / name).mkdir()
        done[name] = Conversation(own_redis.url, tmp_path / name, script)

    first = threading.Thread(target=run, args=("x", [
        [exec_call("x-start", kept, yield_time_ms=250)],
        [exec_call("x-wait", "sleep 3")],  # the other conversation's session starts and ends meanwhile
        [write("x-poll", 1, yield_time_ms=250)],
        final(),
    ]))
    first.start()
    time.sleep(0.5)
    run("y", [[exec_call("y-start", "sleep 1; echo y", yield_time_ms=250)], [write("y-poll", 1)], final()])
    first.join(60)
    x, y = done["x"].outputs(), done["y"].outputs()
    assert parts(x["x-start"])[0] == 1 and parts(y["y-start"])[0] == 1
    assert parts(y["y-poll"])[1] == 0  # the other's session 1 ran to its end
    assert parts(x["x-poll"])[0] == 1, x["x-poll"]  # and this one's is still there, still running
    assert gone_within(kept, 5), "a session outlived its conversation"


def test_a_killed_worker_loses_its_sessions_with_a_clear_output(worker, own_redis, tmp_path):
    w = worker(["toolq"], concurrency=2, redis_url=own_redis.url)
    sleep = marker()

    def kill_the_worker(conv, _):
        w.kill()
        assert gone_within(sleep, 5), "a session's process outlived its worker"
        time.sleep(9)  # the fleet catalog's TTL (presence.TTL = 8 s): the record is gone

    conv = Conversation(own_redis.url, tmp_path, [
        [exec_call("start", sleep, yield_time_ms=250)],
        final(),
        [write("poll", 1)],
        final(),
    ], turns=2, between=kill_the_worker)
    text = conv.outputs()["poll"]
    assert text.startswith("write_stdin failed: session 1 was lost with its worker "), text
    assert sleep in text


def test_a_write_routed_to_a_worker_that_just_died_is_answered_not_left_to_the_deadline(worker, own_redis, tmp_path):
    """Killed a moment before the write: its fleet record has not expired, so the write is routed to
    its queue, which nobody will ever consume again. It is answered once the worker is gone."""
    w = worker(["toolq"], concurrency=2, redis_url=own_redis.url)
    sleep = marker()
    started = {}

    def kill_the_worker(conv, _):
        w.kill()
        started["at"] = time.monotonic()

    conv = Conversation(own_redis.url, tmp_path, [
        [exec_call("start", sleep, yield_time_ms=250)],
        final(),
        [write("poll", 1)],
        final(),
    ], turns=2, between=kill_the_worker, timeout=60)
    text = conv.outputs()["poll"]
    assert text.startswith("write_stdin failed: session 1 was lost with its worker "), text
    assert time.monotonic() - started["at"] < 30


def test_idle_and_lifetime_limits_kill_sessions(worker, own_redis, tmp_path):
    worker(["toolq"], concurrency=2, redis_url=own_redis.url,
           env={"TOOLQ_SESSION_IDLE": "2", "TOOLQ_SESSION_LIFETIME": "8"})
    idle, busy = marker(), marker()
    conv = Conversation(own_redis.url, tmp_path, [
        [exec_call("idle", idle, yield_time_ms=250), exec_call("busy", busy, tty=True, yield_time_ms=1200)],
        # Session 2 is written to every second (never idle) until its lifetime is up; 1 is left alone.
        *[[write(f"keep{i}", 2, "\n", yield_time_ms=1000)] + ([write("late", 1)] if i == 3 else [])
          for i in range(11)],
        final(),
    ], timeout=60)
    out = conv.outputs()
    assert out["keep2"].startswith("Chunk ID:")  # alive past the idle limit, because it is used
    assert out["keep10"] == "write_stdin failed: Unknown process id 2"  # past its 8 s lifetime
    assert out["late"] == "write_stdin failed: Unknown process id 1"  # idle for over 2 s: killed


def test_the_per_conversation_limit_holds(worker, own_redis, tmp_path):
    worker(["toolq"], concurrency=2, redis_url=own_redis.url, env={"TOOLQ_SESSION_LIMIT": "2"})
    conv = Conversation(own_redis.url, tmp_path, [
        [exec_call("one", "sleep 30", yield_time_ms=250)],
        [exec_call("two", "sleep 30", yield_time_ms=250)],
        [exec_call("three", "sleep 30", yield_time_ms=250)],
        [exec_call("short", "echo fine")],
        final(),
    ])
    out = conv.outputs()
    assert parts(out["one"])[0] == 1 and parts(out["two"])[0] == 2
    assert out["three"].startswith("exec_command failed: this conversation already has 2 live sessions")
    assert parts(out["short"]) == (None, 0, "fine\n")  # a command that ends within its yield still runs


def test_a_worker_without_sessions_runs_each_command_to_completion(worker, own_redis, tmp_path):
    worker(["toolq"], concurrency=1, redis_url=own_redis.url, env={"TOOLQ_SESSIONS": "0"})
    conv = Conversation(own_redis.url, tmp_path, [
        [exec_call("slow", "sleep 1; echo done", yield_time_ms=250)],
        [write("w", 1)],
        final(),
    ])
    out = conv.outputs()
    assert parts(out["slow"]) == (None, 0, "done\n")
    assert out["w"] == "write_stdin failed: Unknown process id 1"


def _stop_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if "starting a new one" in line or "exited with 'exitcode" in line or "Traceback" in line]


@pytest.mark.parametrize("signalled", ["the main process", "the whole process group"])
def test_a_stopping_worker_neither_restarts_its_session_host_nor_reports_its_pool_as_crashed(
        worker, own_redis, tmp_path, signalled):
    """Celery's warm shutdown is a SIGTERM to the main process (`WorkerProcess.stop`); systemd's
    default sends it to the whole group, session host and pool children included. Either way the
    host that exits on it is not started again by a worker on its way out (it was, once: the host
    exits before the worker's own shutdown notice), and no pool child reads as crashed."""
    w = worker(["toolq"], concurrency=2, redis_url=own_redis.url)
    conv = Conversation(own_redis.url, tmp_path, [[exec_call("one", "true")], final()])
    assert conv.outputs()["one"].startswith("Chunk ID:")
    if signalled == "the main process":
        w.stop()
    else:
        os.killpg(w.proc.pid, signal.SIGTERM)
        w.proc.wait(15)
        w.stop()
    log = w.log.read_text()
    assert "the session host exited" not in log and _stop_lines(log) == [], _stop_lines(log)


@pytest.mark.parametrize("sessions", ["1", "0"])
def test_a_worker_stopped_mid_call_leaves_no_command_running(worker, own_redis, tmp_path, sessions):
    """Past the warm shutdown's grace the worker's whole group is told to stop, so the command of
    the call still running is killed (it runs in a session of its own, out of the worker's group),
    unsandboxed too; a SIGKILL of the group alone left it running."""
    w = worker(["toolq"], concurrency=2, redis_url=own_redis.url,
               env={"TOOLQ_SANDBOX": "none", "TOOLQ_SESSIONS": sessions})
    sleep = marker()
    stopped: list[bool] = []

    def stop_mid_call() -> None:
        end = time.monotonic() + 20
        while not running(sleep) and time.monotonic() < end:
            time.sleep(0.05)
        w.stop(grace=1)
        stopped.append(gone_within(sleep, 5))

    stopper = threading.Thread(target=stop_mid_call)
    stopper.start()
    try:
        Conversation(own_redis.url, tmp_path, [[exec_call("long", sleep, yield_time_ms=30000)], final()], timeout=60)
    finally:
        stopper.join(30)
    assert stopped == [True], "the command of a call running at the stop outlived its worker"
