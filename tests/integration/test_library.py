"""toolq as a library (issue 11): `Fleet.run_calls` on the real fleet, and the README's example
driving the official `openai` SDK against the fake model."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from openai.types.responses import ResponseFunctionToolCall

from tests.integration.conftest import ROOT, SIGNING_KEY, TEST_TOOLS, WORKER_ENV
from toolq import Fleet, Settings
from toolq.cli.cancel import cancel
from toolq.cli.status import status_cmd, turns_cmd
from toolq.core import keys
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.turn_events import ItemCompleted
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "openai_sdk_loop.py"
MANY_SESSIONS = ROOT / "examples" / "many_sessions.py"


def fleet_on(redis_url: str, workspace) -> Fleet:
    async def open_() -> Fleet:
        return await Fleet.open(Settings(redis_url=redis_url, workspace=workspace, tools=[TEST_TOOLS],
                                         signing_key=SIGNING_KEY),
                                catalog=load_catalog([TEST_TOOLS]))
    return open_()


def test_the_readme_example_drives_the_openai_sdk_and_runs_every_call_on_the_fleet(tmp_path):
    """As the README runs it: no REDIS_URL, so `Fleet.connect()` starts its own embedded stack."""
    with FakeModel() as fake:  # the script `toolq fake-model` serves by default
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL", "TOOLQ_TOOLS")}
        env.update(OPENAI_BASE_URL=fake.base_url, OPENAI_API_KEY="fake", TOOLQ_WORKSPACE=str(tmp_path))
        proc = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=90,
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("Done."), proc.stdout
        assert (tmp_path / "hello.txt").read_text() == "Hello from toolq\n"
        assert len(fake.requests) == 3
        for body in fake.requests:
            assert pairing_problems(body["input"]) == [], body["input"]
        second = fake.requests[1]
        outputs = [i for i in second["input"] if i.get("type") == "function_call_output"]
        assert [o["call_id"] for o in outputs] == ["call_demo_uname", "call_demo_ls"]
        assert {t.get("name") for t in second["tools"]} >= {"exec_command", "apply_patch"}


def test_the_many_sessions_example_runs_concurrent_turns_on_an_embedded_runtime(tmp_path):
    """As the README runs it, with no REDIS_URL: `Runtime.connect()` starts the embedded stack (the
    example said "needs REDIS_URL", and without one it was a traceback; found by a new user)."""
    script = {"by_prompt": {"*": [[{"type": "function_call", "name": "exec_command",
                                     "arguments": {"cmd": "echo ran > \"$(mktemp -p .)\""}}], "done"]}}
    with FakeModel(script) as fake:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL", "TOOLQ_TOOLS")}
        env.update(OPENAI_BASE_URL=fake.base_url, OPENAI_API_KEY="fake", TOOLQ_WORKSPACE=str(tmp_path))
        proc = subprocess.run([sys.executable, str(MANY_SESSIONS), "one", "two", "three"], env=env,
                              capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and all(line.endswith(" completed: done") for line in lines), proc.stdout
    made = [p for p in tmp_path.iterdir() if p.name != ".git"]  # .git: the sandbox's read-only placeholder
    assert len(made) == 3  # each turn's command ran once, in the workspace
    assert len(fake.requests) == 6


def test_run_calls_takes_sdk_objects_and_dicts_and_answers_every_call_in_call_order(fleet, redis_server, tmp_path):
    async def go():
        f = await fleet_on(redis_server.url, tmp_path)
        try:
            items = [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "not a call"}]},
                ResponseFunctionToolCall(type="function_call", call_id="call_slow", name="sleep_echo",
                                         arguments='{"ms": 200, "text": "slow"}'),
                {"type": "function_call", "call_id": "call_fast", "name": "sleep_echo",
                 "arguments": '{"ms": 0, "text": "fast"}'},
                {"type": "function_call", "call_id": "call_unknown", "name": "no_such_tool", "arguments": "{}"},
            ]
            return await f.run_calls(items)
        finally:
            await f.aclose()

    outputs = asyncio.run(go())
    assert [o["call_id"] for o in outputs] == ["call_slow", "call_fast", "call_unknown"]
    assert all(o["type"] == "function_call_output" for o in outputs)
    assert '"text": "slow"' in outputs[0]["output"] and '"text": "fast"' in outputs[1]["output"]
    assert outputs[2]["output"] == "unsupported call: no_such_tool"


def test_successive_run_calls_of_one_turn_never_collide(fleet, redis_server, tmp_path):
    """The same call_id at the same position, twice in one turn: two steps, two runs, two outputs."""
    item = {"type": "function_call", "call_id": "call_same", "name": "count_runs", "arguments": "{}"}

    turn_id = "turn-lib-steps" + str(time.time_ns())

    async def go():
        f = await fleet_on(redis_server.url, tmp_path)
        try:
            first = await f.run_calls([item], turn_id=turn_id)
            second = await f.run_calls([item], turn_id=turn_id)
            return first, second, await f.ledger.calls(turn_id)
        finally:
            await f.aclose()

    first, second, calls = asyncio.run(go())
    assert first[0]["output"] == second[0]["output"] == "counted"
    assert len({c["task_id"] for c in calls}) == 2
    assert (tmp_path / "runs-call_same.txt").read_text().count("\n") == 2


def test_toolq_cancel_from_another_process_aborts_the_unfinished_calls(fleet, redis_server, tmp_path):
    turn_id = "turn-lib-cancel" + str(time.time_ns())

    async def go():
        f = await fleet_on(redis_server.url, tmp_path)
        other = Ledger.from_url(redis_server.url)  # stands for `toolq cancel TURN_ID` elsewhere
        try:
            calls = asyncio.create_task(f.run_calls([
                {"type": "function_call", "call_id": "call_quick", "name": "sleep_echo", "arguments": '{"text": "q"}'},
                {"type": "function_call", "call_id": "call_long", "name": "sleep_echo", "arguments": '{"ms": 20000}'},
            ], turn_id=turn_id))
            deadline = time.monotonic() + 20
            while not any(c.get("call_id") == "call_long" and c.get("state") == "running"
                          for c in await other.calls(turn_id)):
                assert time.monotonic() < deadline, "call_long never started"
                await asyncio.sleep(0.05)
            started = time.monotonic()
            await other.cancel_turn(turn_id)
            outputs = await calls
            return outputs, time.monotonic() - started
        finally:
            await other.aclose()
            await f.aclose()

    outputs, took = asyncio.run(go())
    assert '"text": "q"' in outputs[0]["output"]
    assert outputs[1]["output"].startswith("aborted by user after")
    assert took < 5
    assert shown_turns(redis_server.url)[turn_id]["state"] == "cancelled"  # issue 26: it stayed `running`


def test_cancelling_one_throttled_call_of_run_calls_answers_it_at_once(fleet, redis_server, tmp_path):
    """`toolq cancel TURN --call CALL` reaches `Fleet.run_calls` too (a reviewer found only `Session` heard it)."""
    turn_id = "turn-lib-cancel-call" + str(time.time_ns())
    ended: list = []

    async def go():
        f = await Fleet.open(Settings(redis_url=redis_server.url, workspace=tmp_path, tools=[TEST_TOOLS],
                                      signing_key=SIGNING_KEY, max_parallel_calls=1), catalog=load_catalog([TEST_TOOLS]))
        other = Ledger.from_url(redis_server.url)  # stands for `toolq cancel TURN --call CALL` elsewhere
        try:
            calls = asyncio.create_task(f.run_calls([
                {"type": "function_call", "call_id": f"call_{k}", "name": "sleep_echo",
                 "arguments": '{"ms": 1500, "text": "ran"}'} for k in range(3)], turn_id=turn_id, emit=ended.append))
            deadline = time.monotonic() + 20
            while not (held := [c for c in await other.calls(turn_id)
                                if c.get("call_id") == "call_2" and c.get("state") == "throttled"]):
                assert time.monotonic() < deadline, "call_2 was never throttled"
                await asyncio.sleep(0.05)
            await other.cancel_call(turn_id, held[0]["task_id"])
            cancelled_at = time.monotonic()
            outputs = await calls
            return outputs, await other.calls(turn_id), cancelled_at
        finally:
            await other.aclose()
            await f.aclose()

    outputs, records, _ = asyncio.run(go())
    assert [o["call_id"] for o in outputs] == ["call_0", "call_1", "call_2"]
    assert '"ran"' in outputs[0]["output"] and '"ran"' in outputs[1]["output"]
    assert outputs[2]["output"].startswith("aborted by user after ")
    record = next(c for c in records if c["call_id"] == "call_2")
    assert record["state"] == "cancelled" and not record.get("started_at"), record
    order = [e.item.id for e in ended if isinstance(e, ItemCompleted)]
    assert order.index("call_2") < order.index("call_1"), order  # at once, not once call_1 let it go



def test_run_calls_refuses_a_system_folder_as_its_workspace(redis_server):
    """A red-team helper's `Fleet.connect(workspace="/etc")`: its commands wrote in /etc."""
    from toolq.core.errors import ConfigurationError

    async def go():
        f = await Fleet.open(Settings(redis_url=redis_server.url, workspace="/etc", tools=[TEST_TOOLS],
                                      signing_key=SIGNING_KEY), catalog=load_catalog([TEST_TOOLS]))
        try:
            await f.run_calls([{"type": "function_call", "call_id": "c", "name": "sleep_echo", "arguments": "{}"}])
        finally:
            await f.aclose()

    with pytest.raises(ConfigurationError, match="^workspace /etc is a system or shared directory"):
        asyncio.run(go())


# --- issue 26: a turn of `Fleet.run_calls` has an end ----------------------------------------------------------


def shown_turns(redis_url: str) -> dict[str, dict]:
    """What `toolq turns --json` lists, by turn id."""
    out = io.StringIO()
    assert turns_cmd(Settings(redis_url=redis_url), limit=100, as_json=True, out=out) == 0
    return {row["turn_id"]: row for row in map(json.loads, out.getvalue().splitlines())}


def echo(call_id: str, text: str = "hi") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "sleep_echo", "arguments": json.dumps({"text": text})}


def test_a_fleet_turn_ends_when_its_caller_ends_it_or_closes_the_fleet(fleet, redis_server, tmp_path):
    turn_id = "turn-lib-end" + str(time.time_ns())

    async def go():
        f = await fleet_on(redis_server.url, tmp_path)
        try:
            await f.run_calls([echo("call_a")], turn_id=turn_id)
            running = (await f.ledger.turn(turn_id))["state"]
            default = f.turn_id
            await f.run_calls([echo("call_b")])  # the default turn
            await f.end_turn(turn_id)
            return running, default, f.turn_id
        finally:
            await f.aclose()  # ends the default turn, which the caller left open

    running, default, after = asyncio.run(go())
    assert running == "running" and after == default  # ending another turn leaves the default one
    shown = shown_turns(redis_server.url)
    assert (shown[turn_id]["state"], shown[default]["state"]) == ("completed", "completed")
    assert shown[turn_id]["calls"] == shown[default]["calls"] == 1
    assert shown[turn_id]["finished_at"] >= shown[turn_id]["started_at"]


def test_toolq_cancel_ends_a_fleet_turn_and_its_caller_cannot_undo_it(fleet, redis_server, tmp_path):
    turn_id = "turn-lib-cancel-end" + str(time.time_ns())

    async def go():
        f = await fleet_on(redis_server.url, tmp_path)
        try:
            first = await f.run_calls([echo("call_1")], turn_id=turn_id)
            # `toolq cancel TURN_ID` said "cancelled" and the turn stayed listed `running`
            await cancel(Settings(redis_url=redis_server.url), turn_id)
            state = (await f.ledger.turn(turn_id))["state"]
            again = await f.run_calls([echo("call_2")], turn_id=turn_id)  # the caller goes on regardless
            await f.end_turn(turn_id, status="completed")
            return first, state, again
        finally:
            await f.aclose()

    first, state, again = asyncio.run(go())
    assert '"text": "hi"' in first[0]["output"] and state == "cancelled"
    assert again[0]["call_id"] == "call_2" and '"text": "hi"' not in again[0]["output"]  # never ran
    assert shown_turns(redis_server.url)[turn_id]["state"] == "cancelled"


def test_a_fleet_turn_whose_process_died_without_ending_it_shows_orphaned(fleet, redis_server, tmp_path):
    """A real process runs a call on the fleet and dies (`os._exit`) with its turn open: no `aclose`."""
    turn_id = "turn-lib-orphan" + str(time.time_ns())
    script = textwrap.dedent(f"""
        import asyncio, os
        from toolq import Fleet, Settings
        from toolq.workers.loader import load_catalog

        async def main():
            fleet = await Fleet.open(Settings(redis_url={redis_server.url!r}, workspace={str(tmp_path)!r},
                                              tools=[{TEST_TOOLS!r}], signing_key={SIGNING_KEY!r}, turn_lease=1),
                                     catalog=load_catalog([{TEST_TOOLS!r}]))
            out = await fleet.run_calls([{echo("call_x")!r}], turn_id={turn_id!r})
            print(out[0]["output"], flush=True)
            os._exit(0)

        asyncio.run(main())
    """)
    env = {**os.environ, **WORKER_ENV}
    env.pop("REDIS_URL", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0 and '"text": "hi"' in proc.stdout, proc.stderr
    deadline = time.monotonic() + 60  # its lease (1 s) lapses; nobody renews it
    while (state := shown_turns(redis_server.url)[turn_id]["state"]) == "running":
        assert time.monotonic() < deadline, "the dead process's turn stayed running"
        time.sleep(0.2)
    assert state == "orphaned"
    out = io.StringIO()
    assert status_cmd(Settings(redis_url=redis_server.url), turn_id, out=out) == 0
    assert out.getvalue().startswith(f"turn {turn_id}  orphaned")
    # and `toolq cancel` gives it an end
    asyncio.run(cancel(Settings(redis_url=redis_server.url), turn_id))
    assert shown_turns(redis_server.url)[turn_id]["state"] == "cancelled"


def test_an_open_fleet_keeps_its_idle_turns_leases_alive(fleet, redis_server, tmp_path):
    """A loop may think for minutes between two `run_calls`: its turn is not orphaned meanwhile."""
    turn_id = "turn-lib-idle" + str(time.time_ns())

    async def go():
        f = await Fleet.open(Settings(redis_url=redis_server.url, workspace=tmp_path, tools=[TEST_TOOLS],
                                      signing_key=SIGNING_KEY, turn_lease=2), catalog=load_catalog([TEST_TOOLS]))
        try:
            await f.run_calls([echo("call_idle")], turn_id=turn_id)
            lease = keys.turn_lease(turn_id)
            seen, deadline = [await f.ledger.r.pttl(lease)], time.monotonic() + 30
            while not (len(seen) > 1 and seen[-1] > seen[-2] > 0):  # renewed while nothing ran
                assert time.monotonic() < deadline, f"the idle turn's lease was never renewed: {seen[-5:]}"
                await asyncio.sleep(0.05)
                seen.append(await f.ledger.r.pttl(lease))
        finally:
            await f.aclose()

    asyncio.run(go())
    assert shown_turns(redis_server.url)[turn_id]["state"] == "completed"


def test_a_block_that_raises_ends_its_open_turns_failed_with_the_error(fleet, redis_server, tmp_path):
    seen: dict = {}

    async def go():
        async with Fleet.connect(redis_server.url, tools=[TEST_TOOLS], workspace=str(tmp_path),
                                 signing_key=SIGNING_KEY) as f:
            await f.run_calls([echo("call_r")])
            seen["turn"] = f.turn_id
            with pytest.raises(ValueError, match="^end_turn: status 'done' is not one of completed, failed, cancelled$"):
                await f.end_turn(status="done")
            raise RuntimeError("the model client broke")

    with pytest.raises(RuntimeError):
        asyncio.run(go())
    row = shown_turns(redis_server.url)[seen["turn"]]
    assert (row["state"], row["error"]) == ("failed", "RuntimeError: the model client broke")


def test_the_readme_loop_without_stream_runs_against_the_fake_model(fleet, redis_server, tmp_path):
    """Issue 26: written without `stream=True`, the README's loop failed at `response.output`
    (`'str' object has no attribute 'output'`): the fake model answered with SSE regardless."""
    from openai import AsyncOpenAI

    async def go(base_url: str) -> str:
        client = AsyncOpenAI(base_url=base_url, api_key="fake", max_retries=0)
        f = await fleet_on(redis_server.url, tmp_path)
        try:
            items: list = [{"role": "user", "content": "show me"}]
            while True:
                response = await client.responses.create(model="gpt-5.5", input=items, tools=f.tool_specs(),
                                                         store=False)
                items += [i.model_dump(exclude_none=True) for i in response.output]
                outputs = await f.run_calls(response.output)
                if not outputs:
                    return response.output_text
                items += outputs
        finally:
            await f.aclose()

    with FakeModel() as fake:  # the script `toolq fake-model` serves by default
        answer = asyncio.run(go(fake.base_url))
    assert answer.startswith("Done.") and (tmp_path / "hello.txt").read_text() == "Hello from toolq\n"
    assert len(fake.requests) == 3 and all("stream" not in body for body in fake.requests)
    for body in fake.requests:
        assert pairing_problems(body["input"]) == [], body["input"]
