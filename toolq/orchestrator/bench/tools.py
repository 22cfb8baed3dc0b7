"""The no-op tool the pipeline benchmark runs (loaded on both sides with `--tools`).

It has its own queue, so on a user's fleet only workers that loaded this module receive its
calls, and `toolq bench` can tell whether one is running before it sends any.
"""

from pydantic import BaseModel

from toolq.orchestrator.bench.harness import BENCH_QUEUE
from toolq.workers.catalog import ToolContext, tool


class NoArgs(BaseModel):
    pass


@tool(name="bench_noop", queue=BENCH_QUEUE)
def bench_noop(args: NoArgs, ctx: ToolContext) -> str:
    """Do nothing: what is left is toolq's own cost per call."""
    return "ok"
