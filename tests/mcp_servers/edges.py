"""An MCP server for the edges, written with the SDK's FastMCP: `python edges.py LABEL DIR [PORT]`.

LABEL tells two instances apart (both offer `search`); DIR is where the server leaves evidence
the test reads (a cancelled call's marker, its pid for the crash test). With PORT it serves
streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
import zlib
from pathlib import Path

from mcp.server.fastmcp import Context, FastMCP, Image
from pydantic import BaseModel

LABEL = sys.argv[1] if len(sys.argv) > 1 else "edges"
DIR = Path(sys.argv[2] if len(sys.argv) > 2 else ".")
DIR.mkdir(parents=True, exist_ok=True)
(DIR / f"{LABEL}.pid").write_text(str(os.getpid()))

PORT = int(sys.argv[3]) if len(sys.argv) > 3 else 0
server = FastMCP(LABEL, host="127.0.0.1", port=PORT or 8000, log_level="WARNING")


def tiny_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


@server.tool()
def search(query: str) -> str:
    """Search this server's own corpus."""
    return f"{LABEL} found {query}"


@server.tool()
def noop() -> str:
    """Does nothing (the benchmark's MCP tool)."""
    return ""


@server.tool()
def fail(reason: str) -> str:
    """Always fails, saying why."""
    raise ValueError(f"refused: {reason}")


@server.tool()
def picture() -> Image:
    """A 1x1 red PNG."""
    return Image(data=tiny_png(), format="png")


class Forecast(BaseModel):
    city: str
    celsius: float


@server.tool()
def forecast(city: str) -> Forecast:
    """Tomorrow's weather, as structured content."""
    return Forecast(city=city, celsius=21.5)


@server.tool()
def environment() -> str:
    """The names of the variables this server was started with."""
    return json.dumps(sorted(os.environ))


@server.tool()
async def slow(seconds: float) -> str:
    """Sleeps; leaves `<LABEL>.cancelled` in DIR if the client cancels the call."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        (DIR / f"{LABEL}.cancelled").write_text("cancelled")
        raise
    return "slept"


@server.tool()
def crash() -> str:
    """The server process dies mid-call."""
    os._exit(3)


@server.tool()
async def grow(ctx: Context) -> str:
    """Adds the tool `added` and tells the client its tool list changed."""

    def added() -> str:
        """A tool that was not there at start."""
        return "added says hi"

    server.add_tool(added)
    await ctx.session.send_tool_list_changed()
    return "grown"


@server.tool()
async def reshape(ctx: Context) -> str:
    """Lists `search` anew with another schema (a `limit` argument) and says the list changed."""

    def search(query: str, limit: int) -> str:
        """Search this server's own corpus, at most `limit` results."""
        return f"{LABEL} found {query} (at most {limit})"

    server.remove_tool("search")
    server.add_tool(search)
    await ctx.session.send_tool_list_changed()
    return "reshaped"


if __name__ == "__main__":
    server.run("streamable-http" if PORT else "stdio")
