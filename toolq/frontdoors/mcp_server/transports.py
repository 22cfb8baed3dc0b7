"""The two ways `toolq mcp-server` listens: stdio (one client session, the process's own stdin and
stdout) and streamable HTTP at `/mcp` (many sessions; a bearer token when one is configured, which
the command line requires off loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import anyio
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
#: How long a stopping HTTP server lets its open responses finish (its calls are answered by then).
STREAMS_GRACE = 3


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
    event_streams: set[anyio.CancelScope] = set()

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
        if scope["method"] == "GET":  # a client's event stream: open until the session ends, or a stop
            await _event_stream(manager, scope, receive, send, event_streams)
        else:
            await manager.handle_request(scope, receive, send)

    try:  # bound here: a port in use is one clear line, and port 0 tells which port it got
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ConfigurationError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # A stop has answered the calls in flight (`stop_calls`) and ended clients' idle event streams (which
    # never end on their own) before uvicorn stops; STREAMS_GRACE bounds what is left.
    server = _Uvicorn(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                     timeout_graceful_shutdown=STREAMS_GRACE))
    loop = asyncio.get_running_loop()
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    stopping = _Stop(door, server, event_streams)
    for sig in stops:  # a graceful stop: the caller closes the fleet once uvicorn is done
        loop.add_signal_handler(sig, stopping.signalled)
    try:
        async with manager.run():
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not serving.done():
                await asyncio.sleep(0.02)
            if server.started:
                shown = f"[{host}]" if ":" in host else host
                listening(f"http://{shown}:{sock.getsockname()[1]}{MCP_PATH}")
            await serving
            if stopping.task is not None:
                await stopping.task
    finally:
        for sig in stops:
            loop.remove_signal_handler(sig)
        sock.close()


class _Stop:
    """A signal's graceful stop: the calls in flight are cancelled and answered (aborted) while the
    connections are open, clients' idle event streams end, then uvicorn stops. A second signal
    stops uvicorn at once."""

    def __init__(self, door: McpFrontDoor, server: uvicorn.Server, event_streams: set[anyio.CancelScope]) -> None:
        self.door, self.server, self.event_streams = door, server, event_streams
        self.task: asyncio.Task[None] | None = None

    def signalled(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._stop())
        else:
            self.server.should_exit = True

    async def _stop(self) -> None:
        try:
            await self.door.stop_calls()
        finally:
            for stream in list(self.event_streams):
                stream.cancel()
            self.server.should_exit = True


async def _event_stream(manager: StreamableHTTPSessionManager, scope: dict[str, Any], receive: Any, send: Any,
                        open_streams: set[anyio.CancelScope]) -> None:
    """A GET (a session's event stream), which a stop ends as a stream ends: its body closed."""
    started = False

    async def sending(message: MutableMapping[str, Any]) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    with anyio.CancelScope() as stream:
        open_streams.add(stream)
        try:
            await manager.handle_request(scope, receive, sending)
        finally:
            open_streams.discard(stream)
    if stream.cancel_called and started:
        with contextlib.suppress(Exception):  # the client may be gone already
            await send({"type": "http.response.body", "body": b"", "more_body": False})


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
