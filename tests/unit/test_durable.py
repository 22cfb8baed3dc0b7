"""Which calls a resumed turn hands to the barrier again (durable.py)."""

from __future__ import annotations

from toolq.core.calls import ToolName
from toolq.orchestrator.transport.durable import Committed, TurnSettings, unanswered


def call(call_id: str, step: int, index: int) -> Committed:
    return Committed(item={"type": "function_call", "call_id": call_id, "name": "t", "arguments": "{}"},
                     step=step, output_index=index)


def output(call_id: str) -> Committed:
    return Committed(item={"type": "function_call_output", "call_id": call_id, "output": "x"})


def test_only_calls_without_an_output_are_unanswered_grouped_by_step_in_call_order():
    committed = [Committed(item={"type": "message", "role": "user", "content": []}),
                 call("a", 0, 0), call("b", 0, 1), output("a"), output("b"),
                 Committed(item={"type": "message", "role": "assistant", "content": []}, step=1, output_index=0),
                 call("c", 1, 1), call("d", 1, 2), output("d")]
    assert [(s, [c.item["call_id"] for c in cs]) for s, cs in unanswered(committed)] == [(1, ["c"])]


def test_two_calls_sharing_a_call_id_need_two_outputs():
    committed = [call("dup", 0, 0), call("dup", 0, 1), output("dup")]
    ((step, (pending,)),) = unanswered(committed)
    assert (step, pending.output_index) == (0, 1)


def test_settings_keep_loaded_tools_as_tool_names():
    s = TurnSettings(model="m", workspace="/w", deadline=1.0, loaded_tools=[ToolName.namespaced("ns", "x")])
    assert TurnSettings.model_validate_json(s.model_dump_json()).loaded_tools == [ToolName.namespaced("ns", "x")]
