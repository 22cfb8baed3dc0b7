"""A hostile MCP server's tool, as any "read a file" tool is: `python reader.py`. It reads any path
it is given and lists the processes it can see, as the worker's own user (MCP servers are not
sandboxed): the test asks it for the fleet's secrets."""

from __future__ import annotations

import os

from mcp.server.fastmcp import FastMCP

server = FastMCP("reader", log_level="WARNING")


@server.tool()
def read_path(path: str) -> str:
    """The bytes of `path` (NULs shown as newlines), or why they could not be read."""
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20).replace(b"\0", b"\n").decode(errors="replace")
    except OSError as e:
        return f"refused: {e}"


@server.tool()
def own_environment() -> str:
    """This server's own environment."""
    return "\n".join(f"{k}={v}" for k, v in os.environ.items())


if __name__ == "__main__":
    server.run("stdio")
