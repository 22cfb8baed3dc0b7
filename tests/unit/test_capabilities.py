"""Issue 25 item 4: the generic pipeline reads a tool's declaration, never its name. What a built-in
does differently (its output streams, it is routed by session, Flower shows some of its arguments,
watchers see it as a command) is declared in its `ToolSpec`, so a user tool can do the same."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import toolq
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolSpec, tool
from toolq.orchestrator.transport.dispatch import flower_args
from toolq.workers.loader import load_catalog

PIPELINE = Path(toolq.__file__).parent / "orchestrator"
#: Modules outside the pipeline: the benchmarks and the fake model drive built-ins on purpose.
NOT_PIPELINE = ("bench", "fake_model")


def _builtins() -> dict[str, ToolSpec]:
    """toolq's own tools (the process-wide catalog also holds what other tests registered)."""
    return {spec.name: spec for spec in load_catalog() if spec.namespace is None and spec.handler is not None
            and spec.handler.__module__.startswith("toolq.workers.tools.")}


def _builtin_names() -> set[str]:
    """The built-ins' names; "tool_search" is also the Responses API's item and payload kind,
    which the pipeline must name."""
    return set(_builtins()) - {"tool_search"}


def test_no_built_in_tool_name_is_compared_or_looked_up_in_the_generic_pipeline():
    names = _builtin_names()
    assert {"exec_command", "write_stdin", "apply_patch", "update_plan"} <= names
    found = []
    for path in sorted(PIPELINE.rglob("*.py")):
        if any(part in NOT_PIPELINE for part in path.relative_to(PIPELINE).parts):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings:
                found.append(f"{path.relative_to(PIPELINE.parent)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_the_built_ins_declare_what_the_pipeline_does_for_them():
    specs = _builtins()
    assert specs["exec_command"].streams_output and specs["write_stdin"].streams_output
    assert specs["write_stdin"].route == "session" and specs["exec_command"].route == "queue"
    assert specs["exec_command"].sessions and specs["write_stdin"].sessions
    assert (specs["exec_command"].view, specs["write_stdin"].view) == ("command", "command")
    assert (specs["apply_patch"].view, specs["update_plan"].view) == ("file_change", "todo_list")
    assert dict(specs["exec_command"].flower_args) == {"cmd": "value"}
    assert dict(specs["write_stdin"].flower_args) == {"session_id": "value", "chars": "length"}
    front_doors = ("process_start", "process_write", "process_terminate", "fs")  # issue 29: never offered
    assert specs["process_start"].sessions and specs["process_write"].route == "session"
    assert not [name for name, s in specs.items() if s.offered == (name in front_doors)]
    assert not [name for name, s in specs.items() if (s.streams_output or s.sessions or s.flower_args)
                and name not in ("exec_command", "write_stdin", *front_doors)]


def test_a_user_tool_declares_streaming_and_what_flower_shows():
    from pydantic import BaseModel

    class Args(BaseModel):
        url: str
        token: str

    catalog = Catalog()

    @tool(catalog=catalog, streams_output=True, flower_args={"url": "value", "token": "length"})
    def fetch(args: Args) -> str:
        """Fetch a page."""
        return args.url

    spec = fetch.tool_spec
    assert spec.streams_output and spec.route == "queue" and spec.view == "tool_call"
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName(name="fetch"),
                         payload=FunctionPayload(arguments='{"url": "https://x", "token": "s3cret"}'), deadline=0)
    assert flower_args(inv, spec) == "(call_id='c', turn='t', url='https://x', token=6)"
    # What Flower shows and how a call is watched are not part of the declaration's digest:
    # a worker and an orchestrator that disagree on them still agree on the call.
    plain = tool(catalog=Catalog())(fetch).tool_spec  # the same function, declared without them
    assert not plain.streams_output and not plain.flower_args
    assert plain.digest() == spec.digest()


def test_a_declaration_asks_for_a_known_capability():
    from toolq.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="flower_args"):
        tool(catalog=Catalog(), parameters={"type": "object"}, flower_args={"x": "all"})(lambda args: "")
    with pytest.raises(ConfigurationError, match="route"):
        tool(catalog=Catalog(), parameters={"type": "object"}, route="nowhere")(lambda args: "")


#: The built-ins' declaration digests and the task names as released: a worker and an orchestrator
#: of different toolq versions agree on a call only while these stay (issue 25: moves change no
#: behaviour). A deliberate change of a declaration updates this table, and says so.
RELEASED_DIGESTS = {
    "apply_patch": "1c377d6feeccf9c7", "exec_command": "1f039dcf0e1f2f05", "grep_files": "c07acd5c07fdf347",
    "list_dir": "8db5835acad154bd", "read_file": "7f970183728ebea8", "tool_search": "94a6e38958333de3",
    "update_plan": "a1f16d933da5d689", "view_image": "52f40d3593bf80c6", "write_stdin": "64fcc07397ca050c",
    # issue 29: the front doors' tools
    "process_start": "a435236ef7aaa240", "process_write": "01f871db0268fe58", "process_terminate": "e225f5968042a5e9",
    "fs": "594b74d70e6d0ae5",
}


def test_the_built_ins_digests_and_the_task_names_are_the_released_ones():
    from toolq.core.contracts import TASK, TASK_IDEMPOTENT

    digests = {name: spec.digest() for name, spec in _builtins().items()}
    assert digests == RELEASED_DIGESTS
    assert (TASK, TASK_IDEMPOTENT) == ("toolq.run", "toolq.run_idempotent")


def test_what_flower_shows_of_hostile_arguments_stays_bounded():
    # The model chooses the values: a huge list where a string was expected, or many long strings,
    # must not make the task message's argsrepr (kept twice, counted by the turn's store budget) grow.
    from toolq.core.flower_args import FLOWER_ARGS_CHARS as FLOWER_COMMAND_CHARS

    catalog = Catalog()
    spec = tool(catalog=catalog, name="shown", parameters={"type": "object"},
                flower_args={"a": "value", "b": "value", "c": "length"})(lambda args: "").tool_spec
    hostile = {"a": [["\u202e" * 50]] * 20_000, "b": "\x1b" * 100_000, "c": "y" * 10**6}
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName(name="shown"),
                         payload=FunctionPayload(arguments=json.dumps(hostile)), deadline=0)
    shown = flower_args(inv, spec)
    assert len(shown) <= len("(call_id='c', turn='t', a=, b=, c=)") + FLOWER_COMMAND_CHARS + 16, len(shown)
    assert shown.endswith("c=1000000)")  # a length is always shown whole
