"""The pure SSE event decoder, fed real recordings and hand-made bad frames."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from tests.paths import CODEX_FIXTURES, SSE_FIXTURES
from toolq.core.items import (
    CustomToolCallItem,
    FunctionCallItem,
    MalformedItem,
    MessageItem,
    ReasoningItem,
    UnknownItem,
)
from toolq.orchestrator.protocol.events import (
    Completed,
    ErrorEvent,
    EventDecoder,
    Failed,
    Incomplete,
    OutputItemAdded,
    OutputItemDone,
    ReasoningDelta,
    ResponseCreated,
    StreamEvent,
    TextDelta,
    ToolInputDelta,
    Usage,
    iter_sse_data,
)

SSE = SSE_FIXTURES
CODEX = CODEX_FIXTURES


def fixture(path: Path) -> bytes:
    return path.read_bytes()


def decode_all(body: bytes | str) -> tuple[list[StreamEvent], EventDecoder]:
    decoder = EventDecoder()
    events = [e for e in map(decoder.decode, iter_sse_data(body)) if e is not None]
    return events, decoder


def frame(obj: object) -> str:
    return json.dumps(obj)


# (file, SSE events in it, committed items as (type, name, call_id), terminal kind)
RECORDINGS = [
    ("sse-text-message.txt", 19, [(MessageItem, None, None)], "completed"),
    (
        "sse-reasoning-then-function-call.txt",
        20,
        [(ReasoningItem, None, None), (FunctionCallItem, "get_weather", "call_5dp5Uj0Loqn1YcyIpqSq6sLX")],
        "completed",
    ),
    (
        "sse-parallel-function-calls.txt",
        29,
        [
            (FunctionCallItem, "search", "call_GXd80NWdsX8ng3xdeNLeA42o"),
            (FunctionCallItem, "weather", "call_qfdHN9tTntv02109c9RNnGGe"),
        ],
        "completed",
    ),
    (
        "sse-custom-tool-call.txt",
        16,
        [(ReasoningItem, None, None), (CustomToolCallItem, "execute_sql", "call_2GHkSm2Jm0n7vgXsQEryfGmL")],
        "completed",
    ),
    ("sse-response-failed.txt", 4, [], "failed"),
]


@pytest.mark.parametrize("name,n_events,expected,terminal", RECORDINGS, ids=[r[0] for r in RECORDINGS])
def test_every_recording_yields_its_committed_items_and_terminal_event(name, n_events, expected, terminal):
    body = fixture(SSE / name)
    assert len(list(iter_sse_data(body))) == n_events
    events, decoder = decode_all(body)
    done = [e.item for e in events if isinstance(e, OutputItemDone)]
    assert [(type(i), getattr(i, "name", None), getattr(i, "call_id", None)) for i in done] == expected
    assert isinstance(events[0], ResponseCreated) and events[0].response_id.startswith("resp_")
    assert events[-1].kind == terminal
    assert decoder.skipped == {}


def test_recordings_without_a_trailing_blank_line_still_decode_their_last_event():
    body = fixture(SSE / "sse-text-message.txt")
    assert not body.endswith(b"\n\n")  # stored as a Swift literal: the last frame is unterminated
    events, _ = decode_all(body)
    assert isinstance(events[-1], Completed)
    assert events[-1].usage == Usage(input_tokens=114, output_tokens=15, total_tokens=129)


def test_recorded_arguments_and_input_come_from_the_done_item():
    events, _ = decode_all(fixture(SSE / "sse-parallel-function-calls.txt"))
    added = [e.item for e in events if isinstance(e, OutputItemAdded)]
    done = [e.item for e in events if isinstance(e, OutputItemDone)]
    assert [i.arguments for i in added] == ["", ""]
    assert [json.loads(i.arguments) for i in done] == [
        {"query": "Detroit Tigers game time October 6, 2023"},
        {"city": "Detroit"},
    ]
    deltas = "".join(e.delta for e in events if isinstance(e, ToolInputDelta) and e.output_index == 0)
    assert deltas == done[0].arguments

    events, _ = decode_all(fixture(SSE / "sse-custom-tool-call.txt"))
    call = next(e.item for e in events if isinstance(e, OutputItemDone) and isinstance(e.item, CustomToolCallItem))
    assert call.input == "SELECT * FROM users LIMIT 5;"


def test_recorded_failure_gives_nested_error_event_then_failed():
    events, _ = decode_all(fixture(SSE / "sse-response-failed.txt"))
    error, failed = events[-2:]
    assert isinstance(error, ErrorEvent) and isinstance(failed, Failed)
    assert error.code == failed.code == "insufficient_quota"
    assert failed.message.startswith("You exceeded your current quota")


def test_codex_cli_fixture_has_no_output_index_and_no_usage():
    events, decoder = decode_all(fixture(CODEX / "cli_responses_fixture.sse"))
    assert [e.kind for e in events] == ["created", "item_done", "completed"]
    assert events[1].output_index is None
    assert isinstance(events[1].item, MessageItem) and events[1].item.text() == "fixture hello"
    assert events[2] == Completed(response_id="resp1", usage=None)
    assert decoder.skipped == {}


def test_codex_incomplete_fixture_item_done_without_item_is_skipped():
    decoder = EventDecoder()
    for event in json.loads(fixture(CODEX / "incomplete_sse.json")):
        assert decoder.decode(json.dumps(event)) is None
    assert decoder.skipped == {"bad_fields:response.output_item.done": 1}


def test_codex_failed_samples_keep_code_and_message():
    lines = fixture(CODEX / "response_failed_samples.jsonl").decode().splitlines()
    decoded = [EventDecoder().decode(line) for line in lines if line.strip()]
    assert [e.code for e in decoded] == [
        "rate_limit_exceeded",
        "context_length_exceeded",
        "context_length_exceeded",
        "insufficient_quota",
        "cyber_policy",
        "cyber_policy",
        "invalid_prompt",
    ]
    assert "Please try again in 11.054s" in decoded[0].message
    assert decoded[2].message.endswith("try\nagain.")


def test_dispatch_follows_json_type_not_the_event_line():
    body = (
        "event: message\n"
        'data: {"type":"response.output_text.delta","item_id":"m1","output_index":0,"delta":"hi"}\n\n'
        'data: {"type":"response.completed","response":{"id":"r1"}}\n\n'
    )
    events, _ = decode_all(body)
    assert events == [TextDelta(item_id="m1", output_index=0, delta="hi"), Completed(response_id="r1")]


def test_malformed_frames_are_skipped_and_counted_never_fatal():
    decoder = EventDecoder()
    bad = ["", "[DONE]", "{not json", "[1, 2]", '{"delta": "x"}', '{"type": 7}', '{"type": "response.new_thing"}']
    assert [decoder.decode(d) for d in bad] == [None] * len(bad)
    assert decoder.skipped == {
        "empty": 1,
        "done_marker": 1,
        "malformed_json": 1,
        "not_an_object": 1,
        "missing_type": 2,
        "unknown_type:response.new_thing": 1,
    }
    # The decoder keeps working after bad frames.
    assert decoder.decode(frame({"type": "response.created", "response": {"id": "r"}})) == ResponseCreated(
        response_id="r"
    )


def test_known_events_toolq_does_not_use_are_ignored_not_counted_as_skipped():
    decoder = EventDecoder()
    for t in ("response.in_progress", "response.content_part.added", "response.function_call_arguments.done"):
        assert decoder.decode(frame({"type": t})) is None
    assert decoder.skipped == {}
    assert sum(decoder.ignored.values()) == 3


def test_a_delta_with_a_non_string_delta_is_skipped():
    decoder = EventDecoder()
    assert decoder.decode(frame({"type": "response.output_text.delta", "delta": None})) is None
    assert decoder.skipped == {"bad_fields:response.output_text.delta": 1}


def test_done_item_wins_when_call_id_changes_after_added():
    # Recorded with client tool_search (docs/reference/responses-stream.md#ids): ids change between added and done.
    decoder = EventDecoder()
    added = decoder.decode(
        frame({"type": "response.output_item.added", "output_index": 0, "item": {"type": "function_call", "call_id": "call_A", "name": "f", "arguments": ""}})
    )
    done = decoder.decode(
        frame({"type": "response.output_item.done", "output_index": 0, "item": {"type": "function_call", "call_id": "call_B", "name": "f", "arguments": "{}"}})
    )
    assert isinstance(added, OutputItemAdded) and added.item.call_id == "call_A"
    assert isinstance(done, OutputItemDone) and done.item.call_id == "call_B"


def test_unknown_and_malformed_items_are_kept_not_dropped():
    decoder = EventDecoder()
    unknown = decoder.decode(frame({"type": "response.output_item.done", "item": {"type": "hologram", "x": 1}}))
    broken = decoder.decode(frame({"type": "response.output_item.done", "item": {"type": "function_call", "name": "f"}}))
    assert isinstance(unknown.item, UnknownItem) and unknown.item.to_wire() == {"type": "hologram", "x": 1}
    assert isinstance(broken.item, MalformedItem) and "call_id" in broken.item.error


def test_error_event_accepts_nested_and_flat_shapes():
    decoder = EventDecoder()
    nested = decoder.decode(frame({"type": "error", "error": {"code": "rate_limit_exceeded", "message": "slow down"}}))
    flat = decoder.decode(frame({"type": "error", "code": "server_error", "message": "boom", "param": None}))
    assert nested == ErrorEvent(code="rate_limit_exceeded", message="slow down")
    assert flat == ErrorEvent(code="server_error", message="boom")


def test_failed_without_error_object_and_incomplete_reason():
    decoder = EventDecoder()
    assert decoder.decode(frame({"type": "response.failed", "response": {"id": "r"}})) == Failed()
    incomplete = {"type": "response.incomplete", "response": {"incomplete_details": {"reason": "max_output_tokens"}}}
    assert decoder.decode(frame(incomplete)) == Incomplete(reason="max_output_tokens")


def test_tool_input_deltas_cover_function_arguments_and_custom_input():
    decoder = EventDecoder()
    fn = decoder.decode(frame({"type": "response.function_call_arguments.delta", "item_id": "fc", "output_index": 1, "delta": "{"}))
    custom = decoder.decode(
        frame({"type": "response.custom_tool_call_input.delta", "item_id": "ctc", "call_id": "c", "output_index": 2, "delta": "*"})
    )
    reasoning = decoder.decode(frame({"type": "response.reasoning_summary_text.delta", "item_id": "rs", "delta": "think"}))
    assert fn == ToolInputDelta(item_id="fc", output_index=1, delta="{")
    assert custom == ToolInputDelta(item_id="ctc", call_id="c", output_index=2, delta="*")
    assert reasoning == ReasoningDelta(item_id="rs", delta="think")


def test_usage_reads_nested_details_and_sums_over_a_turn():
    wire = {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 40},
        "output_tokens": 20,
        "output_tokens_details": {"reasoning_tokens": 8},
        "total_tokens": 120,
    }
    one = Usage.from_wire(wire)
    assert one == Usage(input_tokens=100, cached_input_tokens=40, output_tokens=20, reasoning_output_tokens=8, total_tokens=120)
    assert one + Usage.from_wire({"input_tokens": 1, "total_tokens": 1}) == Usage(
        input_tokens=101, cached_input_tokens=40, output_tokens=20, reasoning_output_tokens=8, total_tokens=121
    )
    assert Usage.from_wire(None) is None


def test_decoded_events_round_trip_through_the_stream_event_union():
    events, _ = decode_all(fixture(SSE / "sse-reasoning-then-function-call.txt"))
    adapter = TypeAdapter(StreamEvent)
    for event in events:
        again = adapter.validate_python(event.model_dump())
        assert type(again) is type(event) and again == event
