"""A tool module that only some workers load (`--tools tests.integration.joining_tools`): the
fleet's other workers have never heard of it, so its calls must reach only the workers that have."""

from __future__ import annotations

import os

from pydantic import BaseModel

from toolq.core.catalog import ToolContext, tool


class JoinArgs(BaseModel):
    text: str


@tool
def joined_echo(args: JoinArgs, ctx: ToolContext) -> str:
    """Echo the text with the pid of the process that ran it."""
    return f"{args.text} from {os.getpid()}"
