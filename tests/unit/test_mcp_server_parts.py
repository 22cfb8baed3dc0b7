"""`toolq mcp-server`'s pure parts: the fleet's tool specs as MCP tools and a call as a toolq item,
a call's streamed output as progress pieces, outputs as MCP content, `--listen`, the token."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from mcp import types

from toolq.cli.mcp_server import read_token
from toolq.core.errors import ConfigurationError
from toolq.core.states import CallState
from toolq.frontdoors.listening import bearer_matches, parse_listen
from toolq.frontdoors.mcp_server.calls import CallWatch, content_of
from toolq.frontdoors.mcp_server.tasks import TASK_ID
from toolq.frontdoors.mcp_server.tools import offered_tools
from toolq.orchestrator.fleet import new_turn_id
from toolq.orchestrator.turn_events import CommandExecutionView, ItemCompleted, ItemUpdated, TurnStarted

SPECS = [
    {"type": "function", "name": "exec_command", "description": "run", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "custom", "name": "apply_patch", "description": "patch files",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: BEGIN"}},
    {"type": "tool_search", "execution": "client", "description": "find", "parameters": {}},
    {"type": "namespace", "name": "notes", "description": "", "tools": [
        {"type": "function", "name": "file_note", "description": "file", "parameters": None}]},
    {"type": "function", "name": "notes__file_note", "description": "a plain tool named like a namespaced one",
     "parameters": {"type": "object", "properties": {}}},
]


def test_the_fleet_specs_become_mcp_tools():
    tools = offered_tools(SPECS)
    assert list(tools) == ["exec_command", "apply_patch", "notes__file_note"]
    assert tools["exec_command"].tool.inputSchema == SPECS[0]["parameters"]
    assert tools["exec_command"].tool.execution == types.ToolExecution(taskSupport="optional")
    patch = tools["apply_patch"].tool
    assert patch.inputSchema["properties"] == {"input": {"type": "string", "description": "the tool's freeform input"}}
    assert "start: BEGIN" in (patch.description or "")
    noted = tools["notes__file_note"]  # the namespaced tool came first and stays
    assert (noted.namespace, noted.name, noted.tool.inputSchema) == ("notes", "file_note",
                                                                     {"type": "object", "properties": {}})


def test_a_call_becomes_the_item_a_model_would_have_sent():
    tools = offered_tools(SPECS)
    item = tools["exec_command"].call_item({"cmd": "ls"}, "call_1")
    assert item == {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'}
    assert json.loads(tools["notes__file_note"].call_item({}, "c")["arguments"]) == {}
    assert tools["notes__file_note"].call_item({}, "c")["namespace"] == "notes"
    assert tools["apply_patch"].call_item({"input": "*** Begin Patch"}, "c") == {
        "type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "*** Begin Patch"}
    with pytest.raises(ValueError, match="takes its input as text"):
        tools["apply_patch"].call_item({"input": ["no"]}, "c")


def _command(output: str, status: Literal["in_progress", "completed"] = "in_progress") -> CommandExecutionView:
    return CommandExecutionView(id="c", tool="exec_command", status=status, state=CallState.RUNNING, step=1,
                                command="bash -c x", aggregated_output=output)


def test_streamed_output_is_handed_on_in_new_pieces():
    pieces: list[str] = []
    watch = CallWatch(pieces.append)
    watch(TurnStarted(turn_id="t"))
    for output in ("", "one\n", "one\ntwo\n", "one\ntwo\n", "[head]...tail\n"):
        watch(ItemUpdated(item=_command(output)))
    watch(ItemCompleted(item=_command("one\ntwo\nthree\n", "completed")))  # the result is the call's answer
    assert pieces == ["one\n", "two\n", "[head]...tail\n"]
    assert watch.view is not None and watch.view.status == "completed"


def test_outputs_become_mcp_content():
    assert content_of("text") == [types.TextContent(type="text", text="text")]
    parts = [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:image/png;base64,QUJD"},
             {"type": "input_image", "image_url": "https://elsewhere/x.png"}]
    assert content_of(parts) == [types.TextContent(type="text", text="see"),
                                 types.ImageContent(type="image", data="QUJD", mimeType="image/png")]
    assert content_of([]) == [types.TextContent(type="text", text="")]


def test_listen_takes_stdio_or_an_address_of_the_scheme():
    assert parse_listen("stdio", "http") is None
    where = parse_listen("http://127.0.0.1:8765", "http")
    assert where is not None and (where.host, where.port, where.loopback) == ("127.0.0.1", 8765, True)
    assert (listen := parse_listen("http://[::1]:0/mcp", "http", ("", "/mcp"))) is not None and listen.loopback
    assert (listen := parse_listen("http://0.0.0.0:80", "http")) is not None and not listen.loopback
    assert (listen := parse_listen("ws://localhost:1", "ws")) is not None and listen.loopback
    for bad in ("ws://127.0.0.1:1", "http://127.0.0.1", "http://:80", "http://h:99999", "http://h:1/other", "tcp",
                "http://h:1/?token=x"):
        with pytest.raises(ValueError, match="--listen"):
            parse_listen(bad, "http")


def test_the_token_comes_from_its_file_or_the_setting(tmp_path):
    assert read_token(None, None) is None
    assert read_token(None, "from-env") == "from-env"
    (tmp_path / "t").write_text("s3cret\n")
    assert read_token(str(tmp_path / "t"), "from-env") == "s3cret"
    (tmp_path / "two").write_text("a b\n")
    (tmp_path / "empty").write_text("\n")
    for bad in ("two", "missing", "empty"):
        with pytest.raises(ConfigurationError, match="--token-file"):
            read_token(str(tmp_path / bad), None)


def test_a_request_is_authorized_by_its_bearer_token_only():
    assert bearer_matches(["Bearer s3cret"], "s3cret")
    assert bearer_matches(["Basic x", "bearer s3cret "], "s3cret")
    assert not bearer_matches(["Bearer s3cre"], "s3cret")
    assert not bearer_matches(["Basic s3cret"], "s3cret")
    assert not bearer_matches([], "s3cret")


def test_a_task_id_is_a_turn_id():
    assert TASK_ID.fullmatch(new_turn_id())
    for other in ("", "turn-", "turn-../../x", "toolq:turn:turn-0123456789ab", "TURN-0123456789AB"):
        assert not TASK_ID.fullmatch(other)
