"""ResponseItem -> ToolCall (contracts 1, 3, 4)."""

import pytest

from toolq.core.calls import CustomPayload, FunctionPayload, ToolName, ToolSearchPayload
from toolq.core.errors import RespondToModel
from toolq.core.items import decode_item
from toolq.orchestrator.router import build_tool_call


def test_message_that_looks_like_json_is_not_a_call():
    item = decode_item(
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": '{"name":"exec_command","arguments":{"cmd":"touch x"}}'}],
        }
    )
    assert build_tool_call(item) is None


def test_namespace_is_part_of_registry_identity():
    item = decode_item(
        {
            "type": "function_call",
            "namespace": "workspace",
            "name": "search",
            "arguments": '{"query":"ToolRouter"}',
            "call_id": "call_1",
        }
    )
    call = build_tool_call(item)
    assert call.tool_name == ToolName.namespaced("workspace", "search")
    assert call.tool_name != ToolName.plain("search")
    assert call.payload == FunctionPayload(arguments='{"query":"ToolRouter"}')


def test_function_arguments_stay_a_raw_string():
    call = build_tool_call(decode_item({"type": "function_call", "name": "f", "arguments": "{not json", "call_id": "c"}))
    assert call.payload.arguments == "{not json"


def test_custom_tool_call_becomes_custom_payload():
    item = decode_item({"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch", "call_id": "c2"})
    call = build_tool_call(item)
    assert call.payload == CustomPayload(input="*** Begin Patch")
    assert call.call_id == "c2"


def test_client_tool_search_is_parsed_into_search_params():
    item = decode_item(
        {"type": "tool_search_call", "execution": "client", "call_id": "s1", "arguments": {"query": "calendar", "limit": 3}}
    )
    call = build_tool_call(item)
    assert call.tool_name == ToolName.plain("tool_search")
    assert call.payload == ToolSearchPayload(query="calendar", limit=3)


def test_unparseable_tool_search_arguments_respond_to_model():
    item = decode_item({"type": "tool_search_call", "execution": "client", "call_id": "s1", "arguments": {"q": 1}})
    with pytest.raises(RespondToModel, match="failed to parse tool_search arguments"):
        build_tool_call(item)


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "tool_search_call", "execution": "server", "call_id": "s1", "arguments": {"query": "x"}},
        {"type": "reasoning", "summary": []},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
        {"type": "brand_new_item", "payload": 1},
    ],
)
def test_non_call_items_route_to_none(raw):
    assert build_tool_call(decode_item(raw)) is None
