"""The barrier's contracts (docs/reference/contracts.md: 8 the barrier, 9 parallel and serial, 10 cancel), run on the
in-memory transport: no Redis, no workers. The same contracts run on real workers in
tests/integration/test_turn_loop.py and test_cancel.py."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import pytest
from pydantic import BaseModel

from toolq.core.calls import ToolInvocation, ToolResult, aborted_text
from toolq.core.catalog import Catalog, ToolContext, ToolReturn, ToolSpec, tool
from toolq.core.items import FunctionCallItem
from toolq.core.states import CallState
from toolq.orchestrator import barrier, watchdog
from toolq.orchestrator.barrier import Step, startable
from toolq.orchestrator.binding import bind_item
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.transport import TaskOutcome
from toolq.orchestrator.transport.memory import HOSTNAME, MemoryRecords, MemoryTransport, catalog_runner
from toolq.orchestrator.turn_events import ItemCompleted, ToolCallView

S, P = True, False


def sync(fn):
    """Run an async test on a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 10))

    return run

PENDING, QUEUED, RUNNING, DONE = CallState.PENDING, CallState.QUEUED, CallState.RUNNING, CallState.COMPLETED


@pytest.mark.parametrize(
    "calls, ready",
    [
        ([(PENDING, P), (PENDING, P)], [0, 1]),  # parallel calls start together
        ([(PENDING, P), (PENDING, S), (PENDING, P)], [0]),  # P1 -> S -> P2
        ([(QUEUED, P), (PENDING, S), (PENDING, P)], []),  # S waits for P1
        ([(DONE, P), (PENDING, S), (PENDING, P)], [1]),  # S alone
        ([(DONE, P), (RUNNING, S), (PENDING, P)], []),  # later calls wait for S
        ([(DONE, P), (DONE, S), (PENDING, P), (PENDING, P)], [2, 3]),
        ([(PENDING, S), (PENDING, S)], [0]),  # serial calls one at a time, in order
        ([(CallState.FAILED, S), (PENDING, S)], [1]),  # a failed call is done too
        ([], []),
    ],
)
def test_startable_follows_the_read_write_lock(calls, ready):
    assert startable(calls) == ready


def test_aborted_text_for_shell_tools_reads_like_codex():
    assert aborted_text(True, 1.84) == "Wall time: 1.8 seconds\naborted by user"


def test_aborted_text_for_other_tools_and_the_minimum():
    assert aborted_text(False, 12.345) == "aborted by user after 12.3s"
    assert aborted_text(False, 0.0) == "aborted by user after 0.1s"


# --- the barrier on the in-memory transport ---------------------------------------------------------


class SleepArgs(BaseModel):
    seconds: float
    text: str = "ok"


def make_catalog() -> Catalog:
    cat = Catalog()

    @tool(catalog=cat)
    async def sleep_echo(args: SleepArgs, ctx: ToolContext) -> str:
        """Sleep, then echo."""
        await asyncio.sleep(args.seconds)
        return args.text

    @tool(catalog=cat, parallel=False)
    async def serial_echo(args: SleepArgs, ctx: ToolContext) -> str:
        """Alone, in call order."""
        await asyncio.sleep(args.seconds)
        return args.text

    @tool(catalog=cat, timeout=0.2)
    async def quick_timeout(args: SleepArgs, ctx: ToolContext) -> str:
        """Has a short timeout."""
        await asyncio.sleep(args.seconds)
        return args.text

    @tool(catalog=cat)
    def exits(args: SleepArgs, ctx: ToolContext) -> ToolReturn:
        """Like a command that exits 3."""
        return ToolReturn(output="Process exited with code 3\nboom", success=False, exit_code=3)

    return cat


class Harness:
    """One step on the in-memory fleet; records the order in which calls start."""

    def __init__(self, tmp_path, deadline: float = 30.0) -> None:
        self.catalog = make_catalog()
        self.registry = Registry(self.catalog)
        self.starts: list[str] = []
        self.events: list = []
        inner = catalog_runner(self.catalog)

        async def run(inv: ToolInvocation, spec: ToolSpec) -> ToolResult:
            self.starts.append(inv.call_id)
            return await inner(inv, spec)

        self.transport = MemoryTransport(run)
        self.records = MemoryRecords()
        self.ctx = StepContext("turn-mem", 0, time.time() + deadline, str(tmp_path))
        self.step = Step(self.ctx, self.transport, self.records, self.events.append)

    def add(self, call_id: str, name: str = "sleep_echo", **args) -> None:
        item = FunctionCallItem(call_id=call_id, name=name, arguments=json.dumps(args))
        bound = bind_item(item, self.registry, self.ctx, len(self.step.entries))
        assert bound is not None
        self.step.add(bound)

    def completed(self) -> dict[str, ToolCallView]:
        return {e.item.id: e.item for e in self.events if isinstance(e, ItemCompleted)}


@sync
async def test_outputs_come_back_in_call_order_not_completion_order(tmp_path):
    h = Harness(tmp_path)
    h.add("call_slow", seconds=0.2, text="slow")
    h.add("call_fast", seconds=0.0, text="fast")
    outputs = await h.step.wait()
    assert [(o.call_id, o.output) for o in outputs] == [("call_slow", "slow"), ("call_fast", "fast")]
    assert h.starts == ["call_slow", "call_fast"]  # both started at once: parallel tools
    assert list(h.completed()) == ["call_fast", "call_slow"]  # the view saw completion order


@sync
async def test_a_serial_call_waits_for_earlier_calls_and_holds_later_ones(tmp_path):
    h = Harness(tmp_path)
    h.add("call_p1", seconds=0.1)
    h.add("call_s", name="serial_echo", seconds=0.1)
    h.add("call_p2", seconds=0.0)
    await asyncio.sleep(0.05)
    assert h.starts == ["call_p1"]  # S waits for P1; P2 waits for S
    outputs = await h.step.wait()
    assert h.starts == ["call_p1", "call_s", "call_p2"]
    assert [o.call_id for o in outputs] == ["call_p1", "call_s", "call_p2"]


@sync
async def test_abort_keeps_finished_outputs_and_cancels_the_rest(tmp_path):
    h = Harness(tmp_path)
    h.add("call_done", seconds=0.0, text="kept")
    h.add("call_long", seconds=30)
    h.add("call_held", name="serial_echo", seconds=0.0)  # never started: pending behind call_long
    while "call_done" not in h.completed():
        await asyncio.sleep(0.01)
    outputs = await h.step.abort()
    assert [o.output for o in outputs][0] == "kept"
    assert all(o.output.startswith("aborted by user after") for o in outputs[1:])
    long_task, held_task = h.step.entries[1].task_id, h.step.entries[2].task_id
    assert h.transport.revoked == [long_task]  # the running call is stopped; the pending one never sent
    assert held_task not in h.transport.sent
    await asyncio.sleep(0)  # the ledger writes run in the background
    await barrier.flush_background()
    assert h.records.calls[long_task]["state"] == h.records.calls[held_task]["state"] == "cancelled"


@sync
async def test_abort_with_the_broker_away_still_aborts_every_unfinished_call(tmp_path):
    """A red-team helper's batch, interrupted while Redis was down: the revoke raised, and the turn
    ended `failed` ("toolq failed: BrokerUnavailable") instead of cancelled."""
    h = Harness(tmp_path)
    h.add("call_long", seconds=30)
    while h.step.entries[0].state is not CallState.RUNNING:
        await asyncio.sleep(0.01)
    h.transport.probe_error = ConnectionError("broker away")
    outputs = await h.step.abort()
    assert outputs[0].output.startswith("aborted by user after") and h.step.entries[0].state is CallState.CANCELLED


@sync
async def test_a_call_past_its_deadline_is_stopped_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(watchdog, "TIME_LIMIT_MARGIN", 0.0)
    h = Harness(tmp_path)
    h.add("call_slow", name="quick_timeout", seconds=30)
    (out,) = await asyncio.wait_for(h.step.wait(), 5)
    assert out.output.startswith("call timed out after") and out.output.endswith("and was stopped")
    assert h.transport.revoked == [h.step.entries[0].task_id]
    assert h.completed()["call_slow"].state is CallState.TIMED_OUT


@sync
async def test_a_call_whose_worker_stops_answering_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(watchdog, "WATCHDOG_INTERVAL", 0.02)
    h = Harness(tmp_path)
    h.transport.alive[HOSTNAME] = False
    h.add("call_l", seconds=30)
    (out,) = await asyncio.wait_for(h.step.wait(), 5)
    assert out.output == (f"worker {HOSTNAME} stopped answering while running this call (or was restarted); "
                          "the call may have partially executed")
    view = h.completed()["call_l"]
    assert (view.state, view.status, view.worker) == (CallState.LOST, "failed", HOSTNAME)


@sync
async def test_a_redis_blip_during_a_call_is_no_evidence_the_call_failed(tmp_path, monkeypatch):
    """The watchdog's ping and draining check raise while Redis is away: the call runs on, and its
    real result is its output (it used to read "toolq failed to run this call")."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    monkeypatch.setattr(watchdog, "WATCHDOG_INTERVAL", 0.02)
    h = Harness(tmp_path)
    h.transport.probe_error = RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    h.transport.reconnected_at = time.monotonic() - 10  # the "lost after a restart" check asks too
    h.add("call_b", seconds=0.3, text="real result")
    (out,) = await asyncio.wait_for(h.step.wait(), 5)
    assert out.output == "real result"


@sync
async def test_a_call_past_its_deadline_that_cannot_be_stopped_says_its_outcome_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(watchdog, "TIME_LIMIT_MARGIN", 0.0)
    h = Harness(tmp_path)
    h.add("call_u", name="quick_timeout", seconds=30)
    h.transport.probe_error = ConnectionError("Redis is down")
    (out,) = await asyncio.wait_for(h.step.wait(), 5)
    assert out.output.startswith("call timed out after") and "may still be running" in out.output, out.output
    assert h.completed()["call_u"].state is CallState.TIMED_OUT


@sync
async def test_the_first_terminal_state_wins(tmp_path):
    h = Harness(tmp_path)
    h.add("call_r", seconds=30)
    task_id = h.step.entries[0].task_id
    await asyncio.sleep(0.01)
    assert h.transport.deliver(task_id, TaskOutcome(state=CallState.CANCELLED))  # revoked from Flower
    late = ToolResult(call_id="call_r", output="late success")
    assert not h.transport.deliver(task_id, TaskOutcome(state=CallState.COMPLETED, result=late))
    (out,) = await h.step.wait()
    assert out.output.startswith("aborted by user after")


@sync
async def test_a_queue_that_refuses_the_send_gives_a_not_run_output(tmp_path):
    h = Harness(tmp_path)
    h.transport.refuse_sends = "the task queue (Redis) is unavailable: connection refused"
    h.add("call_x", seconds=0)
    (out,) = await h.step.wait()
    assert out.output == "sleep_echo was not run: the task queue (Redis) is unavailable: connection refused"
    assert h.completed()["call_x"].state is CallState.FAILED


@sync
async def test_a_rejected_call_is_answered_at_once_and_still_listed(tmp_path):
    h = Harness(tmp_path)
    h.add("call_bad", seconds="soon")
    assert h.step.entries[0].done.is_set() and h.transport.sent == []
    (out,) = await h.step.wait()
    assert out.output.startswith("failed to parse function arguments: invalid value at `seconds`")
    await barrier.flush_background()
    (record,) = h.records.calls.values()
    assert (record["call_id"], record["state"]) == ("call_bad", "rejected")
    view = h.completed()["call_bad"]  # the user sees it fail too, with the reason
    assert (view.status, view.state) == ("failed", CallState.REJECTED)
    assert view.reason.startswith("failed to parse function arguments")


@sync
async def test_a_tool_that_reports_failure_shows_failed_with_its_exit_code(tmp_path):
    h = Harness(tmp_path)
    h.add("call_e", name="exits", seconds=0)
    (out,) = await h.step.wait()
    assert out.output == "Process exited with code 3\nboom"  # what the model reads is unchanged
    view = h.completed()["call_e"]
    assert (view.status, view.state, view.exit_code, view.reason) == ("failed", CallState.FAILED, 3, "exit code 3")
    assert view.run_time is not None and view.round_trip is not None and view.round_trip >= view.run_time

