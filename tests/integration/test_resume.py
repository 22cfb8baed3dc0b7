"""Durable turns (issue 13): a `toolq run` SIGKILLed mid-call leaves an orphaned turn that
`toolq resume` finishes from Redis alone, without running the call again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import tests.integration.conftest as c
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems

pytestmark = pytest.mark.integration


def toolq(*args: str, env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolq.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=90, **kw)


def turn_state(turn_id: str, env: dict[str, str]) -> str | None:
    out = toolq("turns", "--json", env=env)
    return next((r["state"] for r in map(json.loads, out.stdout.splitlines()) if r["turn_id"] == turn_id), None)


def start_run(fleet, fake: FakeModel, workspace, *, lease: float) -> tuple[dict[str, str], subprocess.Popen, str]:
    """`toolq run --json` on the fleet's Redis in its own process (to be SIGKILLed): env, process, turn id."""
    env = {**os.environ, "REDIS_URL": fleet[0].redis_url, "OPENAI_BASE_URL": fake.base_url,
           "OPENAI_API_KEY": "test", "TOOLQ_SIGNING_KEY": c.SIGNING_KEY, "TOOLQ_TURN_LEASE": f"{lease:g}",
           "PYTHONPATH": c.WORKER_ENV["PYTHONPATH"]}
    proc = subprocess.Popen([sys.executable, "-m", "toolq.cli.main", "run", "--json", "--workspace",
                             str(workspace), "go"], env=env, stdout=subprocess.PIPE, text=True)
    return env, proc, json.loads(proc.stdout.readline())["turn_id"]


def test_a_sigkilled_run_is_orphaned_and_resume_finishes_it_without_running_the_call_again(fleet, tmp_path):
    marker = tmp_path / "ran.txt"
    cmd = f"echo ran >> {marker}; sleep 3; echo finished"
    script = [[b.function_call("exec_command", {"cmd": cmd}, "call_durable")], [b.message("all done")]]
    session = tmp_path.with_name(tmp_path.name + "-session.json")  # outside the workspace, as it must be
    with FakeModel(script) as fake:
        # a lease that outlives a loaded machine starting the early `toolq resume` below
        env, proc, turn_id = start_run(fleet, fake, tmp_path, lease=10)
        end = time.monotonic() + 30
        while not (marker.exists() and marker.read_text()):
            assert time.monotonic() < end, "the command never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no handler runs: only Redis knows the turn now
        proc.wait(10)
        proc.stdout.close()

        # the dead run's lease is still live: nobody else may drive the turn yet
        early = toolq("resume", turn_id, env=env)
        assert early.returncode == 2 and "another orchestrator" in early.stderr, early.stderr

        end = time.monotonic() + 25
        while turn_state(turn_id, env) != "orphaned":
            assert time.monotonic() < end, f"the turn never showed as orphaned: {turn_state(turn_id, env)}"
            time.sleep(0.3)

        resumed = toolq("resume", turn_id, "--json", "--session", str(session), env=env)
        assert resumed.returncode == 0, resumed.stderr
        events = [json.loads(line) for line in resumed.stdout.splitlines()]
        assert events[-1]["type"] == "turn.completed"
        assert len(fake.requests) == 2, "the first request was not asked again"
        second = fake.requests[1]["input"]
    assert pairing_problems(second) == []
    (out,) = [i["output"] for i in second if i["type"] == "function_call_output"]
    assert "finished" in out, out
    assert marker.read_text() == "ran\n", "the call ran twice"
    saved = json.loads(session.read_text())
    assert saved[0]["content"][0]["text"] == "go" and saved[-1]["role"] == "assistant"
    assert turn_state(turn_id, env) == "completed"


def test_a_run_killed_mid_stream_resumes_as_codex_retries_a_cut_stream(fleet, tmp_path):
    """SIGKILL after two calls were committed and dispatched but before `response.completed`:
    `toolq resume` drains the committed calls (the finished one's stored result, the running one
    awaited), records their outputs and asks the model again with them, as Codex retries a cut
    stream. No committed call runs twice, no call is invented, the history pairs."""
    quick, slow = tmp_path / "quick.txt", tmp_path / "slow.txt"
    calls = [b.function_call("exec_command", {"cmd": f"echo ran >> {quick}; echo quick done"}, "call_quick"),
             b.function_call("exec_command", {"cmd": f"echo ran >> {slow}; sleep 3; echo slow done"}, "call_slow")]
    script = [b.response(*calls, b.gate()), [b.message("all done")]]  # the gate: no response.completed
    with FakeModel(script) as fake:
        env, proc, turn_id = start_run(fleet, fake, tmp_path, lease=1)
        for line in proc.stdout:  # the quick call finished: the resume must use its stored result
            event = json.loads(line)
            if event["type"] == "item.completed" and event["item"].get("id") == "call_quick":
                break
        end = time.monotonic() + 30
        while not slow.exists():
            assert time.monotonic() < end, "the slow call never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # mid-stream, mid-call: the response never completed
        proc.wait(10)
        proc.stdout.close()
        assert len(fake.requests) == 1

        end = time.monotonic() + 15
        while (resumed := toolq("resume", turn_id, "--json", env=env)).returncode == 2:
            assert "another orchestrator" in resumed.stderr and time.monotonic() < end, resumed.stderr
            time.sleep(0.2)
        assert resumed.returncode == 0, resumed.stderr
        assert [json.loads(line)["type"] for line in resumed.stdout.splitlines()][-1] == "turn.completed"
        assert len(fake.requests) == 2, "the cut response is retried once, with the committed calls' outputs"
        second = fake.requests[1]["input"]
    assert pairing_problems(second) == []
    assert [(i["type"], i["call_id"]) for i in second if "call_id" in i] == [
        ("function_call", "call_quick"), ("function_call", "call_slow"),
        ("function_call_output", "call_quick"), ("function_call_output", "call_slow")]
    outputs = {i["call_id"]: i["output"] for i in second if i["type"] == "function_call_output"}
    assert "quick done" in outputs["call_quick"] and "slow done" in outputs["call_slow"], outputs
    assert quick.read_text() == "ran\n" and slow.read_text() == "ran\n", "a committed call ran twice"
    assert turn_state(turn_id, env) == "completed"



def test_an_orchestrator_whose_lease_another_took_stops_driving_the_turn(fleet, drive):
    """This orchestrator stalled past its lease and another took the turn (`toolq resume`): it
    stops at once, asks the model nothing more, records nothing, and leaves the running call to
    the new driver (not revoked: it finishes on its worker)."""
    import asyncio

    from toolq.core import keys

    async def during(session, runtime):
        end = time.monotonic() + 20
        while not any(c.get("state") == "running" for c in await runtime.fleet.ledger.calls(session.turn_id or "")):
            assert time.monotonic() < end, "the call never started"
            await asyncio.sleep(0.05)
        await runtime.fleet.ledger.r.set(keys.turn_lease(session.turn_id), "another-orchestrator", px=60_000)

    started = time.monotonic()
    run = drive([[b.function_call("sleep_echo", {"ms": 6000, "text": "slow"}, "call_slow")],
                 [b.message("not asked")]], during=during, turn_lease=1)
    assert run.outcome.status == "failed" and "another orchestrator" in (run.outcome.error or ""), run.outcome
    assert time.monotonic() - started < 5, "it went on driving the turn"
    assert len(run.requests) == 1

    async def ledger_view():
        from toolq.orchestrator.transport.ledger import Ledger

        ledger = Ledger.from_url(fleet[0].redis_url)
        try:
            end = time.monotonic() + 10
            while (calls := await ledger.calls(run.outcome.turn_id))[0].get("state") == "running":
                assert time.monotonic() < end
                await asyncio.sleep(0.1)
            items = await ledger.r.lrange(keys.turn_items(run.outcome.turn_id), 0, -1)
            return (await ledger.turn(run.outcome.turn_id))["state"], calls[0]["state"], items
        finally:
            await ledger.aclose()

    turn_state_, call_state, items = asyncio.run(ledger_view())
    assert turn_state_ == "running", "the turn's new driver records its end, not this one"
    assert call_state == "completed", "the call was stopped; the new driver would have found it revoked"
    assert not any(b"function_call_output" in i for i in items), "this orchestrator wrote an output"


def test_a_call_claimed_by_an_orchestrator_that_died_before_sending_it_runs_on_resume(fleet, tmp_path):
    """Killed between the ledger's claim and the broker's publish, an orchestrator leaves a call
    that nobody will run: the resumed turn waited for it until the deadline ("no worker reported
    starting it", found by the campaign, seed 1). It is sent now, and runs once; a call that was
    sent is still never sent twice."""
    import asyncio

    from toolq.core.items import decode_item
    from toolq.core.settings import Settings
    from toolq.orchestrator.fleet import Fleet
    from toolq.orchestrator.registry import StepContext

    async def go():
        settings = Settings(redis_url=fleet[0].redis_url, workspace=tmp_path, tools=[c.TEST_TOOLS],
                            signing_key=c.SIGNING_KEY)
        rt = await Fleet.open(settings)
        turn_id = f"turn-unsent-{time.time_ns()}"
        ctx = StepContext(turn_id, 0, time.time() + 60, str(tmp_path))
        item = decode_item(b.function_call("count_runs", {}, "call_unsent"))
        await rt.router.watch_turn(turn_id)
        try:
            bound = rt.bind(item, ctx, 0)
            assert await rt.ledger.claim(bound.invocation, bound.spec.queue)  # and then it died
            outputs = []
            for _ in range(2):  # resumed, and resumed again: sent once, answered from its result
                step = rt.step(ctx)
                step.add(rt.bind(item, ctx, 0))
                outputs += await asyncio.wait_for(step.wait(), 20)
            return [o.output for o in outputs]
        finally:
            await rt.router.unwatch_turn(turn_id)
            await rt.aclose()

    assert asyncio.run(go()) == ["counted", "counted"]
    assert (tmp_path / "runs-call_unsent.txt").read_text().count("\n") == 1
