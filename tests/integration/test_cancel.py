"""Cancel a turn from any process; revoke one call (contract 10, issue 6)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.integration.conftest as c
from tests import markers
from toolq.cli.cancel import UnknownTarget, cancel
from toolq.cli.exits import exit_status
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.turn import TURN_ABORTED

pytestmark = pytest.mark.integration

SHELL_ABORTED = re.compile(r"^Wall time: [0-9]+\.[0-9] seconds\naborted by user$")


def pids_matching(marker: str) -> list[int]:
    """Processes whose command line contains the marker (no psutil needed: /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if marker in cmdline and stat.split(") ", 1)[-1][:1] != "Z":  # zombies are already dead
                found.append(int(entry.name))
    return found


async def wait_until(predicate, timeout=20.0, what="condition"):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def family_command(tag: str) -> str:
    # a command whose children spawn children: all must die with the call
    return f"bash -c 'sleep 30.{tag}1 & sleep 30.{tag}2; wait' & sleep 30.{tag}3; wait"


def test_cancelling_a_turn_kills_every_process_and_leaves_a_paired_history(fleet, tmp_path):
    tag = f"{markers.PROCESS}1"  # its own digit: the signal test's sleeps are `30.<PROCESS>0...`
    script = [
        [b.function_call("sleep_echo", {"text": "finished first"}, "call_done"),
         b.function_call("exec_command", {"cmd": family_command(tag)}, "call_sleep")],
        [b.message("second turn answer")],
    ]

    async def during(session, runtime):
        await wait_until(lambda: all(pids_matching(f"sleep 30.{tag}{i}") for i in (1, 2, 3)),
                         what="the command's processes")
        await wait_until(lambda: any(e["type"] == "item.completed" and e["item"]["id"] == "call_done"
                                     for e in events), what="the first call")
        settings = runtime.settings
        # from another process, as a user would
        subprocess.run([sys.executable, "-m", "toolq.cli.main", "cancel", session.turn_id], check=True,
                       env={**os.environ, "REDIS_URL": settings.redis_url}, capture_output=True, timeout=30)

    events: list = []
    with FakeModel(script) as fake:
        settings = c.settings_for(fleet[0].redis_url, fake, tmp_path)

        async def go():
            outcomes, session = await c.run_session(settings, ["first"], events, during)
            return outcomes[0], session

        outcome, session = asyncio.run(asyncio.wait_for(go(), 60))
        assert outcome.status == "cancelled" and exit_status(outcome) == 130
        assert len(fake.requests) == 1, "no model request after a cancel"

    deadline = time.monotonic() + 5
    while pids_matching(f"sleep 30.{tag}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_matching(f"sleep 30.{tag}") == [], "a process of the cancelled call survived"

    history = session.history.for_prompt()
    assert pairing_problems(history) == []
    outputs = {i["call_id"]: i["output"] for i in history if i["type"] == "function_call_output"}
    assert json.loads(outputs["call_done"])["text"] == "finished first"  # finished calls keep their output
    assert SHELL_ABORTED.match(outputs["call_sleep"]), outputs["call_sleep"]
    assert history[-1]["content"][0]["text"] == TURN_ABORTED
    assert not session.history.repairs


def test_the_session_continues_after_a_cancel(fleet, tmp_path):
    script = [[b.function_call("sleep_echo", {"ms": 20000}, "call_long")], [b.message("fine")]]
    events: list = []

    async def during(session, runtime):
        if getattr(session, "_cancelled_once", False):
            return  # the second turn runs undisturbed
        session._cancelled_once = True
        await wait_until(lambda: any(e["type"] == "item.updated" for e in events), what="the call to start")
        session.cancel()  # Ctrl-C in this process

    with FakeModel(script) as fake:
        settings = c.settings_for(fleet[0].redis_url, fake, tmp_path)
        outcomes, session = asyncio.run(asyncio.wait_for(
            c.run_session(settings, ["first", "second"], events, during), 60))
        assert [o.status for o in outcomes] == ["cancelled", "completed"]
        second = fake.requests[1]["input"]
    assert pairing_problems(second) == []
    texts = [p.get("text") for i in second if i.get("type") == "message" for p in i["content"]]
    assert TURN_ABORTED in texts
    aborted = [i for i in second if i.get("type") == "function_call_output"][0]["output"]
    assert re.match(r"^aborted by user after [0-9]+\.[0-9]s$", aborted)


def test_cancelling_one_call_aborts_it_and_the_turn_goes_on(fleet, drive):
    async def during(session, runtime):
        await wait_until(lambda: session.turn_id is not None, what="the turn")
        ledger = runtime.fleet.ledger

        async def started():
            return any(c.get("call_id") == "call_long" and c.get("state") == "running"
                       for c in await ledger.calls(session.turn_id))

        end = time.monotonic() + 20
        while not await started():
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        with pytest.raises(UnknownTarget, match=r"^no call call_nope in turn .* \(a call pending behind a serial one "
                                                r"is listed once it may start; `toolq cancel turn-\w+` stops the whole"):
            await cancel(runtime.settings, session.turn_id, "call_nope")
        await cancel(runtime.settings, session.turn_id, "call_long")

    run = drive([
        [b.function_call("sleep_echo", {"ms": 20000}, "call_long"),
         b.function_call("sleep_echo", {"ms": 300, "text": "kept"}, "call_short")],
        [b.message("went on")],
    ], during=during)
    assert run.outcome.status == "completed" and run.outcome.final_message == "went on"
    long_out, short_out = (o["output"] for o in run.outputs_of(1))
    assert re.match(r"^aborted by user after [0-9]+\.[0-9]s$", long_out)
    assert json.loads(short_out)["text"] == "kept"


def test_a_cancel_with_no_worker_online_prevents_the_call_from_running(worker, drive, tmp_path, redis_server):
    """The revoke broadcast is lost with nobody listening; the durable record is not. The only
    `faults` worker was SIGKILLed a moment ago: its fleet catalog record outlives it until its TTL,
    so the call is queued for it (a worker that exited cleanly would have withdrawn at once)."""
    worker(["faults"]).kill()

    async def during(session, runtime):
        await wait_until(lambda: session.turn_id is not None, what="the turn")
        end = time.monotonic() + 20
        while not await runtime.fleet.ledger.calls(session.turn_id):
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        await cancel(runtime.settings, session.turn_id)

    run = drive([[b.function_call("hang", {"seconds": 5}, "call_queued")], [b.message("unreachable")]],
                during=during)
    assert run.outcome.status == "cancelled"
    turn_id = run.outcome.turn_id

    worker(["faults"])  # the queued message is delivered now

    async def worker_state():
        ledger = Ledger.from_url(redis_server.url)
        try:
            end = time.monotonic() + 20
            while True:
                (call,) = await ledger.calls(turn_id)
                if call.get("worker"):
                    return call
                assert time.monotonic() < end, "the worker never took the queued message"
                await asyncio.sleep(0.05)
        finally:
            await ledger.aclose()

    call = asyncio.run(worker_state())
    assert call["state"] == "cancelled"
    assert not (tmp_path / "hang-call_queued.pid").exists(), "the cancelled call ran"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_toolq_run_cancels_the_turn_and_the_session_continues(fleet, tmp_path, sig):
    """Ctrl-C, `kill`/`timeout`/systemd (SIGTERM) and a closed terminal (SIGHUP) all end the turn
    cleanly: durable cancel record, command killed, aborted output, session written, exit 130."""
    tag = f"{markers.PROCESS}0{sig.value}"
    session_file = tmp_path.with_name(tmp_path.name + "-session.json")  # outside the workspace, as it must be
    script = [[b.function_call("exec_command", {"cmd": f"sleep 30.{tag}9"}, "call_int")], [b.message("resumed")]]
    with FakeModel(script) as fake:
        env = {**os.environ, "REDIS_URL": fleet[0].redis_url, "OPENAI_BASE_URL": fake.base_url,
               "OPENAI_API_KEY": "test", "PYTHONPATH": c.WORKER_ENV["PYTHONPATH"]}
        argv = [sys.executable, "-m", "toolq.cli.main", "run", "--json", "--workspace", str(tmp_path),
                "--session", str(session_file)]
        proc = subprocess.Popen(argv + ["go"], env=env, stdout=subprocess.PIPE, text=True)
        end = time.monotonic() + 30
        while not pids_matching(f"sleep 30.{tag}9"):
            assert time.monotonic() < end, "the command never started"
            time.sleep(0.02)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130
        events = [json.loads(line) for line in out.splitlines()]
        assert events[0]["type"] == "turn.started"
        assert events[-1]["type"] == "turn.aborted"
        time.sleep(0.5)
        assert pids_matching(f"sleep 30.{tag}9") == []
        assert session_file.exists(), "the session was not written"
        turn_id = events[0]["turn_id"]

        async def ledger_view():
            ledger = Ledger.from_url(fleet[0].redis_url)
            try:
                return await ledger.turn(turn_id), await ledger.is_cancelled(turn_id)
            finally:
                await ledger.aclose()

        turn, durable = asyncio.run(ledger_view())
        assert turn["state"] == "cancelled" and durable

        # the next `toolq run --session` continues the conversation from a paired history
        again = subprocess.run(argv + ["go on"], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0, again.stderr
        resumed = fake.requests[1]["input"]
    assert pairing_problems(resumed) == []
    texts = [p.get("text") for i in resumed if i.get("type") == "message" for p in i["content"]]
    assert texts[-2:] == [TURN_ABORTED, "go on"]
    (aborted,) = [i["output"] for i in resumed if i["type"] == "function_call_output"]
    assert SHELL_ABORTED.match(aborted), aborted


def test_a_cancel_while_the_model_is_still_streaming_stops_the_stream_at_once(fleet, tmp_path):
    """Codex S11c: interrupted while waiting for the model, no further request, history paired."""
    script = [b.response(b.function_call("sleep_echo", {"text": "done early"}, "call_a"), b.stall(30),
                         b.message("never seen")), [b.message("next")]]
    events: list = []

    async def during(session, runtime):
        await wait_until(lambda: any(e["type"] == "item.completed" and e["item"].get("id") == "call_a"
                                     for e in events), what="the first call to finish")
        session.cancel()

    started = time.monotonic()
    with FakeModel(script) as fake:
        settings = c.settings_for(fleet[0].redis_url, fake, tmp_path)
        (outcome,), session = asyncio.run(asyncio.wait_for(c.run_session(settings, ["go"], events, during), 60))
        assert len(fake.requests) == 1
    assert outcome.status == "cancelled"
    assert time.monotonic() - started < 15, "the cancel waited for the stalled stream"
    history = session.history.for_prompt()
    assert pairing_problems(history) == []
    outputs = [i for i in history if i["type"] == "function_call_output"]
    assert json.loads(outputs[0]["output"])["text"] == "done early"
    assert all(i.get("content") != [{"type": "output_text", "text": "never seen"}] for i in history)


def test_a_call_cancel_is_acted_on_only_with_its_durable_record_and_junk_keeps_the_channel(redis_server, caplog):
    """A red-team helper's forged publish (no record) answered a held call, and a channel name that
    was not UTF-8 knocked the runtime's cancel subscription offline."""
    import redis as sync_redis

    from toolq.core import keys

    heard: list[str] = []

    async def go():
        ledger = Ledger.from_url(redis_server.url)
        publisher = sync_redis.Redis.from_url(redis_server.url)
        stop_hearing = ledger.on_call_cancel("turn-x", heard.append)
        waiting = asyncio.create_task(ledger.wait_for_cancel("turn-x"))  # as a running turn does
        try:
            await asyncio.sleep(0.3)
            publisher.publish(keys.cancel_channel("turn-x").encode() + b"\xff\xfe", b"{}")
            publisher.publish(keys.cancel_channel("turn-x"), json.dumps({"scope": "call", "task_id": "forged"}))
            await ledger.cancel_call("turn-x", "turn-x:0:1:abc")
            for _ in range(50):
                if heard:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
        finally:
            stop_hearing()
            waiting.cancel()
            publisher.close()
            await ledger.aclose()

    with caplog.at_level("WARNING", logger="toolq.cancels"):
        asyncio.run(go())
    assert heard == ["turn-x:0:1:abc"]
    assert not any("lost the cancel channel" in r.getMessage() for r in caplog.records), caplog.text
    assert any("ignored a cancel of call forged" in r.getMessage() for r in caplog.records)
