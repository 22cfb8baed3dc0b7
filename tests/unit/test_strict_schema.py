"""Strict schemas for argument names that are also JSON Schema keywords (toolq/core/catalog.py).

The schema is walked by keyword: the keys of `properties` (and `$defs`) are names, and values
such as `default` or `examples` are data, so none of them may be stripped or rewritten.
"""

from __future__ import annotations

import json
import time
from typing import Any

from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from tests.responses_schema import schema_errors
from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.catalog import Catalog, ToolContext, parse_arguments, tool
from toolq.orchestrator.model_client import build_request
from toolq.orchestrator.registry import Registry, StepContext

KEYWORDS = ["title", "description", "default", "type", "properties", "items", "required"]


class Attendee(BaseModel):
    """Someone invited."""

    title: str = Field(description="How to address them.")
    type: str = "person"
    required: bool = True


class Event(BaseModel):
    """A calendar event whose argument names are JSON Schema keywords."""

    title: str = Field(title="Event title", description="Shown in the calendar.")
    description: str | None = None
    default: int = 0
    type: str = Field(default="meeting", examples=[{"title": "not a schema"}])
    properties: Attendee | None = Field(default=Attendee(title="kept", type="data"))
    items: list[Attendee] = []
    required: Attendee | None = None


def create_event_spec(cat: Catalog):
    @tool(namespace="calendar", catalog=cat)
    def create_event(args: Event, ctx: ToolContext) -> str:
        """Create an event."""
        return args.title

    return create_event.tool_spec


def strict_problems(schema: Any, where: str = "") -> list[str]:
    """Where a schema breaks the strict-mode rules: every object closed, every property required."""
    if isinstance(schema, list):
        return [p for i, s in enumerate(schema) for p in strict_problems(s, f"{where}/{i}")]
    if not isinstance(schema, dict):
        return []
    problems = []
    if schema.get("type") == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is not False:
            problems.append(f"{where}: not closed")
        if schema.get("required") != list(props):
            problems.append(f"{where}: required {schema.get('required')} != {list(props)}")
        for name, sub in props.items():
            problems += strict_problems(sub, f"{where}/properties/{name}")
    for key in ("$defs", "definitions"):
        for name, sub in schema.get(key, {}).items():
            problems += strict_problems(sub, f"{where}/{key}/{name}")
    for key in ("anyOf", "oneOf", "allOf", "items", "prefixItems"):
        if key in schema:
            problems += strict_problems(schema[key], f"{where}/{key}")
    return problems


def test_arguments_named_like_keywords_are_kept_and_required():
    schema = create_event_spec(Catalog()).parameters
    assert list(schema["properties"]) == KEYWORDS
    assert schema["required"] == KEYWORDS
    assert schema["additionalProperties"] is False
    assert schema["properties"]["title"] == {"type": "string", "description": "Shown in the calendar."}
    assert schema["properties"]["default"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert schema["properties"]["items"] == {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/Attendee"}},
                                                      {"type": "null"}]}
    Draft202012Validator.check_schema(schema)
    assert strict_problems(schema) == []


def test_nested_models_in_defs_keep_their_keyword_named_fields():
    schema = create_event_spec(Catalog()).parameters
    attendee = schema["$defs"]["Attendee"]
    assert list(attendee["properties"]) == ["title", "type", "required"]
    assert attendee["required"] == ["title", "type", "required"]
    assert attendee["description"] == "Someone invited."
    assert "title" not in attendee  # the model's own annotation title is what goes
    assert schema["properties"]["required"] == {"anyOf": [{"$ref": "#/$defs/Attendee"}, {"type": "null"}]}


def test_annotation_titles_go_but_data_that_looks_like_a_schema_stays():
    schema = create_event_spec(Catalog()).parameters
    assert "title" not in schema  # the model's title
    assert all("title" not in sub for sub in schema["properties"].values())  # Field(title=...) and pydantic's
    # `default` and `examples` are values, not schemas: nothing inside them is rewritten
    assert schema["properties"]["properties"]["default"] == {"title": "kept", "type": "data", "required": True}
    assert schema["properties"]["type"]["anyOf"][0]["examples"] == [{"title": "not a schema"}]


def test_a_call_using_every_keyword_named_argument_is_accepted_and_parsed():
    cat = Catalog()
    spec = create_event_spec(cat)
    arguments = {"title": "t", "description": None, "default": 2, "type": "party", "properties": {"title": "Ms", "type": "guest", "required": True},
                 "items": [{"title": "Dr", "type": "person", "required": False}], "required": None}
    call = ToolCall(call_id="call_1", tool_name=ToolName.namespaced("calendar", "create_event"),
                    payload=FunctionPayload(arguments=json.dumps(arguments)))
    inv = Registry(cat).bind(call, StepContext("turn-1", 0, time.time() + 60), 0)
    args = parse_arguments(spec, inv.payload.arguments)
    assert args.title == "t" and args.items[0].title == "Dr" and args.properties.type == "guest"
    assert args.description is None and args.required is None  # null: the default


def test_the_rendered_tools_array_is_valid_for_the_official_schema():
    cat = Catalog()
    create_event_spec(cat)
    tools = Registry(cat).model_visible_specs()
    assert tools[0]["type"] == "namespace" and tools[0]["tools"][0]["strict"] is True
    body = build_request("gpt-5.5", [{"type": "message", "role": "user", "content": "plan it"}], tools)
    assert schema_errors(body) == []
    assert schema_errors(tools[0], "NamespaceToolParam") == []
    assert schema_errors(tools[0]["tools"][0], "FunctionTool") == []


def test_every_strict_builtin_schema_follows_the_strict_rules():
    from toolq.workers.loader import load_catalog

    strict = [spec for spec in load_catalog() if spec.kind == "function" and spec.strict]
    assert strict, "no strict built-in tools to check"
    for spec in strict:
        assert strict_problems(spec.parameters) == [], spec.name


def test_every_builtin_declaration_is_a_valid_json_schema():
    """Start-up no longer checks toolq's own `parameters=` (catalog.CHECKED_PACKAGES): this does."""
    from toolq.workers.loader import load_catalog

    specs = [s for s in load_catalog(()) if s.parameters is not None]
    assert {str(s.tool_name) for s in specs} >= {"exec_command", "write_stdin", "read_file"}
    for spec in specs:
        Draft202012Validator.check_schema(spec.parameters)
