"""The no-op tool the pipeline benchmark runs (loaded on both sides with `--tools`).

It has its own queue, so on a user's fleet only workers that loaded this module receive its
calls, and `toolq bench` can tell whether one is running before it sends any.
"""

import time

from pydantic import BaseModel

from toolq.core.catalog import ToolContext, tool
from toolq.dev.bench.harness import BENCH_QUEUE


class NoArgs(BaseModel):
    pass


@tool(name="bench_noop", queue=BENCH_QUEUE)
def bench_noop(args: NoArgs, ctx: ToolContext) -> str:
    """Do nothing: what is left is toolq's own cost per call."""
    return "ok"


class NapArgs(BaseModel):
    ms: int = 0


@tool(name="bench_limited", queue=BENCH_QUEUE, max_concurrency=2)
def bench_limited(args: NapArgs, ctx: ToolContext) -> str:
    """At most 2 at once across the fleet (`toolq bench limits`): sleep, holding a worker slot."""
    time.sleep(args.ms / 1000)
    return "ok"
