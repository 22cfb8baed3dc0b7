"""The two ways `toolq mcp-server` listens: stdio (one client session, the process's own stdin and
stdout) and streamable HTTP at `/mcp` (many sessions; a bearer token when one is configured, which
the command line requires off loopback)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from toolq.core.errors import ConfigurationError
from toolq.frontdoors.listening import bearer_matches
from toolq.frontdoors.mcp_server.server import McpFrontDoor

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
        given = (v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization")
        if token is not None and not bearer_matches(given, token):
            await _answer(send, 401, "toolq mcp-server: a bearer token is required (Authorization: Bearer ...)",
                          [(b"www-authenticate", b'Bearer realm="toolq"')])
            return
        await manager.handle_request(scope, receive, send)

    try:  # bound here: a port in use is one clear line, and port 0 tells which port it got
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ConfigurationError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    server = _Uvicorn(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    loop = asyncio.get_running_loop()
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in stops:  # a graceful stop: open requests answered, then the caller closes the fleet
        loop.add_signal_handler(sig, setattr, server, "should_exit", True)
    try:
        async with manager.run():
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not serving.done():
                await asyncio.sleep(0.02)
            if server.started:
                shown = f"[{host}]" if ":" in host else host
                listening(f"http://{shown}:{sock.getsockname()[1]}{MCP_PATH}")
            await serving
    finally:
        for sig in stops:
            loop.remove_signal_handler(sig)
        sock.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn, minus its own signal handling: it re-raises a SIGTERM once it has stopped, which
    killed the process before the fleet's turns were recorded over (serve_http stops it instead)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _answer(send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
