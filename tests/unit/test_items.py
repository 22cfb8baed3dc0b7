"""Wire models: lenient decoding, round trips, every real recording (contracts 1, 6)."""

import json

import pytest

from tests.paths import CODEX_FIXTURES, SSE_FIXTURES
from toolq.core.items import (
    CustomToolCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    HostedToolItem,
    InputImage,
    MalformedItem,
    MessageItem,
    ReasoningItem,
    UnknownItem,
    decode_item,
    is_api_item,
)


def done_items(path):
    """Items of every `response.output_item.done` frame in a recorded SSE body."""
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("data:"):
            try:
                obj = json.loads(line[5:].strip())
            except json.JSONDecodeError:
                continue
            if obj.get("type") == "response.output_item.done" and "item" in obj:
                out.append(obj["item"])
    return out


def recordings():
    return sorted(SSE_FIXTURES.glob("*.txt")) + [CODEX_FIXTURES / "cli_responses_fixture.sse"]


def test_every_recorded_item_decodes_and_reencodes_unchanged():
    seen = set()
    for path in recordings():
        for raw in done_items(path):
            item = decode_item(raw)
            assert not isinstance(item, (UnknownItem, MalformedItem)), (path.name, raw)
            assert item.to_wire() == {k: v for k, v in raw.items() if v is not None}, path.name
            seen.add(raw["type"])
    assert {"message", "reasoning", "function_call", "custom_tool_call"} <= seen


def test_unknown_item_type_keeps_its_json_and_is_not_replayed():
    item = decode_item({"type": "hologram_call", "id": "h1", "beam": {"x": 1}})
    assert isinstance(item, UnknownItem)
    assert item.to_wire() == {"type": "hologram_call", "id": "h1", "beam": {"x": 1}}
    assert not is_api_item(item)


def test_malformed_known_item_never_raises():
    item = decode_item({"type": "function_call", "name": "f", "arguments": "{}"})  # no call_id
    assert isinstance(item, MalformedItem)
    assert "call_id" in item.error


def test_namespace_and_server_id_round_trip():
    raw = {"type": "function_call", "id": "fc_1", "namespace": "mcp__cal__", "name": "create_event",
           "arguments": "{}", "call_id": "call_9", "status": "completed"}
    item = decode_item(raw)
    assert isinstance(item, FunctionCallItem) and item.namespace == "mcp__cal__"
    assert item.to_wire() == raw


def test_extra_fields_are_kept():
    raw = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c", "name": "n", "input": "x", "caller": {"type": "direct"}}
    item = decode_item(raw)
    assert isinstance(item, CustomToolCallItem)
    assert item.to_wire()["caller"] == {"type": "direct"}


def test_output_is_a_string_or_content_parts():
    text = decode_item({"type": "function_call_output", "call_id": "c", "output": "done"})
    parts = decode_item({"type": "function_call_output", "call_id": "c",
                         "output": [{"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "high"}]})
    assert isinstance(text, FunctionCallOutputItem) and text.output == "done"
    assert isinstance(parts.output[0], InputImage)
    assert parts.to_wire()["output"][0]["detail"] == "high"


def test_hosted_items_are_recorded_but_are_not_unknown():
    item = decode_item({"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}})
    assert isinstance(item, HostedToolItem) and is_api_item(item)


def test_a_role_only_message_is_a_message():
    item = decode_item({"role": "user", "content": "hello"})
    assert isinstance(item, MessageItem) and item.text() == "hello"


@pytest.mark.parametrize("raw", [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}])
def test_reasoning_keeps_encrypted_content(raw):
    item = decode_item(raw)
    assert isinstance(item, ReasoningItem) and item.to_wire() == raw
