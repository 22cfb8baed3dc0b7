"""The turn loop on real Redis, real prefork workers and the fake model over TCP (contracts 2, 5, 6, 8, 9)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

import tests.integration.conftest as c
from toolq.cli.exits import exit_status
from toolq.core.advert import tool_queue
from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.items import FunctionCallItem
from toolq.core.settings import Settings
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.transport.task_message import queue_key
from toolq.orchestrator.turn import Runtime
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration


def final(text="done"):
    return [b.message(text)]


def test_parallel_calls_run_at_once_and_outputs_come_back_in_call_order(fleet, drive):
    run = drive([
        [b.function_call("sleep_echo", {"ms": 800, "text": "slow"}, "call_slow"),
         b.function_call("sleep_echo", {"ms": 50, "text": "fast"}, "call_fast")],
        final(),
    ])
    assert run.outcome.status == "completed"
    second = run.input_of(1)
    kinds = [i["type"] for i in second]
    # calls first (in emitted order), then outputs in call order, not completion order
    assert kinds[-4:] == ["function_call", "function_call", "function_call_output", "function_call_output"]
    assert [i["call_id"] for i in second[-2:]] == ["call_slow", "call_fast"]
    slow, fast = (json.loads(o["output"]) for o in second[-2:])
    assert slow["pid"] != fast["pid"], "both calls ran in one process"
    assert fast["end"] < slow["end"], "the fast call should finish first"
    assert fast["start"] < slow["end"], "the calls did not overlap"


def test_calls_start_before_response_completed(fleet, tmp_path):
    """Contract 2: a call is queued at output_item.done, while the model may still be streaming."""
    marker = tmp_path / "started.txt"
    script = [
        b.response(b.function_call("exec_command", {"cmd": f"echo hi > {marker}"}, "call_early"), gate=True),
        final(),
    ]

    async def during(session, runtime):
        deadline = time.monotonic() + 20
        while not marker.exists():  # the gate holds response.completed until the file appears
            assert time.monotonic() < deadline, "the call did not run before response.completed"
            await asyncio.sleep(0.05)
        fake.release()

    with FakeModel(script) as fake:
        settings = c.settings_for(fleet[0].redis_url, fake, tmp_path)
        events: list = []
        (outcome,), _ = asyncio.run(asyncio.wait_for(c.run_session(settings, ["go"], events, during), 60))
    assert outcome.status == "completed"
    assert marker.read_text() == "hi\n"


def test_unknown_tool_and_bad_arguments_beside_a_valid_call(fleet, drive):
    run = drive([
        [b.function_call("no_such_tool", {}, "call_unknown"),
         b.function_call("sleep_echo", "{not json", "call_badjson"),
         b.function_call("sleep_echo", {"ms": "soon"}, "call_badtype"),
         b.function_call("sleep_echo", {"text": "valid"}, "call_valid")],
        final(),
    ])
    assert run.outcome.status == "completed"
    outputs = {o["call_id"]: o["output"] for o in run.outputs_of(1)}
    assert outputs["call_unknown"] == "unsupported call: no_such_tool"
    assert outputs["call_badjson"].startswith("failed to parse function arguments: ")
    assert "`ms`" in outputs["call_badtype"]
    assert json.loads(outputs["call_valid"])["text"] == "valid"
    # rejected calls never reached the queue
    assert not any(e["type"] == "item.started" and e["item"]["id"] in ("call_unknown", "call_badjson")
                   for e in run.events)


def test_serial_tool_waits_for_earlier_calls_and_holds_later_ones(fleet, drive):
    run = drive([
        [b.function_call("sleep_echo", {"ms": 400, "text": "p1"}, "call_p1"),
         b.function_call("serial_echo", {"ms": 200, "text": "s"}, "call_s"),
         b.function_call("sleep_echo", {"ms": 10, "text": "p2"}, "call_p2")],
        final(),
    ])
    p1, s, p2 = (json.loads(o["output"]) for o in run.outputs_of(1))
    assert s["start"] >= p1["end"], "the serial call started before the call before it finished"
    assert p2["start"] >= s["end"], "a later call ran beside the serial one"


def test_two_calls_sharing_a_call_id_both_run_and_both_are_answered(fleet, drive):
    run = drive([
        [b.function_call("sleep_echo", {"text": "one"}, "call_dup"),
         b.function_call("sleep_echo", {"text": "two"}, "call_dup")],
        final(),
    ])
    outputs = run.outputs_of(1)
    assert [o["call_id"] for o in outputs] == ["call_dup", "call_dup"]
    assert [json.loads(o["output"])["text"] for o in outputs] == ["one", "two"]


def test_namespaced_call_reaches_the_plain_tool_through_functions(fleet, drive):
    run = drive([[b.function_call("sleep_echo", {"text": "ns"}, "call_ns", namespace="functions")], final()])
    call = [i for i in run.input_of(1) if i["type"] == "function_call"][0]
    assert call["namespace"] == "functions"  # round-tripped
    assert json.loads(run.outputs_of(1)[0]["output"])["text"] == "ns"


def test_payload_kind_mismatch_ends_the_turn_and_keeps_history_paired(fleet, drive):
    run = drive([
        [b.function_call("apply_patch", {"input": "*** Begin Patch\n*** End Patch\n"}, "call_fatal"),
         b.function_call("sleep_echo", {"text": "sibling"}, "call_sibling")],
        final(),
    ])
    assert run.outcome.status == "failed"
    assert run.outcome.error == "Fatal error: tool apply_patch invoked with incompatible payload"
    assert len(run.requests) == 1
    history = run.session.history.for_prompt()
    outputs = {i["call_id"]: i["output"] for i in history if i["type"] == "function_call_output"}
    assert outputs["call_fatal"] == "aborted"
    assert json.loads(outputs["call_sibling"])["text"] == "sibling"


def test_a_retryable_stream_error_drains_calls_and_retries_with_their_outputs(fleet, drive):
    """As in Codex (docs/reference/codex-behaviour.md#the-turn-loop): a call in a stream that later fails is executed once, and the retry carries it."""
    run = drive([
        [b.function_call("sleep_echo", {"text": "before the cut"}, "call_cut"), b.cut_after()],
        final("recovered"),
    ])
    assert run.outcome.status == "completed" and run.outcome.final_message == "recovered"
    retry = run.input_of(1)
    assert [i["call_id"] for i in retry if i["type"] == "function_call_output"] == ["call_cut"]
    assert any(e["type"] == "error" and e["message"].startswith("Reconnecting... 1/5") for e in run.events)


def test_a_terminal_model_error_fails_the_turn_with_the_servers_words(fleet, drive):
    run = drive([[b.http_error(400, {"error": {"message": "bad request body", "type": "invalid_request_error"}})]])
    assert run.outcome.status == "failed" and exit_status(run.outcome) == 1
    assert "bad request body" in run.outcome.error
    assert run.events[-1]["type"] == "turn.failed"


def test_dispatch_is_at_most_once_per_call(fleet, tmp_path):
    """Contract 11: asking twice to dispatch one call sends it once."""

    async def go():
        settings = Settings(redis_url=fleet[0].redis_url, workspace=tmp_path, tools=[c.TEST_TOOLS],
                            signing_key=c.SIGNING_KEY)
        rt = await Runtime.create(settings, catalog=load_catalog([c.TEST_TOOLS]))
        try:
            call = ToolCall(tool_name=ToolName.plain("sleep_echo"), call_id="call_once",
                            payload=FunctionPayload(arguments='{"ms": 300}'))
            inv = rt.fleet.registry.bind(call, StepContext("turn-once-" + str(time.time_ns()), 0, time.time() + 30,
                                                     str(tmp_path)), 0)
            spec = rt.fleet.registry.lookup(call.tool_name)
            first = await rt.fleet.dispatcher.dispatch(inv, spec)
            second = await rt.fleet.dispatcher.dispatch(inv, spec)
            return first, second, await rt.fleet.ledger.calls(inv.turn_id)
        finally:
            await rt.aclose()

    first, second, calls = asyncio.run(go())
    assert (first, second) == (True, False)
    assert len(calls) == 1


def test_the_turn_is_visible_in_the_ledger(fleet, drive):
    run = drive([[b.function_call("sleep_echo", {"text": "x"}, "call_l")], final()])

    async def read():
        ledger = Ledger.from_url(fleet[0].redis_url)
        try:
            return await ledger.turn(run.outcome.turn_id), await ledger.calls(run.outcome.turn_id)
        finally:
            await ledger.aclose()

    turn, calls = asyncio.run(read())
    assert turn["state"] == "completed"
    assert [(c["call_id"], c["state"]) for c in calls] == [("call_l", "completed")]
    assert calls[0]["worker"].startswith("fleet")


def test_the_barrier_owns_its_subscriptions_and_many_calls_pile_up_none(fleet, drive):
    """Stock Celery subscribes per task sent and never lets go (docs/reference/celery-notes.md#the-subscribe-at-send-leak);
    toolq holds one pattern per turn."""
    seen: list[tuple[str, int, int]] = []

    async def during(session, runtime):
        end = time.monotonic() + 30
        while not session.turn_id or not any(
                c.get("state") == "completed" for c in await runtime.fleet.ledger.calls(session.turn_id)):
            assert time.monotonic() < end, "no call finished"
            await asyncio.sleep(0.01)
        client = redis.Redis.from_url(fleet[0].redis_url)
        try:
            seen.extend((c.get("name", ""), int(c["sub"]), int(c["psub"])) for c in client.client_list())
        finally:
            client.close()

    run = drive([[b.function_call("sleep_echo", {"ms": 20}, f"call_{i}") for i in range(60)], final()],
                during=during)
    assert run.outcome.status == "completed"
    assert len(run.outputs_of(1)) == 60
    results = [(sub, psub) for name, sub, psub in seen if name == "toolq-results"]
    # Two patterns for the whole turn (its results, its calls' streamed output), no per-task channels.
    assert results == [(0, 2)], seen
    assert all(sub == psub == 0 for name, sub, psub in seen if name == "toolq-ledger"), seen  # commands only
    cancels = [(sub, psub) for name, sub, psub in seen if name == "toolq-cancels"]
    assert cancels == [(0, 1)], seen  # every turn's cancel channel, one pattern for the runtime
    # everyone else (Celery clients: the orchestrator's sender, the workers) holds no task channel;
    # a worker's one pattern is its control broadcast
    assert all(sub == 0 and psub <= 1 for name, sub, psub in seen if not name.startswith("toolq-")), seen


def test_requests_are_stateless_and_carry_instructions_and_reasoning(fleet, tmp_path):
    """As Codex asks (docs/reference/codex-behaviour.md#requests): store false, the whole history each time; reasoning comes back encrypted."""
    script = [[b.reasoning("think", encrypted_content="gAAAA-secret"), b.function_call("sleep_echo", {}, "call_r")],
              final()]
    with FakeModel(script) as fake:
        settings = c.settings_for(fleet[0].redis_url, fake, tmp_path)
        asyncio.run(asyncio.wait_for(c.run_session(settings, ["go"], [], instructions="be brief",
                                                    reasoning={"effort": "medium"}), 60))
        first, second = fake.requests
    for body in (first, second):
        assert body["store"] is False and body["stream"] is True
        assert body["instructions"] == "be brief"
        assert body["reasoning"] == {"effort": "medium"}
        assert body["include"] == ["reasoning.encrypted_content"]
        assert body["parallel_tool_calls"] is True and body["tool_choice"] == "auto"
    assert second["input"][: len(first["input"])] == first["input"]  # the whole history, again
    replayed = [i for i in second["input"] if i["type"] == "reasoning"]
    assert replayed[0]["encrypted_content"] == "gAAAA-secret"


def _one_call_step(rt, turn_id, tmp_path, call_id):
    step = rt.fleet.step(StepContext(turn_id, 0, time.time() + 30, str(tmp_path)))
    step.add(rt.fleet.bind(FunctionCallItem(call_id=call_id, name="count_runs", arguments="{}"), step.ctx, 0))
    return step


async def _runtime(fleet, tmp_path):
    settings = Settings(redis_url=fleet[0].redis_url, workspace=tmp_path, tools=[c.TEST_TOOLS],
                        signing_key=c.SIGNING_KEY)
    return await Runtime.create(settings, catalog=load_catalog([c.TEST_TOOLS]))


def test_a_restarted_orchestrator_finds_the_finished_call_and_does_not_run_it_again(fleet, tmp_path):
    """Contracts 7 and 11: the task id is derived from the call, so a second orchestrator asking
    for the same call gets the first run's result instead of a second run."""
    turn_id = f"turn-restart{time.time_ns()}"

    async def run_call():
        rt = await _runtime(fleet, tmp_path)
        await rt.fleet.router.watch_turn(turn_id)
        try:
            (out,) = await _one_call_step(rt, turn_id, tmp_path, "call_once").wait()
            return out.output, await rt.fleet.ledger.calls(turn_id)
        finally:
            await rt.fleet.router.unwatch_turn(turn_id)
            await rt.aclose()

    first, _ = asyncio.run(run_call())
    again, calls = asyncio.run(run_call())  # a new process would do the same: new runtime, same call
    assert first == again == "counted"
    assert len(calls) == 1, "the call was queued twice"
    assert (tmp_path / "runs-call_once.txt").read_text().count("\n") == 1


def test_a_message_delivered_twice_runs_the_tool_once(fleet, tmp_path):
    """The worker's own guard (contract 11), below the ledger: a redelivered message of a tool that
    is not idempotent does not run again."""
    turn_id = f"turn-twice{time.time_ns()}"

    async def go():
        rt = await _runtime(fleet, tmp_path)
        await rt.fleet.router.watch_turn(turn_id)
        try:
            step = _one_call_step(rt, turn_id, tmp_path, "call_twice")
            (out,) = await step.wait()
            entry = step.entries[0]
            # bypass the ledger's claim: the broker hands the same message over again
            queue = tool_queue(entry.spec)
            await rt.fleet.ledger.r.lpush(queue_key(queue), rt.fleet.dispatcher._message(entry.inv, entry.spec, queue))
            end = time.monotonic() + 20
            while (record := (await rt.fleet.ledger.calls(turn_id))[0]).get("deliveries_refused") != "1":
                assert time.monotonic() < end, "the second delivery was never handled"
                await asyncio.sleep(0.05)
            assert record["state"] == "completed"  # the refusal does not rewrite what happened
            return out.output
        finally:
            await rt.fleet.router.unwatch_turn(turn_id)
            await rt.aclose()

    assert asyncio.run(go()) == "counted"
    assert (tmp_path / "runs-call_twice.txt").read_text().count("\n") == 1


def test_the_turn_deadline_ends_the_turn_and_no_more_requests_are_made(fleet, drive):
    """Past TOOLQ_TURN_TIMEOUT the loop used to keep asking the model, and every new call was
    dispatched already expired (Celery revoked it, and it read "aborted by user")."""
    run = drive([[b.function_call("sleep_echo", {"ms": 5000, "text": "late"}, "call_slow")],
                 [b.function_call("sleep_echo", {"text": "never"}, "call_never")], [b.message("never")]],
                turn_timeout=2)
    assert len(run.requests) == 1, "a model request after the turn's deadline"
    assert run.outcome.status == "failed" and "deadline" in run.outcome.error
    assert run.events[-1]["type"] == "turn.failed"
    (timed_out,) = [e["item"] for e in run.events if e["type"] == "item.completed" and e["item"]["id"] == "call_slow"]
    assert "aborted by user" not in timed_out["output"] and "timed out" in timed_out["output"], timed_out
