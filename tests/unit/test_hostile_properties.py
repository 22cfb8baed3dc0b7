"""Property tests: no input from the model or the stream raises out of decoder, router, registry
or history, every request's input is paired, and every call gets one output (issue 13, item 5).

The examples are hostile on purpose: invalid UTF-8, lone surrogates (raw and escaped), JSON nested
past every limit, events over the size bound, random event and item types. The default profile
is small and derandomized so the suite stays fast and repeatable; `HYPOTHESIS_PROFILE=deep` runs
many more random examples.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from toolq.core.calls import ToolResult, output_item
from toolq.core.catalog import Catalog, ToolContext, parse_arguments, tool
from toolq.core.errors import Fatal, RespondToModel
from toolq.core.items import is_call
from toolq.orchestrator.history import History, pairing_problems
from toolq.orchestrator.protocol.events import EventDecoder, iter_sse_data
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.router import build_tool_call

settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

BOUND = 2048
"""The event size bound in these tests: small, so huge events are cheap to make."""

# --- strategies ----------------------------------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udcff", "\udfff", "\ud83d"])
hostile_text = st.lists(st.one_of(st.text(max_size=8), SURROGATES), max_size=5).map("".join)
leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), hostile_text)
json_values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(hostile_text, kids, max_size=3), max_leaves=12)
depths = st.sampled_from([1, 127, 128, 129, 300, 1_000, 20_000])


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def dumps(value: Any, ascii_only: bool) -> str:
    # ensure_ascii=True writes lone surrogates as `\ud800` escapes, False writes them raw.
    return json.dumps(value, ensure_ascii=ascii_only)


arguments_text = st.one_of(
    st.builds(dumps, st.dictionaries(st.sampled_from(["text", "n", "tree", "cmd", "x"]), json_values, max_size=3),
              st.booleans()),
    st.builds(lambda d: '{"text": ' + nested(d) + "}", depths),
    st.builds(lambda d: '{"tree": ' + nested(d) + "}", depths),
    st.builds(lambda d: nested(d, '{"a":', "}").replace("}", "1}", 1), depths),
    hostile_text,
)

NAMES = ["echo", "tree", "freeform", "tool_search", "no_such_tool"]
call_ids = st.sampled_from(["c1", "c2", "c3", "c\ud800", ""])


@st.composite
def items(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["function_call", "custom_tool_call", "tool_search_call", "local_shell_call",
                                 "message", "reasoning", "function_call_output", "web_search_call", "mystery"]))
    call_id = draw(call_ids)
    name = draw(st.sampled_from(NAMES))
    if kind == "function_call":
        item = {"type": kind, "call_id": call_id, "name": name, "arguments": draw(arguments_text)}
        if draw(st.booleans()):
            item["namespace"] = draw(st.sampled_from(["functions", "ns", "\udcff"]))
    elif kind == "custom_tool_call":
        item = {"type": kind, "call_id": call_id, "name": name, "input": draw(hostile_text)}
    elif kind == "tool_search_call":
        item = {"type": kind, "call_id": call_id, "execution": draw(st.sampled_from(["client", "server"])),
                "arguments": draw(st.one_of(json_values, st.fixed_dictionaries({"query": hostile_text})))}
    elif kind == "local_shell_call":
        item = {"type": kind, "call_id": call_id, "action": {"command": ["ls"]}}
    elif kind == "message":
        item = {"type": kind, "role": "assistant", "content": [{"type": "output_text", "text": draw(hostile_text)}]}
    elif kind == "function_call_output":
        item = {"type": kind, "call_id": call_id, "output": draw(hostile_text)}
    else:
        item = {"type": kind, "id": "x", "payload": draw(json_values)}
    if draw(st.booleans()):
        del_key = draw(st.sampled_from(sorted(item)))
        if del_key != "type":
            item.pop(del_key)  # a known type with a missing field: a MalformedItem
    return item


def frame(event: dict[str, Any], ascii_only: bool = True) -> bytes:
    return f"event: {event.get('type')}\ndata: {dumps(event, ascii_only)}\n\n".encode("utf-8", "surrogatepass")


EVENT_TYPES = ["response.created", "response.output_item.added", "response.output_item.done",
               "response.output_text.delta", "response.function_call_arguments.delta", "response.completed",
               "response.failed", "response.incomplete", "error", "response.in_progress", "nonsense", 7, None]


@st.composite
def sse_frames(draw: Any) -> bytes:
    shape = draw(st.sampled_from(["event", "item", "huge", "deep", "bytes", "not_json"]))
    if shape == "event":
        event = {"type": draw(st.sampled_from(EVENT_TYPES)), "delta": draw(hostile_text),
                 "response": draw(json_values), "output_index": draw(st.one_of(st.integers(), hostile_text))}
        return frame(event, draw(st.booleans()))
    if shape == "item":
        return frame({"type": "response.output_item.done", "output_index": draw(st.integers(0, 5)),
                      "item": draw(items())}, draw(st.booleans()))
    if shape == "huge":
        event = {"type": draw(st.sampled_from(EVENT_TYPES)), "pad": "x" * draw(st.integers(BOUND - 64, 4 * BOUND))}
        return frame(event)
    if shape == "deep":
        return b'data: {"type": "response.output_item.done", "item": ' + nested(draw(depths)).encode() + b"}\n\n"
    if shape == "bytes":
        return b"data: " + draw(st.binary(max_size=64)) + b"\n\n"
    return b"data: " + draw(hostile_text).encode("utf-8", "surrogatepass") + b"\n\n"


# --- a catalog of the three kinds, one with a recursive schema -----------------------------------

CATALOG = Catalog()


class EchoArgs(BaseModel):
    text: str
    n: int | None = None


@tool(catalog=CATALOG)
def echo(args: EchoArgs, ctx: ToolContext) -> str:
    """Echo."""
    return args.text


TREE = {"type": "object", "$defs": {"node": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "properties": {"tree": {"$ref": "#/$defs/node"}}}


@tool(catalog=CATALOG, parameters=TREE)
def tree(args: dict, ctx: ToolContext) -> str:
    """A tool whose schema recurses: validation walks as deep as the arguments go."""
    return "ok"


@tool(catalog=CATALOG)
def freeform(text: str, ctx: ToolContext) -> str:
    """Freeform."""
    return text


REGISTRY = Registry(CATALOG)
STEP = StepContext("turn-prop", 0, deadline=4e9)


def answer(item: Any, output_index: int) -> Any:
    """What the barrier does with one committed item: its one output, or None if it is no call.
    Only the model-visible error classes may come out of router, registry and argument parsing."""
    try:
        call = build_tool_call(item)
        if call is None:
            return None
        inv = REGISTRY.bind(call, STEP, output_index)
        spec = REGISTRY.lookup(call.tool_name)
        if inv.payload.kind == "function":
            parse_arguments(spec, inv.payload.arguments)  # what the worker does first
        text, kind = "ran", call.payload.kind
    except (RespondToModel, Fatal) as e:
        text = str(e)
        kind = {"custom_tool_call": "custom", "tool_search_call": "tool_search"}.get(item.type, "function")
    call_id = getattr(item, "call_id", None) or getattr(item, "id", None) or ""
    result = ToolResult(call_id=call_id, output=text, status="completed")
    return output_item(kind, call_id, result.output, tools=result.tools)


def sendable(body: list[dict[str, Any]]) -> None:
    """What httpx does with a request body: it must not raise."""
    json.dumps(body, ensure_ascii=False).encode("utf-8")


# --- properties ----------------------------------------------------------------------------------


@given(st.lists(sse_frames(), max_size=6), st.integers(1, 64))
def test_random_sse_frames_never_raise_and_decoded_items_can_be_sent_back(frames, chunk):
    body = b"".join(frames)
    decoder = EventDecoder()
    from toolq.orchestrator.protocol.sse import iter_frames

    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    for data in iter_frames(pieces, BOUND):
        event = decoder.decode(data)
        if event is not None and event.kind in ("item_added", "item_done"):
            sendable([event.item.to_wire()])
    assert sum(decoder.skipped.values()) + sum(decoder.ignored.values()) <= len(frames)


@given(st.lists(items(), max_size=8))
def test_random_items_through_router_registry_and_history_stay_paired(raw_items):
    decoder = EventDecoder()
    history = History([{"type": "message", "role": "user", "content": "go"}])
    outputs, calls = [], 0
    for index, raw in enumerate(raw_items):
        # In through the stream, as a real item would come: the decoder is the boundary.
        (data,) = iter_sse_data(frame({"type": "response.output_item.done", "item": raw}, ascii_only=False))
        event = decoder.decode(data)
        if event is None:
            continue
        history.record(event.item)
        out = answer(event.item, index)
        if out is not None:
            outputs.append(out)
        calls += is_call(event.item)
    history.record(*outputs)
    body = history.for_prompt()
    assert pairing_problems(body) == []
    sendable(body)
    assert len(outputs) <= calls + sum(1 for i in raw_items if i["type"] == "tool_search_call")


@given(st.lists(st.tuples(st.sampled_from(["call", "output", "custom", "custom_output", "search", "message"]),
                          call_ids), max_size=12))
def test_the_pairing_normaliser_pairs_any_sequence(sequence):
    raw = []
    for kind, call_id in sequence:
        raw.append({
            "call": {"type": "function_call", "call_id": call_id, "name": "echo", "arguments": "{}"},
            "output": {"type": "function_call_output", "call_id": call_id, "output": "o"},
            "custom": {"type": "custom_tool_call", "call_id": call_id, "name": "freeform", "input": "i"},
            "custom_output": {"type": "custom_tool_call_output", "call_id": call_id, "output": "o"},
            "search": {"type": "tool_search_call", "call_id": call_id, "execution": "client", "arguments": {}},
            "message": {"type": "message", "role": "assistant", "content": "m"},
        }[kind])
    body = History(raw).for_prompt()
    assert pairing_problems(body) == []
    # The normaliser never drops a call (it answers it), only orphan outputs.
    call_types = ("function_call", "custom_tool_call", "tool_search_call")
    assert [i for i in body if i["type"] in call_types] == [i for i in raw if i["type"] in call_types]


@given(st.one_of(hostile_text, st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": hostile_text}),
                                        max_size=3)))
def test_every_tool_result_is_valid_utf8(output):
    result = ToolResult(call_id="c", output=output)
    result.output_text().encode("utf-8")
    again = ToolResult.model_validate(json.loads(result.model_dump_json()))  # across the queue
    sendable([output_item("function", "c", again.output).to_wire()])


def test_nan_infinity_and_overflowing_numbers_are_refused_at_argument_parsing():
    """Issue 24: Python's json takes them and they reached the tools (an OverflowError, a session
    host that hung up); serde_json, which Codex parses with, refuses them, and so does toolq."""
    from toolq.core.catalog import load_arguments

    for raw in ('{"yield_time_ms": NaN}', '{"x": Infinity}', '{"x": [-Infinity]}', '{"session_id": 1e400}',
                '{"x": -1e309}'):
        try:
            load_arguments(raw)
        except RespondToModel as e:
            assert "failed to parse function arguments" in str(e)
        else:
            raise AssertionError(f"{raw} was accepted")
    assert load_arguments('{"x": 1e308, "y": -2.5, "z": 10000000000000000000000}')["z"] == 10**22
