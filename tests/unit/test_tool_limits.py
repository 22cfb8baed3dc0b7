"""Declaring and configuring limits (pure: no Redis), and the per-turn cap on the in-memory fleet."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import BaseModel

from tests.unit.test_barrier import sync
from toolq.core.calls import ToolInvocation, ToolResult
from toolq.core.catalog import Catalog, ToolContext, ToolSpec, tool
from toolq.core.errors import ConfigurationError
from toolq.core.items import FunctionCallItem
from toolq.core.settings import Settings
from toolq.core.states import CallState
from toolq.core.tool_limits import Rate, ToolLimit, parse_tool_limits
from toolq.orchestrator.barrier import Step
from toolq.orchestrator.binding import bind_item
from toolq.orchestrator.limits import Limits
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.transport.memory import MemoryRecords, MemoryTransport, catalog_runner
from toolq.orchestrator.turn_events import ItemCompleted, ItemUpdated


@pytest.mark.parametrize("text, calls, window", [("10/s", 10, 1.0), ("100/m", 100, 60.0), (" 3 / min ", 3, 60.0),
                                                 ("1/second", 1, 1.0)])
def test_a_rate_reads_calls_per_second_or_minute(text, calls, window):
    assert Rate.parse(text) == Rate(calls=calls, window=window)


@pytest.mark.parametrize("text", ["10/h", "0/s", "ten/s", "10", "-1/s", ""])
def test_a_rate_that_is_not_n_per_second_or_minute_is_refused(text):
    with pytest.raises(ValueError, match="is not N/s or N/m"):
        Rate.parse(text)


def test_tool_limits_come_from_one_json_setting_and_toolq_config_shows_them():
    env = {"TOOLQ_TOOL_LIMITS": '{"gpu.infer": {"max_concurrency": 2, "rate_limit": "10/s"}, "exec_command": '
                                '{"rate_limit": "100/m"}}', "TOOLQ_MAX_PARALLEL_CALLS": "8", "TOOLQ_LIMIT_LEASE": "5"}
    s = Settings.load(env)
    assert s.tool_limits["gpu.infer"] == ToolLimit(max_concurrency=2, rate_limit=Rate(calls=10, window=1.0))
    assert (s.max_parallel_calls, s.limit_lease) == (8, 5.0)
    shown = s.masked()
    assert shown["tool_limits"] == {"gpu.infer": {"max_concurrency": 2, "rate_limit": "10/s"},
                                    "exec_command": {"max_concurrency": None, "rate_limit": "100/m"}}
    assert json.loads(json.dumps(shown))  # `toolq config` prints it as JSON
    assert Settings.load({}).tool_limits == {} and Settings.load({}).max_parallel_calls == 16


@pytest.mark.parametrize("value, message", [
    ('{"x": {"rate_limit": "10/h"}}', "x: rate_limit '10/h' is not N/s or N/m"),
    ('{"x": {"max_concurrency": 0}}', "x.max_concurrency: Input should be greater than or equal to 1"),
    ('{"x": {"max_concurency": 2}}', "x.max_concurency: Extra inputs are not permitted"),
    ('{"x": {"rate_limit": 5}}', "x: rate_limit 5 is not N/s or N/m"),
    ('{"x": 2}', "x: Input should be a valid dictionary"),
    ('["x"]', "must be a JSON object of tool name"),
    ("{x: 1}", "not JSON"),
])
def test_a_bad_tool_limit_is_one_line_naming_the_setting_the_tool_and_the_field(value, message):
    with pytest.raises(ConfigurationError) as e:
        Settings.load({"TOOLQ_TOOL_LIMITS": value})
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("invalid setting tool_limits (TOOLQ_TOOL_LIMITS): ") and message in text, text


def test_a_setting_overrides_each_field_it_names_and_null_removes_a_limit():
    declared = ToolLimit(max_concurrency=2, rate_limit=Rate.parse("10/s"))
    (over,) = parse_tool_limits('{"t": {"max_concurrency": 5}}').values()
    assert declared.over(over) == ToolLimit(max_concurrency=5, rate_limit=Rate.parse("10/s"))
    (gone,) = parse_tool_limits('{"t": {"rate_limit": null}}').values()
    assert declared.over(gone) == ToolLimit(max_concurrency=2) and declared.over(None) == declared
    assert not ToolLimit().limited and declared.limited


class NoArgs(BaseModel):
    pass


def test_a_tool_declares_its_limits_and_they_are_not_part_of_its_digest():
    a, b = Catalog(), Catalog()

    @tool(catalog=a, max_concurrency=2, rate_limit="10/s")
    def infer(args: NoArgs, ctx: ToolContext) -> str:
        """Infer."""
        return ""

    plain = tool(catalog=b, name="infer")(lambda args, ctx: "")
    limited = infer.tool_spec
    assert limited.limit == ToolLimit(max_concurrency=2, rate_limit=Rate(calls=10, window=1.0))
    assert limited.digest() == ToolSpec(**{**plain.tool_spec.__dict__, "description": "Infer.",
                                           "kind": limited.kind, "parameters": limited.parameters,
                                           "strict": limited.strict}).digest()


@pytest.mark.parametrize("kw, message", [({"max_concurrency": 0}, "max_concurrency: Input should be greater"),
                                         ({"rate_limit": "5 per hour"}, "rate_limit '5 per hour' is not N/s or N/m")])
def test_a_bad_declared_limit_is_one_line_naming_the_tool(kw, message):
    with pytest.raises(ConfigurationError, match=f"^tool infer: {message}"):
        tool(catalog=Catalog(), name="infer", **kw)(lambda args, ctx: "")


# --- the per-turn cap, on the in-memory fleet ----------------------------------------------------------


class SleepArgs(BaseModel):
    seconds: float


class CapHarness:
    def __init__(self, tmp_path, cap: int, deadline: float = 30.0) -> None:
        self.catalog = Catalog()

        @tool(catalog=self.catalog)
        async def nap(args: SleepArgs, ctx: ToolContext) -> str:
            """Sleep."""
            await asyncio.sleep(args.seconds)
            return "ok"

        self.running = self.peak = 0
        self.starts: list[str] = []
        inner = catalog_runner(self.catalog)

        async def run(inv: ToolInvocation, spec: ToolSpec) -> ToolResult:
            self.starts.append(inv.call_id)
            self.running += 1
            self.peak = max(self.peak, self.running)
            try:
                return await inner(inv, spec)
            finally:
                self.running -= 1

        self.events: list = []
        self.transport, self.records = MemoryTransport(run), MemoryRecords()
        self.ctx = StepContext("turn-cap", 0, time.time() + deadline, str(tmp_path))
        self.step = Step(self.ctx, self.transport, self.records, self.events.append, Limits(max_parallel_calls=cap))
        self.registry = Registry(self.catalog)

    def add(self, call_id: str, seconds: float) -> None:
        item = FunctionCallItem(call_id=call_id, name="nap", arguments=json.dumps({"seconds": seconds}))
        self.step.add(bind_item(item, self.registry, self.ctx, len(self.step.entries)))

    def throttled(self) -> list[str]:
        return [e.item.id for e in self.events if isinstance(e, ItemUpdated) and e.item.state is CallState.THROTTLED]


@sync
async def test_the_turn_cap_holds_calls_in_flight_and_keeps_call_order(tmp_path):
    h = CapHarness(tmp_path, cap=2)
    for k in range(6):
        h.add(f"call_{k}", 0.05)
    outputs = await h.step.wait()
    assert [o.output for o in outputs] == ["ok"] * 6 and [o.call_id for o in outputs] == [f"call_{k}" for k in range(6)]
    assert h.peak == 2 and h.starts == [f"call_{k}" for k in range(6)]
    assert h.throttled() == [f"call_{k}" for k in range(2, 6)]
    # listed in the ledger as throttled while they waited (a worker writes the later states)
    assert [h.records.calls.get(e.task_id, {}).get("state") for e in h.step.entries] == [None, None] + ["throttled"] * 4
    thr = next(e for e in h.events if isinstance(e, ItemUpdated) and e.item.state is CallState.THROTTLED)
    assert thr.item.status == "in_progress" and "TOOLQ_MAX_PARALLEL_CALLS" in thr.item.reason


@sync
async def test_cancelling_a_throttled_call_gives_the_aborted_output_and_revokes_nothing_unsent(tmp_path):
    h = CapHarness(tmp_path, cap=1)
    h.add("call_running", 5.0)
    h.add("call_throttled", 0.0)
    await asyncio.sleep(0.1)
    assert [e.state for e in h.step.entries] == [CallState.RUNNING, CallState.THROTTLED]
    outputs = await h.step.abort()
    assert [o.output.startswith("aborted by user after") for o in outputs] == [True, True]
    assert h.transport.revoked == [h.step.entries[0].task_id]  # the throttled one was never sent
    assert h.transport.sent == [h.step.entries[0].task_id]


@sync
async def test_cancelling_one_throttled_call_answers_it_now_and_the_next_takes_its_place(tmp_path):
    h = CapHarness(tmp_path, cap=1)
    for call_id, seconds in (("call_a", 0.3), ("call_b", 0.0), ("call_c", 0.0)):
        h.add(call_id, seconds)
    await asyncio.sleep(0.05)
    h.step.cancel_unsent(h.step.entries[1].task_id)
    assert h.step.entries[1].done.is_set() and h.step.entries[1].state is CallState.CANCELLED  # not after call_a
    outputs = await h.step.wait()
    assert [o.output for o in outputs[::2]] == ["ok", "ok"] and outputs[1].output.startswith("aborted by user after")
    assert h.starts == ["call_a", "call_c"] and h.records.calls[h.step.entries[1].task_id]["state"] == "cancelled"


@sync
async def test_a_cancel_as_the_slot_frees_is_not_lost_and_nothing_hangs(tmp_path):
    """A reviewer's race: the cancel lands in the tick the turn's slot passes to the call; 3.11's
    wait_for then returns the slot over the cancel, and the call was sent anyway (or, with a serial
    call after it, the step never ended)."""
    h = CapHarness(tmp_path, cap=1)

    def cancel_b_as_a_ends(event) -> None:
        h.events.append(event)
        if isinstance(event, ItemCompleted) and event.item.id == "call_a":
            h.step.cancel_unsent(h.step.entries[1].task_id)  # call_b's wait has just been granted

    h.step._emit = cancel_b_as_a_ends
    for call_id in ("call_a", "call_b", "call_c"):
        h.add(call_id, 0.05)
    outputs = await asyncio.wait_for(h.step.wait(), 5)
    assert outputs[1].output.startswith("aborted by user after") and h.step.entries[1].state is CallState.CANCELLED
    assert h.starts == ["call_a", "call_c"]  # never sent, and its slot went on to call_c


@sync
async def test_a_throttled_call_past_its_deadline_times_out_and_says_it_was_never_sent(tmp_path):
    h = CapHarness(tmp_path, cap=1, deadline=0.5)
    h.add("call_long", 3.0)
    h.add("call_waiting", 0.0)
    outputs = await asyncio.wait_for(h.step.wait(), 10)
    waiting = h.step.entries[1]
    assert waiting.state is CallState.TIMED_OUT
    assert "while it waited for the turn's cap of 1 calls in flight" in outputs[1].output
    assert "never sent" in outputs[1].output and waiting.task_id not in h.transport.sent


def test_toolq_config_shows_the_limits_and_a_bad_one_exits_2_in_one_line(monkeypatch, capsys):
    from toolq.cli.main import main

    monkeypatch.setenv("TOOLQ_TOOL_LIMITS", '{"git.git_log": {"rate_limit": "100/m"}}')
    assert main(["config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["tool_limits"] == {"git.git_log": {"max_concurrency": None, "rate_limit": "100/m"}}
    assert shown["max_parallel_calls"] == 16
    monkeypatch.setenv("TOOLQ_TOOL_LIMITS", '{"git.git_log": {"rate_limit": "100/h"}}')
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("toolq: invalid setting tool_limits (TOOLQ_TOOL_LIMITS): ")
