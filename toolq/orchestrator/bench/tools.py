"""The no-op tool the pipeline benchmark runs (loaded on both sides with `--tools`)."""

from pydantic import BaseModel

from toolq.workers.catalog import ToolContext, tool


class NoArgs(BaseModel):
    pass


@tool(name="bench_noop")
def bench_noop(args: NoArgs, ctx: ToolContext) -> str:
    """Do nothing: what is left is toolq's own cost per call."""
    return "ok"
