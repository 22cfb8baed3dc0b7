"""The output-schema check the host makes instead of the SDK's per-call `jsonschema.validate`."""

import pytest
from mcp import types

from toolq.workers.mcp.checks import OutputCheck, SchemaError, output_check

FORECAST = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}},
            "required": ["city", "celsius"]}


def result(structured, *, is_error=False):
    return types.CallToolResult(content=[types.TextContent(type="text", text="x")], structuredContent=structured,
                                isError=is_error)


def test_matching_structured_content_passes():
    assert OutputCheck("forecast", FORECAST).problem(result({"city": "Oslo", "celsius": 21.5})) is None


def test_content_that_breaks_the_schema_is_named():
    problem = OutputCheck("forecast", FORECAST).problem(result({"city": "Oslo", "celsius": "warm"}))
    assert problem == "invalid structured content returned by tool forecast: 'warm' is not of type 'number'"


def test_a_schema_without_structured_content_is_a_problem():
    assert "did not return structured content" in OutputCheck("forecast", FORECAST).problem(result(None))


def test_an_error_result_is_not_checked():
    assert OutputCheck("forecast", FORECAST).problem(result(None, is_error=True)) is None


def test_a_ref_resolves_within_the_schema_and_never_by_a_fetch():
    local = {"$defs": {"c": {"type": "number"}}, "type": "object", "properties": {"celsius": {"$ref": "#/$defs/c"}}}
    assert OutputCheck("t", local).problem(result({"celsius": 1})) is None
    assert "not of type 'number'" in OutputCheck("t", local).problem(result({"celsius": "x"}))
    remote = {"type": "object", "properties": {"celsius": {"$ref": "https://example.invalid/c.json"}}}
    assert "does not resolve" in OutputCheck("t", remote).problem(result({"celsius": 1}))


def test_an_invalid_schema_is_refused_when_listed_and_no_schema_means_no_check():
    with pytest.raises(SchemaError):
        OutputCheck("t", {"type": "no-such-type"})
    assert output_check(types.Tool(name="t", inputSchema={"type": "object"})) is None
    assert output_check(types.Tool(name="t", inputSchema={"type": "object"}, outputSchema=FORECAST)) is not None
