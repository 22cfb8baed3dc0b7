"""The transports: WebSocket (one JSON-RPC message per text frame; Codex's `CODEX_EXEC_SERVER_URL`)
and stdio (one per line; `environments.toml`'s `program`), and what every connection does alike.

A connection reads frames in order and answers each request in a task of its own (Codex pipelines:
seven `fs/getMetadata` before the first answer), so every request gets exactly one answer, in any
order. Frames go out through one queue, in the order they were made. `initialize` is handled in
line: it opens (or resumes) the connection's client session, which every later request uses."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from toolq.frontdoors.exec_server.protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MAX_MESSAGE_BYTES,
    InitializeParams,
    Notification,
    Request,
    RpcError,
    Undecodable,
    decode,
    encode,
    error_frame,
    parse_params,
    result_frame,
)
from toolq.frontdoors.exec_server.session import Context, ExecSession
from toolq.frontdoors.listening import Listen, bearer_matches
from toolq.frontdoors.listening import parse_listen as parse_address

log = logging.getLogger("toolq.exec_server")

#: What a WebSocket connection may have waiting to be sent: past it, the client is not reading
#: (the server's memory would grow with every process's output), so the connection is dropped;
#: the session is kept, and a client that resumes catches up with `process/read`.
MAX_QUEUED_BYTES = 32 << 20
#: How long a stopping server waits for each connection to send what it pushed last.
DRAIN_WAIT = 5.0


class Sessions:
    """The client sessions of one server, by id (a resumed client names its own)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.by_id: dict[str, ExecSession] = {}
        self.connections: set[Connection] = set()
        """The connections being served (a stop waits for what it pushed to them to be sent)."""

    def open(self, resume: str | None) -> tuple[ExecSession, bool]:
        """The session `resume` names when it is still kept, else a new one; and whether it resumed."""
        if resume is not None and (found := self.by_id.get(resume)) is not None and not found.closed:
            return found, True
        session = ExecSession(self.ctx, self._forget)
        self.by_id[session.id] = session
        session.open()
        return session, False

    def _forget(self, session: ExecSession) -> None:
        self.by_id.pop(session.id, None)

    async def close_all(self) -> None:
        await asyncio.gather(*(s.close() for s in list(self.by_id.values())))

    async def stop_all(self, reason: str) -> None:
        """The server stops while its connections are still open: every session ends as a reap
        does, each attached client told first how each live process ended (`ExecSession.stop`);
        then what was pushed is sent (at most DRAIN_WAIT), and the caller closes the connections."""
        await asyncio.gather(*(s.stop(reason) for s in list(self.by_id.values())))
        await asyncio.gather(*(c.drained(DRAIN_WAIT) for c in list(self.connections)))


class Connection:
    """One client connection: `frames` in, `send` out; `keep` says whether the session outlives it."""

    def __init__(self, sessions: Sessions, send: Callable[[str], Awaitable[None]], *, keep: bool,
                 hang_up: Callable[[], None] | None = None) -> None:
        self.sessions = sessions
        self._send = send
        self.keep = keep
        self._hang_up = hang_up
        """Drops the connection at once (None: never, whatever waits to be sent)."""
        self.session: ExecSession | None = None
        self._out: asyncio.Queue[str | None] = asyncio.Queue()
        self._queued = 0
        """The characters in `_out`; -1 once hung up on."""
        self._tasks: set[asyncio.Task[None]] = set()

    def push(self, frame: dict[str, Any]) -> None:
        if self._queued < 0:  # hung up on: nothing more is queued
            return
        text = encode(frame)
        self._queued += len(text)
        if self._hang_up is not None and self._queued > MAX_QUEUED_BYTES:
            log.warning("exec-server: the client left %d bytes unread; its connection is dropped", self._queued)
            self._queued = -1
            self._hang_up()
            return
        self._out.put_nowait(text)

    async def _writer(self) -> None:
        while (text := await self._out.get()) is not None:
            try:
                await self._send(text)
            except Exception as e:  # the peer went away: the reader ends the connection
                log.debug("could not send a frame: %s", e)
                self._queued = -1  # nothing more is queued, and what is will never be sent
                while not self._out.empty():
                    self._out.get_nowait()
                    self._out.task_done()
                return
            finally:
                self._out.task_done()
            if self._queued >= 0:
                self._queued -= len(text)
        self._out.task_done()  # the end mark: a stop waiting for what was pushed waits no longer

    async def drained(self, seconds: float) -> None:
        """Once every frame pushed so far is sent (or `seconds` passed, or the peer is gone)."""
        try:
            await asyncio.wait_for(self._out.join(), seconds)
        except TimeoutError:
            log.warning("exec-server: a client did not take its last frames in %.0fs", seconds)

    async def serve(self, frames: Any) -> None:
        """Until `frames` (an async iterator of text) ends; then the session is kept or closed."""
        writer = asyncio.create_task(self._writer())
        self.sessions.connections.add(self)
        try:
            async for frame in frames:
                await self._receive(frame)
        finally:
            self.sessions.connections.discard(self)
            # Requests in flight run to their end (a process/terminate sent just before Codex's socket
            # dropped still kills); their answers have nowhere to go.
            self._out.put_nowait(None)
            await asyncio.wait({writer}, timeout=5)
            if self.session is not None:
                if self.keep:
                    self.session.detach(self.push)
                else:
                    await self.session.close()

    async def _receive(self, frame: str | bytes) -> None:
        try:
            message = decode(frame)
        except Undecodable as e:
            log.warning("exec-server: a bad frame: %s", e.error.message)
            self.push(error_frame(e.id, e.error))
            return
        if isinstance(message, Notification):
            if message.method != "initialized":
                log.warning("exec-server: notification %s ignored", message.method[:100])
            return
        if message.method == "initialize":
            try:
                self._answer(message, self._initialize(message.params))
            except RpcError as e:
                self.push(error_frame(message.id, e))
            return
        if self.session is None:
            self.push(error_frame(message.id, RpcError(INVALID_REQUEST, "client must call initialize before "
                                                                        "using exec methods")))
            return
        task = asyncio.create_task(self._handle(self.session, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _initialize(self, params: Any) -> dict[str, Any]:
        p = parse_params(InitializeParams, params)
        if self.session is not None:
            raise RpcError(INVALID_REQUEST, "initialize was already called on this connection")
        session, resumed = self.sessions.open(p.resume_session_id)
        session.attach(self.push, resumed=resumed)
        self.session = session
        if p.resume_session_id is not None and not resumed:
            log.info("exec-server: session %s is gone; a new one, %s", p.resume_session_id[:100], session.id)
        return {"sessionId": session.id, "environmentInfo": session.environment_info()}

    def _answer(self, request: Request, result: Any) -> None:
        self.push(result_frame(request.id, result))

    async def _handle(self, session: ExecSession, request: Request) -> None:
        try:
            self._answer(request, await session.handle(request.method, request.params))
        except RpcError as e:
            self.push(error_frame(request.id, e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every request gets exactly one answer
            log.exception("exec-server: %s failed", request.method)
            self.push(error_frame(request.id, RpcError(INTERNAL_ERROR, f"toolq: {type(e).__name__}: {e}")))


# ---- WebSocket ---------------------------------------------------------------------------------

class ListenError(Exception):
    """The address cannot be listened on (one line for the user)."""


def parse_listen(text: str) -> Listen | None:
    """`ws://HOST:PORT` → Listen; `stdio` → None; ValueError (one sentence) otherwise."""
    return parse_address(text, "ws")


def token_accepted(token: str | None, headers: Any, path: str) -> bool:
    """No token set: every upgrade; else `Authorization: Bearer T` or `?token=T` (Codex sends no headers)."""
    if token is None:
        return True
    if bearer_matches(headers.get_all("Authorization"), token):
        return True
    return any(hmac.compare_digest(g.encode(), token.encode()) for g in parse_qs(urlsplit(path).query).get("token", []))


def _loopback_name(host: str | None) -> bool:
    return host is not None and Listen(host, 0).loopback


def browser_refused(token: str | None, headers: Any) -> str | None:
    """Why an upgrade from a browser page is refused, or None. A page on any site may open a WebSocket
    to a loopback port (no CORS for WebSockets) and, with no token, run commands: its `Origin` is
    another site's (Codex sends none), or its `Host` is the page's own name (DNS rebinding). With a
    token the page cannot pass `token_accepted`."""
    if token is not None:
        return None
    host = headers.get("Host")
    if not _loopback_name(urlsplit(f"//{host}").hostname if host else None):
        return "toolq exec-server: a Host other than loopback is refused (no token is set)\n"
    origin = headers.get("Origin")
    if origin is not None and not _loopback_name(urlsplit(origin).hostname):
        return "toolq exec-server: a browser page of another origin is refused (no token is set)\n"
    return None


async def serve_websocket(sessions: Sessions, listen: Listen, token: str | None,
                          on_listening: Callable[[str], None]) -> None:
    from websockets.asyncio.server import ServerConnection, serve
    from websockets.exceptions import ConnectionClosed
    from websockets.http11 import Request as HttpRequest

    def check(connection: ServerConnection, request: HttpRequest) -> Any:
        if (why := browser_refused(token, request.headers)) is not None:
            return connection.respond(403, why)
        if token_accepted(token, request.headers, request.path):
            return None
        return connection.respond(401, "toolq exec-server: a bearer token is required "
                                       "(Authorization: Bearer TOKEN, or ?token=TOKEN in the URL)\n")

    async def handler(ws: ServerConnection) -> None:
        async def frames() -> Any:
            try:
                async for frame in ws:
                    yield frame
            except ConnectionClosed:
                return

        await Connection(sessions, ws.send, keep=True, hang_up=ws.transport.abort).serve(frames())

    try:
        server = await serve(handler, listen.host, listen.port, process_request=check, max_size=MAX_MESSAGE_BYTES,
                             compression=None)
    except OSError as e:  # a port in use, an address not ours: one line
        raise ListenError(f"cannot listen on ws://{listen.host}:{listen.port}: {e.strerror or e}") from None
    try:
        host, port = next(iter(server.sockets)).getsockname()[:2]
        on_listening(f"ws://{f'[{host}]' if ':' in host else host}:{port}")
        await server.serve_forever()
    finally:
        server.close()
        await server.wait_closed()


# ---- stdio ----------------------------------------------------------------------------------------

async def serve_stdio(sessions: Sessions) -> None:
    """NDJSON on stdin/stdout; stdin's end ends the session at once (Codex closes it when it exits)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_MESSAGE_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, out)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)

    async def send(text: str) -> None:
        writer.write(text.encode() + b"\n")
        await writer.drain()

    async def lines() -> Any:
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # a line past MAX_MESSAGE_BYTES: dropped unread (its id with it)
                log.warning("exec-server: a line longer than %d bytes was dropped", MAX_MESSAGE_BYTES)
                continue
            if not line:
                return
            if line.strip():
                yield line

    try:
        await Connection(sessions, send, keep=False).serve(lines())
    finally:
        writer.close()
