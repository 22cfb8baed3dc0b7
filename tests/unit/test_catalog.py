"""The `@tool` decorator, strict schemas, declaration digests and `parse_arguments` (toolq/core/catalog.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import DEFAULT_QUEUE, Catalog, ToolContext, ToolSpec, call_handler, parse_arguments, tool
from toolq.core.errors import ConfigurationError, RespondToModel
from toolq.testing import run_call

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


def test_a_function_tool_whose_argument_has_no_strict_schema_is_a_configuration_error():
    cat = Catalog()
    with pytest.raises(ConfigurationError, match=r"^tool broken: parameter args of broken\(\): dict is an object "
                                                 "with open keys, which a strict schema cannot keep"):

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


# --- issue 26: arguments inferred from typed parameters; ctx only to a handler that takes it ------


@pytest.fixture(autouse=True)
def in_a_workspace(tmp_path, monkeypatch):
    """`run_call` runs in the current directory: a checkout on the import path is refused as a workspace."""
    monkeypatch.chdir(tmp_path)


def test_plain_typed_parameters_declare_a_strict_function_tool():
    # `def add(a: int, b: int)` was declared a freeform tool, and its call failed with a TypeError.
    cat = Catalog()

    @tool(catalog=cat)
    def add(a: int, b: int = 2) -> str:
        """Adds two integers.

        Args:
            a: The first term.
            b (int): The second term,
                two unless given.
        """
        return str(a + b)

    spec = add.tool_spec
    assert (spec.kind, spec.strict, spec.description) == ("function", True, "Adds two integers.")
    assert spec.model_spec() == {"type": "function", "name": "add", "description": "Adds two integers.",
                                 "strict": True, "parameters": {
                                     "type": "object",
                                     "properties": {
                                         "a": {"type": "integer", "description": "The first term."},
                                         "b": {"anyOf": [{"type": "integer", "description":
                                                          "The second term, two unless given."}, {"type": "null"}]},
                                     },
                                     "required": ["a", "b"], "additionalProperties": False}}
    assert run_call(add, {"a": 1, "b": 5}).output == "6"
    assert run_call(add, {"a": 1, "b": None}).output == "3"  # null: the default, as for an args model
    bad = run_call(add, {"a": "one", "b": None})
    assert bad.status == "rejected", bad.output
    assert bad.output == "failed to parse function arguments: invalid value at `a`: 'one' is not of type 'integer'"
    assert add(1, 2) == "3"  # the decorated function is still the plain function


def test_ctx_is_given_only_to_a_handler_that_takes_it():
    # `def f(args: Model)` failed at call time: "takes 1 positional argument but 2 were given".
    cat = Catalog()

    @tool(catalog=cat)
    def no_ctx(args: Range) -> str:
        """An args model, no context."""
        return f"{args.start}-{args.end}"

    @tool(catalog=cat)
    def keyword_ctx(name: str, times: int, *, context: ToolContext) -> str:
        """The context by its annotation, after the arguments."""
        return f"{name * times} {context.call_id}"

    @tool(catalog=cat)
    async def named_ctx(ctx, where: Literal["here", "there"], /) -> str:
        """The context by its name, first; positional-only parameters."""
        return f"{where} {ctx.call_id}"

    assert run_call(no_ctx, {"start": 1, "end": None}).output == "1-None"
    assert run_call(keyword_ctx, {"name": "ab", "times": 2}, call_id="call_k").output == "abab call_k"
    assert run_call(named_ctx, {"where": "there"}, call_id="call_n").output == "there call_n"
    assert list(named_ctx.tool_spec.parameters["properties"]) == ["where"]  # ctx is no argument


def test_inferred_arguments_take_models_descriptions_and_any_name():
    cat = Catalog()

    @tool(catalog=cat)
    def query(json: str, schema: Annotated[int, Field(description="Which schema.")], ranges: list[Range],
              model_name: str | None = None) -> str:
        """Runs a query.

        More than the model needs to read."""
        return f"{json} {schema} {[r.start for r in ranges]} {model_name}"

    spec = query.tool_spec
    assert spec.description == "Runs a query."
    props = spec.parameters["properties"]
    assert list(props) == ["json", "schema", "ranges", "model_name"]
    assert props["schema"] == {"type": "integer", "description": "Which schema."}
    assert spec.parameters["$defs"]["Range"]["additionalProperties"] is False  # nested models are strict too
    out = run_call(query, {"json": "j", "schema": 2, "ranges": [{"start": 4, "end": None}], "model_name": None})
    assert out.output == "j 2 [4] None"


def test_a_one_string_function_tool_says_so_with_kind_function():
    # A lone `str` input stays a freeform tool (a declaration form kept as it was).
    @tool(catalog=Catalog(), kind="function")
    def lookup(word: str, ctx: ToolContext) -> str:
        """Looks a word up."""
        return word.upper()

    assert lookup.tool_spec.parameters["properties"] == {"word": {"type": "string"}}
    assert run_call(lookup, {"word": "hi"}).output == "HI"


def test_a_handler_with_no_arguments_is_a_function_tool_taking_none():
    @tool(catalog=Catalog())
    def now() -> str:
        """The time."""
        return "noon"

    assert now.tool_spec.parameters == {"type": "object", "properties": {}, "required": [],
                                        "additionalProperties": False}
    assert run_call(now, {}).output == "noon"


@pytest.mark.parametrize("source, message", [
    ("def f(a: int, b): ...", "parameter b of f() has no type annotation, so its argument cannot be declared: "
                              "annotate it (e.g. `b: str`), or take a pydantic args model"),
    ("def f(a: int, *rest: int): ...", "parameter *rest of f(): a tool's arguments are named"),
    ("def f(a: int, **extra: int): ...", "parameter **extra of f(): a tool's arguments are named"),
    ("import socket\ndef f(s: socket.socket): ...", "parameter s of f(): socket has no JSON Schema (Unable to "
                                                     "generate pydantic-core schema for <class 'socket.socket'>)"),
    ("from typing import Callable\ndef f(a: int, cb: Callable[[], int]): ...", "parameter cb of f(): "),
    ("def f(a: int, tags: dict[str, int]): ...", "parameter tags of f(): dict[str, int] is an object with open keys"),
    ("from typing import Any\ndef f(a: Any): ...", "parameter a of f(): Any accepts any JSON value"),
    ("from pydantic import BaseModel\nclass Box(BaseModel):\n    d: dict\ndef f(a: int, box: Box): ...",
     "parameter box of f(): Box is an object with open keys (at d), which a strict schema cannot keep"),
    ("def f(a: int, b: 'Undefined'): ...", "parameter b of f(): its annotation \"'Undefined'\" does not resolve"),
])
def test_what_cannot_be_inferred_is_refused_at_declaration_in_one_line(source, message):
    namespace: dict = {}
    exec(source, namespace)
    cat = Catalog()
    with pytest.raises(ConfigurationError) as info:
        tool(catalog=cat)(namespace["f"])
    assert str(info.value).startswith(f"tool f: {message}"), str(info.value)
    assert "\n" not in str(info.value) and len(cat) == 0


def test_a_parameter_beside_the_whole_arguments_that_nothing_fills_is_refused():
    with pytest.raises(ConfigurationError, match=r"^tool f: parameter limit of f\(\) is never given a value"):
        tool(catalog=Catalog(), parameters={"type": "object"})(f)


def f(args: dict, limit: int) -> str:
    """`limit` would have been given the context."""
    return ""


class TagArgs(BaseModel):
    tag: str


LEGACY_TAGS = {"type": "object", "properties": {"tag": {"type": "string"}}, "required": ["tag"]}


def legacy_forms() -> dict[str, ToolSpec]:
    """Every declaration form of before issue 26, declared as before."""
    cat = Catalog()

    def model_and_ctx(args: SearchArgs, ctx: ToolContext) -> str:
        """Searches. Returns lines."""
        return args.query

    def model_and_unannotated_ctx(args: SearchArgs, ctx) -> str:
        """Searches."""
        return args.query

    def model_and_other_name(args: SearchArgs, context) -> str:
        """Searches."""
        return f"{args.query} {context.call_id}"

    async def async_model(args: SearchArgs, ctx: ToolContext) -> str:
        """Searches.

        Second paragraph."""
        return args.query

    def text(text: str, ctx: ToolContext) -> str:
        """Takes a note."""
        return text

    def grammar(patch, ctx) -> str:
        """Patches."""
        return patch

    def dict_args(args: dict, ctx: ToolContext) -> str:
        """Counts tags."""
        return args["tag"]

    def unannotated(args, ctx) -> str:
        """Anything."""
        return args

    return {"model_and_ctx": tool(catalog=cat)(model_and_ctx).tool_spec,
            "model_and_unannotated_ctx": tool(catalog=cat)(model_and_unannotated_ctx).tool_spec,
            "model_and_other_name": tool(catalog=cat, queue="q", timeout=5, idempotent=True)(
                model_and_other_name).tool_spec,
            "async_model": tool(catalog=cat, namespace="ns")(async_model).tool_spec,
            "text": tool(catalog=cat)(text).tool_spec,
            "grammar": tool(catalog=cat, grammar=LARK)(grammar).tool_spec,
            "dict_args": tool(catalog=cat, parameters=LEGACY_TAGS)(dict_args).tool_spec,
            "unannotated": tool(catalog=cat)(unannotated).tool_spec}


#: Computed with toolq/core/catalog.py as it was before issue 26: every form declares the same tool.
LEGACY_DIGESTS = {"model_and_ctx": "567d5a47d5845852", "model_and_unannotated_ctx": "d7bf59f541acf01e",
                  "model_and_other_name": "91832ce0c96dfce0", "async_model": "2fac60ec5f97e72b",
                  "text": "bf2fc49a461a55f0", "grammar": "aea90a4c967bcb2c", "dict_args": "103c5952058c1d09",
                  "unannotated": "a962b595396ff6b5"}


def test_every_declaration_form_of_before_keeps_its_digest_and_still_runs():
    specs = legacy_forms()
    assert {name: spec.digest() for name, spec in specs.items()} == LEGACY_DIGESTS
    assert [s.kind for s in specs.values()] == ["function"] * 4 + ["custom"] * 2 + ["function", "custom"]
    assert run_call(specs["model_and_other_name"], {"query": "q", "limit": None, "path": None},
                    call_id="call_o").output == "q call_o"
    assert run_call(specs["async_model"], {"query": "q", "limit": None, "path": None}).output == "q"
    assert run_call(specs["text"], "note this").output == "note this"
    assert run_call(specs["grammar"], "patch").output == "patch"
    assert run_call(specs["dict_args"], {"tag": "x"}).output == "x"
    assert run_call(specs["unannotated"], "free").output == "free"
