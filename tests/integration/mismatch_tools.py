"""One tool declared two ways: workers started with `TOOLQ_TEST_MISMATCH=1` see a different timeout.

The orchestrator (the test process) loads it without the variable, so the two sides disagree on
`touch_marker`'s declaration and the worker must refuse the call instead of running it.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from toolq import ToolContext, tool

MISMATCH_ENV = "TOOLQ_TEST_MISMATCH"
QUEUE = "mismatch"


class MarkerArgs(BaseModel):
    name: str


@tool(queue=QUEUE, timeout=5 if os.environ.get(MISMATCH_ENV) == "1" else 10)
def touch_marker(args: MarkerArgs, ctx: ToolContext) -> str:
    """Create an empty file in the workspace (the test checks it was never created)."""
    (ctx.workspace / args.name).touch()
    return "created"
