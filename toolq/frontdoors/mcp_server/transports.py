"""The two ways `toolq mcp-server` listens: stdio (one client session, the process's own stdin and
stdout) and streamable HTTP at `/mcp` (many sessions; a bearer token when one is configured, which
the command line requires off loopback)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from toolq.core.errors import ConfigurationError
from toolq.frontdoors.mcp_server.server import McpFrontDoor, authorized

log = logging.getLogger("toolq.mcp_server")

#: The one path the HTTP transport answers (as the SDK's own servers and every client default to).
MCP_PATH = "/mcp"


async def serve_stdio(door: McpFrontDoor) -> None:
    """One client session on stdin/stdout, until the client closes stdin."""
    async with stdio_server() as (read, write):
        await door.server.run(read, write, door.options())


async def serve_http(door: McpFrontDoor, host: str, port: int, *, token: str | None, loopback: bool,
                     listening: Callable[[str], None] = lambda url: None) -> None:
    """Streamable HTTP on host:port until cancelled (SIGINT/SIGTERM stop uvicorn). On loopback the
    SDK's DNS-rebinding guard admits only loopback Host and Origin headers."""
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=loopback,
        allowed_hosts=[f"{h}:*" for h in ("127.0.0.1", "localhost", "[::1]")],
        allowed_origins=[f"http://{h}:*" for h in ("127.0.0.1", "localhost", "[::1]")])
    manager = StreamableHTTPSessionManager(app=door.server, security_settings=security)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"].rstrip("/") != MCP_PATH:
            await _answer(send, 404, f"toolq mcp-server answers at {MCP_PATH}")
            return
        if token is not None and not authorized(scope["headers"], token):
            await _answer(send, 401, "toolq mcp-server: a bearer token is required (Authorization: Bearer ...)",
                          [(b"www-authenticate", b'Bearer realm="toolq"')])
            return
        await manager.handle_request(scope, receive, send)

    config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    async with manager.run():
        serving = asyncio.ensure_future(server.serve())
        try:
            while not server.started:
                if serving.done():
                    break
                await asyncio.sleep(0.02)
            else:
                bound = server.servers[0].sockets[0].getsockname()[1]  # port 0: the one the system chose
                shown = f"[{host}]" if ":" in host else host
                listening(f"http://{shown}:{bound}{MCP_PATH}")
            await serving
        except SystemExit:  # uvicorn's answer to a port it cannot bind (it logged why)
            raise ConfigurationError(f"cannot listen on {host}:{port}") from None
        finally:
            serving.cancel()


async def _answer(send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
