"""The MCP server `toolq bench mcp` hosts: one no-op tool, so what is measured is the hop.

`python -m toolq.dev.bench.mcp_server` (stdio), written with the SDK's FastMCP.
"""

from mcp.server.fastmcp import FastMCP

server = FastMCP("bench", log_level="WARNING")  # no log line per call: it would be measured too


@server.tool(structured_output=False)  # plain text, not `{"result": ...}`
def noop() -> str:
    """Do nothing."""
    return "ok"


if __name__ == "__main__":
    server.run("stdio")
