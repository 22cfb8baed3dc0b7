"""Registry.bind and model-visible specs (contracts 3, 4, 5)."""

import json
import time

import pytest
from pydantic import BaseModel

from toolq.core.calls import CustomPayload, FunctionPayload, ToolCall, ToolName
from toolq.core.catalog import Catalog, tool
from toolq.core.errors import ConfigurationError, Fatal, RespondToModel
from toolq.orchestrator.registry import Registry, StepContext


class SearchArgs(BaseModel):
    query: str
    limit: int = 10


def make_registry() -> Registry:
    cat = Catalog()

    @tool(catalog=cat)
    def search(args: SearchArgs, ctx) -> str:
        "Search the web."
        return args.query

    @tool(name="search", namespace="workspace", catalog=cat, queue="workspace")
    def ws_search(args: SearchArgs, ctx) -> str:
        "Search the workspace."
        return args.query

    @tool(name="apply_patch", grammar={"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}, catalog=cat)
    def apply_patch(text: str, ctx) -> str:
        "Patch files."
        return "ok"

    @tool(name="hidden", deferred=True, catalog=cat)
    def hidden(args: SearchArgs, ctx) -> str:
        "A deferred tool."
        return ""

    return Registry(cat)


STEP = StepContext(turn_id="turn-1", step=0, deadline=time.time() + 60)


def call(name, payload, namespace=None, call_id="call_1"):
    return ToolCall(tool_name=ToolName(namespace=namespace, name=name), call_id=call_id, payload=payload)


def test_unknown_tool_is_recoverable_for_the_model():
    with pytest.raises(RespondToModel) as e:
        make_registry().bind(call("missing", FunctionPayload(arguments="{}")), STEP, 0)
    assert e.value.message == "unsupported call: missing"


def test_unknown_custom_tool_uses_custom_text():
    with pytest.raises(RespondToModel) as e:
        make_registry().bind(call("no_such_custom", CustomPayload(input="x")), STEP, 0)
    assert e.value.message == "unsupported custom tool call: no_such_custom"


def test_unknown_namespace_joins_namespace_and_name_like_codex():
    with pytest.raises(RespondToModel) as e:
        make_registry().bind(call("search", FunctionPayload(arguments="{}"), namespace="no_such_ns"), STEP, 0)
    assert e.value.message == "unsupported call: no_such_nssearch"


def test_payload_kind_mismatch_is_runtime_fatal():
    with pytest.raises(Fatal) as e:
        make_registry().bind(call("apply_patch", FunctionPayload(arguments='{"input": "x"}')), STEP, 0)
    assert str(e.value) == "Fatal error: tool apply_patch invoked with incompatible payload"


def test_namespace_selects_a_different_tool_of_the_same_name():
    reg = make_registry()
    plain = reg.bind(call("search", FunctionPayload(arguments='{"query": "a"}')), STEP, 0)
    spaced = reg.bind(call("search", FunctionPayload(arguments='{"query": "a"}'), namespace="workspace"), STEP, 1)
    assert plain.tool_name == ToolName.plain("search")
    assert spaced.tool_name == ToolName.namespaced("workspace", "search")
    assert plain.spec_digest != spaced.spec_digest


def test_functions_namespace_reaches_top_level_tools():
    inv = make_registry().bind(call("search", FunctionPayload(arguments='{"query": "a"}'), namespace="functions"), STEP, 0)
    assert inv.tool_name == ToolName.plain("search")


def test_bad_json_arguments_respond_to_model():
    with pytest.raises(RespondToModel) as e:
        make_registry().bind(call("search", FunctionPayload(arguments="{not json")), STEP, 0)
    assert e.value.message.startswith("failed to parse function arguments: ")


def test_missing_required_field_names_the_field():
    with pytest.raises(RespondToModel) as e:
        make_registry().bind(call("search", FunctionPayload(arguments='{"limit": 3}')), STEP, 0)
    assert e.value.message == "failed to parse function arguments: missing field `query`"


def test_wrong_type_names_the_field():
    with pytest.raises(RespondToModel) as e:
        make_registry().bind(call("search", FunctionPayload(arguments='{"query": "a", "limit": "ten"}')), STEP, 0)
    assert "`limit`" in e.value.message


def test_unknown_field_is_rejected_by_the_closed_schema():
    with pytest.raises(RespondToModel, match="unknown field"):
        make_registry().bind(call("search", FunctionPayload(arguments='{"query": "a", "limit": 1, "x": 1}')), STEP, 0)


def test_bound_invocation_is_json_serialisable_and_carries_the_step():
    inv = make_registry().bind(call("search", FunctionPayload(arguments='{"query": "a", "limit": null}')), STEP, 4)
    again = type(inv).model_validate(json.loads(inv.model_dump_json()))
    assert again == inv
    assert (inv.turn_id, inv.step, inv.output_index) == ("turn-1", 0, 4)


def test_duplicate_registration_is_a_configuration_error():
    cat = Catalog()

    @tool(catalog=cat)
    def search(args: SearchArgs, ctx) -> str:
        return ""

    with pytest.raises(ConfigurationError, match="duplicate tool"):

        @tool(name="search", catalog=cat)
        def again(args: SearchArgs, ctx) -> str:
            return ""


def test_model_visible_specs_render_each_kind_and_hide_deferred_tools():
    specs = make_registry().model_visible_specs()
    by_type = {}
    for s in specs:
        by_type.setdefault(s["type"], []).append(s)
    fn = by_type["function"][0]
    assert fn["name"] == "search" and fn["strict"] is True
    assert fn["parameters"]["additionalProperties"] is False
    assert set(fn["parameters"]["required"]) == {"query", "limit"}
    assert by_type["custom"][0]["format"]["syntax"] == "lark"
    ns = by_type["namespace"][0]
    assert ns["name"] == "workspace" and ns["tools"][0]["name"] == "search"
    assert all(s.get("name") != "hidden" for s in specs)


def test_a_search_loads_deferred_tools_into_the_specs():
    reg = make_registry()
    loaded = reg.deferred_names([{"type": "function", "name": "hidden"}])
    assert any(s.get("name") == "hidden" for s in reg.model_visible_specs(loaded))
