"""A running command's output streams to the watchers while it runs (issue 15 item 3): real Redis,
real workers (the session host path and the one-shot pool-child path), the fake model over TCP.

The call's output, and its pairing, stay the signed result's: streaming only adds `item.updated`
events. Codex's item shapes: `command_execution`, `file_change`, `todo_list`.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import redis

from tests.integration.conftest import SIGNING_KEY, TEST_TOOLS
from tests.integration.test_builtin_tools import exec_parts
from toolq.core import keys
from toolq.dev.fake_model import builders as b
from toolq.orchestrator.fleet import Fleet
from toolq.workers.streaming import STREAM_BYTES

pytestmark = pytest.mark.integration

#: Prints a line every 0.4 s for two seconds.
TICKING = "for i in 1 2 3 4 5; do echo line $i; sleep 0.4; done; exit 3"


def final(text="done"):
    return [b.message(text)]


def events_of(run, call_id: str) -> list[dict]:
    return [e for e in run.events if e["type"].startswith("item.") and e["item"].get("id") == call_id]


def assert_streamed_before_completion(events: list[dict]) -> None:
    started, *updates, completed = events
    assert started["type"] == "item.started" and completed["type"] == "item.completed"
    assert started["item"]["type"] == "command_execution"
    assert started["item"]["command"] == f"bash -c '{TICKING}'" and started["item"]["status"] == "in_progress"
    outputs = [u["item"]["aggregated_output"] for u in updates if u["item"].get("aggregated_output")]
    # Growing output, each a prefix of the next, several while the command still ran.
    assert len(outputs) >= 3, outputs
    assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(outputs)), outputs
    assert outputs[0].startswith("line 1\n") and "line 5" not in outputs[0]
    stamps = [e["timestamp"] for e in events]
    assert stamps == sorted(stamps)
    streamed = [u["timestamp"] for u in updates if u["item"].get("aggregated_output")]
    # The first line came out well before the command's end (it prints for two seconds).
    assert completed["timestamp"] - streamed[0] > 1.0, (streamed, completed["timestamp"])
    assert streamed[-1] < completed["timestamp"]
    item = completed["item"]
    assert (item["type"], item["status"], item["exit_code"]) == ("command_execution", "failed", 3)
    assert item["aggregated_output"] == "".join(f"line {i}\n" for i in range(1, 6))


def test_a_command_that_prints_for_two_seconds_streams_its_lines_before_it_ends(fleet, drive):
    run = drive([[b.function_call("exec_command", {"cmd": TICKING}, "call_tick")], final()])
    assert_streamed_before_completion(events_of(run, "call_tick"))
    # The model's output is the signed result alone, with the whole output, paired as ever.
    code, _, text = exec_parts(run.outputs_of(1)[0]["output"])
    assert (code, text) == (3, "".join(f"line {i}\n" for i in range(1, 6)))


def test_with_streaming_off_nothing_streams_and_the_output_is_the_same(fleet, drive):
    run = drive([[b.function_call("exec_command", {"cmd": TICKING}, "call_tick")], final()], stream_output=False)
    started, *updates, completed = events_of(run, "call_tick")
    assert not any(u["item"].get("aggregated_output") for u in updates)
    assert completed["item"]["aggregated_output"] == "".join(f"line {i}\n" for i in range(1, 6))
    assert exec_parts(run.outputs_of(1)[0]["output"])[0] == 3


def test_a_flood_streams_a_bounded_amount(fleet, drive, redis_server):
    r = redis.Redis.from_url(redis_server.url)
    flood = "head -c 50000000 /dev/zero | tr '\\0' 'y'; sleep 0.3"
    pubsub = r.pubsub()
    pubsub.psubscribe(f"{keys.CALL_OUTPUT}*")
    run = drive([[b.function_call("exec_command", {"cmd": flood}, "call_flood")], final()])
    published = 0
    while (msg := pubsub.get_message(timeout=0.5)) is not None:
        if msg["type"] == "pmessage":
            published += len(json.loads(msg["data"])["text"])
    pubsub.close()
    events = events_of(run, "call_flood")
    updates = [e for e in events if e["type"] == "item.updated" and e["item"].get("aggregated_output")]
    assert updates and 0 < published <= STREAM_BYTES
    assert max(len(u["item"]["aggregated_output"]) for u in updates) <= STREAM_BYTES
    assert len(updates) <= STREAM_BYTES // (16 * 1024) + 2
    out = run.outputs_of(1)[0]["output"]
    assert "Process exited with code 0" in out and "truncated" in out  # the result is as before


def test_apply_patch_is_a_file_change_and_update_plan_a_todo_list(fleet, drive, tmp_path):
    (tmp_path / "old.txt").write_text("a\n")
    (tmp_path / "gone.txt").write_text("x\n")
    patch = ("*** Begin Patch\n*** Add File: new.txt\n+hello\n*** Update File: old.txt\n@@\n-a\n+b\n"
             "*** Delete File: gone.txt\n*** End Patch\n")
    plan = {"plan": [{"step": "read", "status": "completed"}, {"step": "write", "status": "in_progress"}]}
    run = drive([[b.custom_tool_call("apply_patch", patch, "call_patch"),
                  b.function_call("update_plan", plan, "call_plan")], final()])
    patch_events, plan_events = events_of(run, "call_patch"), events_of(run, "call_plan")
    assert [e["type"] for e in (patch_events[0], patch_events[-1])] == ["item.started", "item.completed"]
    done = patch_events[-1]["item"]
    assert (done["type"], done["status"]) == ("file_change", "completed")
    assert done["changes"] == [{"path": str(tmp_path / "new.txt"), "kind": "add"},
                               {"path": str(tmp_path / "old.txt"), "kind": "update"},
                               {"path": str(tmp_path / "gone.txt"), "kind": "delete"}]
    todo = plan_events[-1]["item"]
    assert (todo["type"], todo["status"]) == ("todo_list", "completed")
    assert todo["items"] == [{"text": "read", "completed": True}, {"text": "write", "completed": False}]
    assert (tmp_path / "new.txt").read_text() == "hello\n"


def test_fleet_run_calls_hears_the_same_events(fleet, redis_server, tmp_path):
    """`Fleet.run_calls` carries no conversation, so its commands take the one-shot path
    (`run_command` in the pool child), which streams as the session host does."""
    events: list = []

    async def go():
        async with Fleet.connect(redis_server.url, tools=[TEST_TOOLS], signing_key=SIGNING_KEY,
                                 workspace=tmp_path) as f:
            return await f.run_calls([{"type": "function_call", "name": "exec_command", "call_id": "call_tick",
                                       "arguments": json.dumps({"cmd": TICKING})}],
                                     emit=lambda e: events.append(e.to_json()))

    (out,) = asyncio.run(asyncio.wait_for(go(), 60))
    assert exec_parts(out["output"])[0] == 3

    class Run:
        pass

    run = Run()
    run.events = events
    assert_streamed_before_completion(events_of(run, "call_tick"))


def test_a_forged_or_replayed_batch_never_reaches_the_watchers(fleet, drive, redis_server):
    """Whoever reaches Redis can publish on a call's channel; without the fleet key nothing shows."""
    import redis.asyncio as aioredis

    async def forge(session, runtime):
        r = aioredis.Redis.from_url(redis_server.url)
        pubsub = r.pubsub()
        await pubsub.psubscribe(f"{keys.CALL_OUTPUT}*")
        while (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=10)) is None:
            pass
        genuine = json.loads(msg["data"])
        channel = msg["channel"].decode()
        await r.publish(channel, json.dumps({**genuine, "seq": genuine["seq"] + 100, "text": "FORGED\n"}))
        await r.publish(channel, json.dumps({"seq": 999, "text": "UNSIGNED\n"}))
        await r.publish(channel, msg["data"])  # replayed: its seq is not new
        await pubsub.aclose()
        await r.aclose()

    run = drive([[b.function_call("exec_command", {"cmd": TICKING}, "call_tick")], final()], during=forge)
    events = events_of(run, "call_tick")
    shown = [e["item"].get("aggregated_output", "") for e in events]
    assert not any("FORGED" in s or "UNSIGNED" in s for s in shown)
    outputs = [s for s in shown[1:-1] if s]
    assert all(b.startswith(a) for a, b in itertools.pairwise(outputs))  # the replay added nothing
    assert_streamed_before_completion(events)


#: Prints a line every 0.3 s for about five seconds: a session past its exec_command's 500 ms.
SESSION_TICKING = "for i in $(seq 1 16); do echo tick $i; sleep 0.3; done; exit 4"


def test_a_write_stdin_poll_streams_the_sessions_new_output_while_it_waits(fleet, drive):
    run = drive([[b.function_call("exec_command", {"cmd": SESSION_TICKING, "yield_time_ms": 500}, "call_start")],
                 [b.function_call("write_stdin", {"session_id": 1, "chars": "", "yield_time_ms": 3000}, "call_poll")],
                 final()])
    start_text = run.outputs_of(1)[0]["output"]
    assert "Process running with session ID 1" in start_text, start_text
    started, *updates, completed = events_of(run, "call_poll")
    assert (started["type"], completed["type"]) == ("item.started", "item.completed")
    command = f"bash -c '{SESSION_TICKING}'"
    # The session's command line, known once the poll is routed to the worker holding the session.
    assert all(u["item"]["type"] == "command_execution" for u in updates)
    outputs = [u["item"]["aggregated_output"] for u in updates if u["item"].get("aggregated_output")]
    assert len(outputs) >= 3, outputs
    assert all(u["item"]["command"] == command for u in updates if u["item"].get("aggregated_output"))
    assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(outputs)), outputs
    assert "tick 16" not in outputs[0]
    streamed = [u["timestamp"] for u in updates if u["item"].get("aggregated_output")]
    assert completed["timestamp"] - streamed[0] > 1.0, (streamed, completed["timestamp"])
    assert all(u["item"]["exit_code"] is None and u["item"]["status"] == "in_progress" for u in updates)
    item = completed["item"]
    assert (item["type"], item["command"], item["status"], item["exit_code"]) == (
        "command_execution", command, "failed", 4)
    # The model reads the signed result alone: the poll's new output, all of it, as before.
    (poll_text,) = [o["output"] for o in run.outputs_of(2) if o["call_id"] == "call_poll"]
    assert "Process exited with code 4" in poll_text and poll_text.endswith("tick 16\n"), poll_text
    assert item["aggregated_output"] == poll_text.partition("\nOutput:\n")[2]
    assert outputs[-1] == item["aggregated_output"][:len(outputs[-1])]


def test_with_streaming_off_a_poll_streams_nothing(fleet, drive):
    run = drive([[b.function_call("exec_command", {"cmd": SESSION_TICKING, "yield_time_ms": 500}, "call_start")],
                 [b.function_call("write_stdin", {"session_id": 1, "chars": "", "yield_time_ms": 3000}, "call_poll")],
                 final()], stream_output=False)
    started, *updates, completed = events_of(run, "call_poll")
    assert not any(u["item"].get("aggregated_output") for u in updates)
    assert completed["item"]["aggregated_output"].endswith("tick 16\n")


def test_a_user_tool_that_declares_streaming_streams_like_exec_command(fleet, drive):
    # Issue 25 item 4: streaming is the declaration's (`streams_output=True`), not exec_command's name.
    run = drive([[b.function_call("ticker", {"label": "tick"}, "call_ticker")], final()])
    started, *updates, completed = events_of(run, "call_ticker")
    assert started["item"]["type"] == "tool_call" and completed["item"]["type"] == "tool_call"
    outputs = [u["item"]["output"] for u in updates if u["item"].get("output") and u["item"]["status"] == "in_progress"]
    assert len(outputs) >= 3, outputs  # several while it ran
    assert all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(outputs)), outputs
    assert outputs[0].startswith("tick 1\n") and "tick 5" not in outputs[0]
    assert completed["item"]["output"] == "5 ticks"  # the model's output is the tool's result, as ever
    assert run.outputs_of(1)[0]["output"] == "5 ticks"
