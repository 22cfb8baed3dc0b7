"""`toolq.testing.run_call`: one call in-process, as the orchestrator and a worker would see it."""

from __future__ import annotations

from pydantic import BaseModel

from toolq import RespondToModel, ToolContext, ToolReturn, tool
from toolq.core.catalog import Catalog
from toolq.core.states import CallState
from toolq.testing import run_call

CAT = Catalog()  # kept out of the process-wide catalog


class ReadArgs(BaseModel):
    name: str


@tool(catalog=CAT)
def read_note(args: ReadArgs, ctx: ToolContext) -> str:
    """Read a note from the workspace."""
    path = ctx.workspace / args.name
    if not path.exists():
        raise RespondToModel(f"no note named {args.name}")
    return path.read_text()


@tool(catalog=CAT)
def exit_code(args: ReadArgs, ctx: ToolContext) -> ToolReturn:
    """Report a failure with an exit code."""
    return ToolReturn(output=f"exit {args.name}", success=False, exit_code=int(args.name))


def test_run_call_runs_the_handler_in_the_workspace(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    result = run_call(read_note, {"name": "a.txt"}, workspace=tmp_path)
    assert (result.status, result.output, result.success) == (CallState.COMPLETED, "hello", True)


def test_run_call_gives_the_model_visible_error_of_a_tool(tmp_path):
    result = run_call(read_note, {"name": "missing"}, workspace=tmp_path)
    assert (result.status, result.output) == (CallState.FAILED, "no note named missing")


def test_run_call_validates_arguments_like_the_orchestrator(tmp_path):
    result = run_call(read_note, {"nam": "a.txt"}, workspace=tmp_path)
    assert result.status is CallState.REJECTED
    assert result.output.startswith("failed to parse function arguments:")


def test_a_tool_reporting_failure_is_failed_with_its_output_unchanged(tmp_path):
    result = run_call(exit_code, {"name": "3"}, workspace=tmp_path)
    assert (result.status, result.output, result.exit_code) == (CallState.FAILED, "exit 3", 3)
