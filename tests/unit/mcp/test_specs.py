"""MCP tools as namespaced `ToolSpec`s: strict only where the schema allows, digests from the listing."""

from __future__ import annotations

import json

import pytest

from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.catalog import Catalog, ToolSpec
from toolq.core.errors import RespondToModel
from toolq.core.mcp_specs import McpToolRecord, strict_allowed, tool_spec, unusable
from toolq.orchestrator.registry import Registry, StepContext

OPEN = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}
CLOSED = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
          "additionalProperties": False}


def record(server="a", name="search", schema=None, **kw) -> McpToolRecord:
    return McpToolRecord(server=server, name=name, description="d", input_schema=schema or OPEN, timeout=60, **kw)


def mcp_tool_specs(records: list[McpToolRecord]) -> list[ToolSpec]:
    return [tool_spec(r) for r in records]


def test_strict_only_when_the_schema_is_already_in_the_strict_subset():
    assert strict_allowed(CLOSED)
    assert not strict_allowed(OPEN)  # optional `limit`, open object
    nested = {**CLOSED, "properties": {"q": {"type": "object", "properties": {"x": {"type": "string"}}}},
              "required": ["q"]}
    assert not strict_allowed(nested)
    assert tool_spec(record(schema=CLOSED)).strict and not tool_spec(record()).strict


def test_the_spec_is_a_namespaced_function_with_the_listed_schema_on_the_servers_queue():
    spec = tool_spec(record())
    assert spec.tool_name == ToolName.namespaced("a", "search")
    assert spec.model_spec()["parameters"] == OPEN and spec.queue == "mcp.a"


def test_the_digest_follows_the_listed_schema():
    assert tool_spec(record()).digest() == tool_spec(record()).digest()
    changed = {**OPEN, "properties": {**OPEN["properties"], "extra": {"type": "string"}}}
    assert tool_spec(record(schema=changed)).digest() != tool_spec(record()).digest()


def test_two_servers_and_a_plain_tool_named_search_are_three_tools():
    plain = ToolSpec(name="search", parameters=CLOSED, strict=True)
    registry = Registry(Catalog([plain]))
    registry.add(mcp_tool_specs([record("a"), record("b")]))
    step = StepContext(turn_id="t", step=0, deadline=1e12)
    bound = [registry.bind(ToolCall(tool_name=ToolName(namespace=ns, name="search"), call_id=f"c{i}",
                                    payload=FunctionPayload(arguments='{"query": "x"}')), step, i)
             for i, ns in enumerate([None, "a", "b"])]
    assert len({(b.tool_name, b.spec_digest) for b in bound}) == 3
    specs = registry.model_visible_specs()
    assert [s.get("name") for s in specs] == ["search", "a", "b"]
    assert [s["type"] for s in specs] == ["function", "namespace", "namespace"]


def test_the_registry_checks_mcp_arguments_against_the_listed_schema():
    registry = Registry(Catalog())
    registry.add(mcp_tool_specs([record()]))
    call = ToolCall(tool_name=ToolName.namespaced("a", "search"), call_id="c",
                    payload=FunctionPayload(arguments=json.dumps({"limit": 3})))
    with pytest.raises(RespondToModel, match="missing field `query`"):
        registry.bind(call, StepContext(turn_id="t", step=0, deadline=1e12), 0)


@pytest.mark.parametrize("name, schema, says", [
    ("has.dot", OPEN, "not a valid function name"),
    ("ok", {"type": "string"}, "not an object schema"),
    ("ok", {"type": "object", "properties": {"x": {"type": 3}}}, "not valid JSON Schema"),
])
def test_a_tool_the_model_cannot_be_offered_is_skipped_with_the_reason(name, schema, says):
    assert says in (unusable(name, schema) or "")
    assert unusable("ok", OPEN) is None


def test_a_deferred_server_is_found_by_tool_search_in_its_namespace():
    from toolq.core.calls import ToolSearchPayload
    from toolq.workers.tools.tool_search import search_catalog

    registry = Registry(Catalog())
    registry.add(mcp_tool_specs([record("a", "fetch_issue", deferred=True), record("a", "close_pr", deferred=True)]))
    assert registry.model_visible_specs() == []
    found = search_catalog(registry.catalog, ToolSearchPayload(query="fetch issue"))
    assert [t["name"] for t in found] == ["a"] and [t["name"] for t in found[0]["tools"]] == ["fetch_issue"]
    loaded = registry.deferred_names(found)
    assert [s["name"] for s in registry.model_visible_specs(loaded)] == ["a"]


def test_a_namespace_is_replaced_whole_and_other_tools_stay():
    plain = ToolSpec(name="search", parameters=CLOSED, strict=True)
    catalog = Catalog([plain, *mcp_tool_specs([record("a", "one"), record("a", "two"), record("b", "one")])])
    catalog.replace_namespace("a", [tool_spec(record("a", "three"))])
    assert sorted(str(s.tool_name) for s in catalog) == ["a.three", "b.one", "search"]


def test_the_registry_replaces_a_namespace_with_its_validators():
    registry = Registry(Catalog())
    registry.add(mcp_tool_specs([record("a")]))
    changed = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    registry.replace_namespace("a", mcp_tool_specs([record("a", schema=changed)]))
    step = StepContext(turn_id="t", step=0, deadline=1e12)
    call = ToolCall(tool_name=ToolName.namespaced("a", "search"), call_id="c",
                    payload=FunctionPayload(arguments='{"query": "x"}'))
    with pytest.raises(RespondToModel, match="missing field `q`"):
        registry.bind(call, step, 0)
    registry.replace_namespace("a", [])
    with pytest.raises(RespondToModel, match="unsupported call: asearch"):
        registry.bind(call, step, 0)
