"""A user tool with a 10 MB output, on its own queue (`--tools tests.integration.big_tools`)."""

from __future__ import annotations

from pydantic import BaseModel

from toolq import ToolContext, tool

BIG = 10 * 1024 * 1024


class NoArgs(BaseModel):
    pass


@tool(queue="big")
def big_output(args: NoArgs, ctx: ToolContext) -> str:
    """Return 10 MB of text, with a line to find at each end."""
    return "FIRST LINE\n" + "x" * BIG + "\nLAST LINE"


@tool(queue="big")
def big_parts(args: NoArgs, ctx: ToolContext) -> list[dict]:
    """Return 10 MB of text as a content part."""
    return [{"type": "input_text", "text": "HEAD " + "y" * BIG + " TAIL"}]
