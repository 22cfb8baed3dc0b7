"""A user tool named like an MCP tool (`search`), on a queue only the MCP test worker consumes."""

from __future__ import annotations

from pydantic import BaseModel

from toolq.workers.catalog import ToolContext, tool


class SearchArgs(BaseModel):
    query: str


@tool(queue="mcp-test")
def search(args: SearchArgs, ctx: ToolContext) -> str:
    """The user's own search."""
    return f"user search found {args.query}"
