"""`@tool(parameters=...)` without an args model is a function tool, never a custom one (catalog.py)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.responses_schema import schema_errors
from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.catalog import Catalog, call_handler, parse_arguments, tool
from toolq.core.errors import ConfigurationError, RespondToModel
from toolq.orchestrator.registry import Registry, StepContext

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
LARK = {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}


def forecast(args, ctx) -> str:
    """Forecast."""
    return f"{args['city']} for {args.get('days', 1)} days"


def test_parameters_without_an_args_model_make_a_function_tool_with_those_parameters():
    cat = Catalog()
    spec = tool(forecast, parameters=SCHEMA, catalog=cat).tool_spec
    assert (spec.kind, spec.parameters, spec.args_model, spec.strict) == ("function", SCHEMA, None, False)
    rendered = spec.model_spec()
    assert rendered == {"type": "function", "name": "forecast", "description": "Forecast.", "strict": False,
                        "parameters": SCHEMA}
    assert schema_errors(rendered, "FunctionTool") == []


def test_the_handler_gets_the_parsed_arguments_as_a_dict():
    cat = Catalog()
    spec = tool(forecast, parameters=SCHEMA, catalog=cat).tool_spec
    args = parse_arguments(spec, '{"city": "Oslo", "days": 3}')
    assert args == {"city": "Oslo", "days": 3}
    assert asyncio.run(call_handler(spec, args, None)) == "Oslo for 3 days"


def test_arguments_that_break_the_given_schema_are_answered_before_dispatch():
    cat = Catalog()
    tool(forecast, parameters=SCHEMA, catalog=cat)
    registry = Registry(cat)

    def bind(arguments: dict) -> None:
        call = ToolCall(call_id="c1", tool_name=ToolName.plain("forecast"),
                        payload=FunctionPayload(arguments=json.dumps(arguments)))
        registry.bind(call, StepContext("turn-1", 0, time.time() + 60), 0)

    bind({"city": "Oslo"})
    with pytest.raises(RespondToModel, match="missing field `city`"):
        bind({"days": 2})
    with pytest.raises(RespondToModel, match="invalid value at `days`"):
        bind({"city": "Oslo", "days": "two"})


@pytest.mark.parametrize("options, message", [
    ({"grammar": LARK}, "parameters= declares a function tool's JSON arguments; a custom tool takes freeform "
                        "text \\(grammar=\\), so give one or the other"),
    ({"kind": "custom"}, "parameters= declares a function tool.s JSON arguments; a custom tool takes freeform text"),
    ({"parameters": {"type": "object", "properties": {"city": {"type": "text"}}}},
     "parameters= is not a valid JSON Schema: 'text' is not valid under any of the given schemas"),
])
def test_a_declaration_whose_parts_disagree_is_refused_with_one_line(options, message):
    cat = Catalog()
    with pytest.raises(ConfigurationError, match=f"^tool forecast: {message}"):
        tool(forecast, **{"parameters": SCHEMA, **options}, catalog=cat)
    assert len(cat) == 0


def test_parameters_on_a_handler_that_takes_text_are_refused():
    cat = Catalog()

    def note(text: str, ctx) -> str:
        """Note."""
        return text

    with pytest.raises(ConfigurationError, match="^tool note: parameters= makes a function tool, whose handler "
                                                 "gets the arguments as a dict .* annotated str$"):
        tool(note, parameters=SCHEMA, catalog=cat)
    assert len(cat) == 0
