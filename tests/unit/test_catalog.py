"""The `@tool` decorator, strict schemas, declaration digests and `parse_arguments` (toolq/core/catalog.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import DEFAULT_QUEUE, Catalog, ToolContext, ToolSpec, call_handler, parse_arguments, tool
from toolq.core.errors import ConfigurationError, RespondToModel

LARK = {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}


class SearchArgs(BaseModel):
    query: str = Field(description="What to look for.")
    limit: int = 10
    path: str | None = None


class Range(BaseModel):
    start: int
    end: int | None = None


class Nested(BaseModel):
    ranges: list[Range]
    mode: Literal["fast", "slow"] = "fast"


def ctx() -> ToolContext:
    inv = ToolInvocation(turn_id="turn-1", step=0, output_index=0, call_id="call_1",
                         tool_name=ToolName.plain("t"), payload=FunctionPayload(arguments="{}"),
                         deadline=time.time() + 60)
    return ToolContext(invocation=inv, workspace=Path("."))


# --- the decorator -----------------------------------------------------------------------------


def test_name_comes_from_the_function_and_description_from_its_docstring():
    cat = Catalog()

    @tool(catalog=cat)
    def grep_notes(args: SearchArgs, ctx: ToolContext) -> str:
        """Searches the notes.

        Returns one line per match.
        """
        return args.query

    spec = cat.get(ToolName.plain("grep_notes"))
    assert spec is grep_notes.tool_spec
    assert spec.description == "Searches the notes.\n\nReturns one line per match."
    assert (spec.kind, spec.queue, spec.timeout, spec.parallel, spec.idempotent, spec.deferred) == (
        "function", DEFAULT_QUEUE, 60.0, True, False, False)
    assert spec.args_model is SearchArgs
    # the decorated function is still the plain function
    assert grep_notes(SearchArgs(query="x"), None) == "x"


def test_explicit_name_namespace_and_routing_are_kept():
    cat = Catalog()

    @tool(name="search", namespace="workspace", description="Given text.", parallel=False, queue="search",
          timeout=5, idempotent=True, deferred=True, catalog=cat)
    def anything(args: SearchArgs, ctx: ToolContext) -> str:
        """Not used: description= wins."""
        return ""

    spec = cat.get(ToolName.namespaced("workspace", "search"))
    assert spec is not None and cat.get(ToolName.plain("search")) is None
    assert (spec.description, spec.parallel, spec.queue, spec.timeout, spec.idempotent, spec.deferred) == (
        "Given text.", False, "search", 5, True, True)
    assert cat.queues() == ["search"]


def test_bare_decorator_registers_in_the_process_catalog():
    from toolq.core.catalog import CATALOG

    @tool
    def catalog_test_bare_tool(args: SearchArgs, ctx: ToolContext) -> str:
        """Registered without parentheses."""
        return ""

    assert CATALOG.get(ToolName.plain("catalog_test_bare_tool")) is catalog_test_bare_tool.tool_spec


def test_args_model_renders_to_a_strict_schema():
    cat = Catalog()

    @tool(catalog=cat)
    def search(args: SearchArgs, ctx: ToolContext) -> str:
        """Search."""
        return ""

    spec = search.tool_spec
    assert spec.strict is True
    assert spec.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for."},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "path": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["query", "limit", "path"],
        "additionalProperties": False,
    }
    assert spec.model_spec() == {"type": "function", "name": "search", "description": "Search.", "strict": True,
                                 "parameters": spec.parameters}


def test_nested_models_are_closed_and_fully_required_too():
    cat = Catalog()

    @tool(catalog=cat)
    def ranges(args: Nested, ctx: ToolContext) -> str:
        """Ranges."""
        return ""

    schema = ranges.tool_spec.parameters
    assert "title" not in str(schema)
    assert schema["required"] == ["ranges", "mode"]
    assert schema["properties"]["mode"] == {"anyOf": [{"enum": ["fast", "slow"], "type": "string"}, {"type": "null"}]}
    inner = schema["$defs"]["Range"]
    assert inner["additionalProperties"] is False
    assert inner["required"] == ["start", "end"]
    assert inner["properties"]["end"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}


def test_explicit_parameters_are_used_as_given_and_not_strict():
    cat = Catalog()
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}

    @tool(parameters=schema, catalog=cat)
    def run(args: SearchArgs, ctx: ToolContext) -> str:
        """Run."""
        return ""

    assert run.tool_spec.parameters is schema
    assert run.tool_spec.strict is False
    assert run.tool_spec.model_spec()["strict"] is False


def test_grammar_makes_a_custom_tool_with_its_format():
    cat = Catalog()

    @tool(grammar=LARK, parallel=False, catalog=cat)
    def patch(text: str, ctx: ToolContext) -> str:
        """Patch files."""
        return text

    spec = patch.tool_spec
    assert (spec.kind, spec.parameters, spec.args_model, spec.parallel) == ("custom", None, None, False)
    assert spec.model_spec() == {"type": "custom", "name": "patch", "description": "Patch files.", "format": LARK}


def test_a_str_input_without_grammar_is_a_plain_custom_tool():
    cat = Catalog()

    @tool(catalog=cat)
    def note(text: str, ctx: ToolContext) -> str:
        """Take a note."""
        return text

    assert note.tool_spec.model_spec() == {"type": "custom", "name": "note", "description": "Take a note."}


def test_a_function_tool_without_an_args_model_is_a_configuration_error():
    cat = Catalog()
    with pytest.raises(ConfigurationError, match="tool broken: a function tool needs an args model"):

        @tool(kind="function", catalog=cat)
        def broken(args: dict, ctx: ToolContext) -> str:
            """No model."""
            return ""

    assert len(cat) == 0


def test_registering_a_name_twice_is_a_configuration_error():
    cat = Catalog()

    @tool(catalog=cat)
    def search(args: SearchArgs, ctx: ToolContext) -> str:
        """First."""
        return ""

    with pytest.raises(ConfigurationError, match="duplicate tool: search is already registered"):

        @tool(name="search", catalog=cat)
        def search_again(args: SearchArgs, ctx: ToolContext) -> str:
            """Second."""
            return ""

    # the same name in a namespace is a different tool, but only once
    tool(name="search", namespace="workspace", catalog=cat)(search)
    with pytest.raises(ConfigurationError, match="duplicate tool: workspace.search is already registered"):
        tool(name="search", namespace="workspace", catalog=cat)(search)
    assert [str(s.tool_name) for s in cat] == ["search", "workspace.search"]
    assert cat.get(ToolName.plain("search")).description == "First."


def test_sync_and_async_handlers_both_run():
    cat = Catalog()

    @tool(catalog=cat)
    def sync_tool(args: SearchArgs, ctx: ToolContext) -> str:
        """Sync."""
        return f"sync {args.query}"

    @tool(catalog=cat)
    async def async_tool(args: SearchArgs, ctx: ToolContext) -> str:
        """Async."""
        await asyncio.sleep(0)
        return f"async {args.query} {ctx.call_id}"

    args = SearchArgs(query="q")
    assert asyncio.run(call_handler(sync_tool.tool_spec, args, ctx())) == "sync q"
    assert asyncio.run(call_handler(async_tool.tool_spec, args, ctx())) == "async q call_1"
    # the async declaration is a function tool like any other
    assert async_tool.tool_spec.parameters == sync_tool.tool_spec.parameters


# --- declaration digests -----------------------------------------------------------------------


def declare(**kw) -> ToolSpec:
    cat = Catalog()

    def echo(args: SearchArgs, ctx: ToolContext) -> str:
        """Echo."""
        return ""

    return tool(catalog=cat, **kw)(echo).tool_spec


def test_the_same_declaration_has_the_same_digest_in_any_catalog():
    a, b = declare(queue="search"), declare(queue="search")
    assert a.digest() == b.digest()
    assert len(a.digest()) == 16


@pytest.mark.parametrize("change", [
    {"timeout": 61.0},
    {"queue": "other"},
    {"parallel": False},
    {"idempotent": True},
    {"namespace": "workspace"},
    {"description": "Echo, differently."},
    {"parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
    {"strict": False},
])
def test_digest_changes_when_the_declaration_changes(change):
    assert declare(**change).digest() != declare().digest()


def test_digest_ignores_the_handler_body():
    cat = Catalog()

    @tool(name="echo", catalog=cat)
    def one(args: SearchArgs, ctx: ToolContext) -> str:
        """Echo."""
        return "one"

    assert one.tool_spec.digest() == declare().digest()


# --- parse_arguments ---------------------------------------------------------------------------


def parse(raw: str):
    return parse_arguments(declare(), raw)


def test_parse_arguments_fills_defaults_and_treats_null_as_absent():
    assert parse('{"query": "x", "limit": null, "path": null}') == SearchArgs(query="x")
    assert parse('{"query": "x", "limit": 3}') == SearchArgs(query="x", limit=3)


@pytest.mark.parametrize("raw, message", [
    ("{not json", "failed to parse function arguments: Expecting property name enclosed in double quotes: "
                  "line 1 column 2 (char 1)"),
    ("{}", "failed to parse function arguments: missing field `query`"),
    ('{"query": null}', "failed to parse function arguments: missing field `query`"),
    ('{"query": "x", "limit": "soon"}', "failed to parse function arguments: invalid value for `limit`: "
                                        "Input should be a valid integer, unable to parse string as an integer"),
    ("[]", "failed to parse function arguments: Input should be a valid dictionary or instance of SearchArgs"),
])
def test_parse_arguments_messages_name_the_bad_input(raw, message):
    with pytest.raises(RespondToModel) as e:
        parse(raw)
    assert e.value.message == message


def test_a_plain_parameters_schema_is_written_from_the_arguments_model_alone():
    from pydantic import BaseModel, Field

    from toolq.core.catalog import plain_parameters

    class Args(BaseModel):
        cmd: str = Field(description="what to run")
        count: int | None = Field(default=None, json_schema_extra={"type": "number"})
        quiet: bool = False

    assert plain_parameters(Args) == {
        "type": "object",
        "properties": {"cmd": {"type": "string", "description": "what to run"}, "count": {"type": "number"},
                       "quiet": {"type": "boolean"}},
        "required": ["cmd"], "additionalProperties": False}


def test_every_validation_message_names_the_field_and_drops_pydantics_prefix():
    from pydantic import BaseModel, ValidationError, field_validator

    from toolq.core.errors import problems

    class Limits(BaseModel):
        n: int

        @field_validator("n")
        @classmethod
        def _positive(cls, v: int) -> int:
            if v <= 0:
                raise ValueError("must be positive")
            return v

    with pytest.raises(ValidationError) as bad:
        Limits.model_validate({"n": -1})
    assert problems(bad.value) == [("n", "must be positive", "value_error")]
    with pytest.raises(ValidationError) as missing:
        Limits.model_validate({})
    assert problems(missing.value)[0].kind == "missing" and problems(missing.value)[0].where == "n"
