"""The MCP host: one process per worker that holds one session per configured server.

Why one process per worker rather than one session per pool child: Celery's prefork children
are separate processes, so per-child sessions would start every server `concurrency` times,
give each child its own view of a server's tool list (and its own state, for stateful servers),
and multiply restarts. One host keeps one session, one tool list and one restart policy per
server; the children reach it over a Unix socket (`wire.py`), one connection per child, which
costs one local hop per call. Run as `python -m toolq.workers.mcp.host SOCKET`, the config
(`HostConfig`) as JSON on stdin; it prints its first `Listing` on stdout once every server has
started or failed its first start, then serves until its parent (the worker) is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from contextlib import AsyncExitStack
from typing import Any, cast

import anyio
from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client
from pydantic import BaseModel, ValidationError

from toolq.core.mcp_specs import DEFER_ABOVE, McpToolRecord, tool_spec, unusable
from toolq.workers import hardening
from toolq.workers.mcp.backoff import Backoff
from toolq.workers.mcp.checks import OutputCheck, SchemaError, output_check
from toolq.workers.mcp.config import McpServerConfig
from toolq.workers.mcp.results import map_result
from toolq.workers.mcp.wire import REQUEST, CallReply, CallRequest, Listing, ListRequest, ServerState

log = logging.getLogger("toolq.mcp")



class HostConfig(BaseModel):
    servers: dict[str, McpServerConfig]
    environments: dict[str, dict[str, str]]
    """Each server's whole environment, computed by the worker (`McpServerConfig.environment`)."""
    first_generation: int = 0
    """Where this start's listing generations begin (past any earlier start's: `launch.py`)."""


class Server:
    """One configured server: its session while it is up, its listed tools, its restarts."""

    def __init__(self, name: str, config: McpServerConfig, env: dict[str, str], changed: asyncio.Event) -> None:
        self.name, self.config, self.env = name, config, env
        self.session: ClientSession | None = None
        self.state: str = "starting"
        self.error: str | None = None
        self.restarts = 0
        self.tools: dict[str, McpToolRecord] = {}
        self.checks: dict[str, OutputCheck] = {}
        self.skipped: list[str] = []
        self.up = asyncio.Event()
        self.inflight: set[asyncio.Task] = set()
        self.crashed: set[asyncio.Task] = set()
        self.first_start = asyncio.Event()
        self._changed = changed

    def snapshot(self) -> ServerState:
        return ServerState(name=self.name, transport=self.config.transport, state=self.state,  # type: ignore[arg-type]
                           error=self.error, restarts=self.restarts, tools=list(self.tools.values()),
                           skipped=self.skipped)

    async def supervise(self) -> None:
        backoff = Backoff()
        while True:
            started = asyncio.get_running_loop().time()
            try:
                await self._run_once()
                self.error = "the server closed its connection"
            except Exception as e:  # a server that fails to start or breaks is restarted, never fatal
                self.error = describe(e)
            self.session, self.state = None, "down"
            self.up.clear()
            # Calls still waiting on the dead session are told, whatever the SDK does with them.
            for task in self.inflight:
                self.crashed.add(task)
                task.cancel()
            self.first_start.set()
            self._changed.set()
            delay = backoff.after_crash(asyncio.get_running_loop().time() - started)
            log.warning("mcp server %s down (%s); restarting in %.1fs", self.name, self.error, delay)
            await asyncio.sleep(delay)
            self.restarts += 1

    async def _run_once(self) -> None:
        async with AsyncExitStack() as stack:
            if self.config.command is not None:
                params = StdioServerParameters(command=self.config.command, args=self.config.args, env=self.env,
                                               cwd=self.config.cwd)
                read, write = await stack.enter_async_context(stdio_client(params, errlog=sys.stderr))
            else:
                read, write, _ = await stack.enter_async_context(
                    streamablehttp_client(self.config.url or "", headers=self.config.http_headers or None))
            # The SDK does not say when a stdio server exits; its read stream ending does.
            closed = asyncio.Event()
            session = await stack.enter_async_context(
                # _Watched has the read stream's interface; the SDK names its own class.
                ClientSession(_Watched(read, closed), write,  # type: ignore[arg-type]
                              message_handler=self._on_message))
            with anyio.fail_after(self.config.startup_timeout_sec):
                await session.initialize()
                await self._list_tools(session)
            self.session, self.state, self.error = session, "ready", None
            self.up.set()
            self.first_start.set()
            self._changed.set()
            log.info("mcp server %s ready: %d tools", self.name, len(self.tools))
            await closed.wait()

    async def _on_message(self, message: Any) -> None:
        notification = message.root if isinstance(message, types.ServerNotification) else None
        if isinstance(notification, types.ToolListChangedNotification):
            # Not awaited here: the answer to tools/list arrives through this same receive loop.
            session = self.session
            if session is not None:
                asyncio.get_running_loop().create_task(self._relist(session))

    async def _relist(self, session: ClientSession) -> None:
        try:
            await self._list_tools(session)
            self._changed.set()
            log.info("mcp server %s changed its tools: now %d", self.name, len(self.tools))
        except Exception as e:
            log.warning("mcp server %s: tools/list after list_changed failed: %s", self.name, describe(e))

    async def _list_tools(self, session: ClientSession) -> None:
        listed: list[types.Tool] = []
        cursor = None
        while True:
            page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
            listed += page.tools
            cursor = page.nextCursor
            if not cursor:
                break
        offered = [t for t in listed if self.config.offers(t.name)]
        deferred = self.config.deferred if self.config.deferred is not None else len(offered) > DEFER_ABOVE
        tools, checks, skipped = {}, {}, []
        for t in offered:
            why = unusable(t.name, t.inputSchema)
            try:
                check = output_check(t)
            except SchemaError as e:
                why = why or f"its outputSchema is not valid JSON Schema: {e.message}"
            if why:
                skipped.append(f"{t.name}: {why}")
                continue
            if check is not None:
                checks[t.name] = check
            record = McpToolRecord(server=self.name, name=t.name, description=t.description or "",
                                   input_schema=t.inputSchema, timeout=self.config.tool_timeout_sec,
                                   deferred=deferred)
            tools[t.name] = record.model_copy(update={"digest": tool_spec(record).digest()})
        self.tools, self.checks, self.skipped = tools, checks, skipped

    async def call(self, req: CallRequest) -> CallReply:
        if not self.up.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(self.config.startup_timeout_sec, req.timeout)):
                    await self.up.wait()
        session = self.session
        if session is None:
            return CallReply(refusal=f"MCP server {self.name} is not running ({self.error or 'starting'}); not run")
        record = self.tools.get(req.tool)
        if record is None:
            return CallReply(refusal=f"MCP server {self.name} no longer lists the tool {req.tool}; not run")
        if record.digest != req.digest:
            return CallReply(stale=True, refusal=(
                f"tool {self.name}.{req.tool} is declared differently by its MCP server now than in the call "
                f"(declaration {record.digest} != {req.digest}): the server listed its tools anew; not run"))
        check = self.checks.get(req.tool)  # the listing's, as the digest just checked
        # The SDK (1.x) sends no notifications/cancelled when a request's task is cancelled; this
        # host does. The id is the next one `send_request` takes: nothing runs between here and its send.
        request_id: int | None = getattr(session, "_request_id", None)
        me = asyncio.current_task()
        assert me is not None
        self.inflight.add(me)
        try:
            async with asyncio.timeout(req.timeout):
                result = await _call_tool(session, req)
        except TimeoutError:
            await _cancel(session, request_id, f"timed out after {req.timeout:g}s")
            return CallReply(timed_out=req.timeout)
        except asyncio.CancelledError:
            if me in self.crashed:
                me.uncancel()
                return self._crash_reply()
            await _cancel(session, request_id, "the call was cancelled")
            raise
        except McpError as e:
            if e.error.code == types.CONNECTION_CLOSED:
                return self._crash_reply()
            return CallReply(refusal=f"MCP server {self.name} refused the call: {e.error.message}")
        except Exception as e:
            return CallReply(refusal=f"MCP server {self.name} failed the call: {describe(e)}")
        finally:
            self.inflight.discard(me)
            self.crashed.discard(me)
        problem = check.problem(result) if check is not None else None
        if problem is not None:
            return CallReply(refusal=f"MCP server {self.name} failed the call: {problem}")
        return CallReply(result=map_result(result))

    def _crash_reply(self) -> CallReply:
        return CallReply(lost=f"MCP server {self.name} exited during the call and is being restarted")


class _Watched:
    """A transport's read stream that sets `closed` when it ends. Wrapped rather than relayed
    through a task: a relay costs every message of every call one more task switch."""

    def __init__(self, stream: Any, closed: asyncio.Event) -> None:
        self._stream, self._closed = stream, closed

    async def __aenter__(self) -> _Watched:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._stream.__aexit__(*exc)

    def __aiter__(self) -> _Watched:
        return self

    async def receive(self) -> Any:
        try:
            return await self._stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._closed.set()
            raise

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _call_tool(session: ClientSession, req: CallRequest) -> types.CallToolResult:
    """`ClientSession.call_tool` without its per-call output-schema check (`checks.py` has it
    compiled once per listing), and so without its `tools/list` when a tool is not in its cache."""
    params = types.CallToolRequestParams(name=req.tool, arguments=req.arguments)
    if req.trace is not None:  # W3C trace context in `_meta` (the MCP convention): the server's spans join
        meta = {"traceparent": req.trace.traceparent}
        if req.trace.tracestate:
            meta["tracestate"] = req.trace.tracestate
        params.meta = types.RequestParams.Meta(**meta)
    return await session.send_request(types.ClientRequest(types.CallToolRequest(params=params)),
                                      types.CallToolResult)


async def _cancel(session: ClientSession, request_id: int | None, reason: str) -> None:
    if request_id is None:
        return
    note = types.CancelledNotification(params=types.CancelledNotificationParams(requestId=request_id, reason=reason))
    with contextlib.suppress(Exception):  # the server may be gone; the call is over either way
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            await session.send_notification(types.ClientNotification(note))


def describe(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup) and e.exceptions:
        return describe(e.exceptions[0])
    if isinstance(e, TimeoutError):
        return "it did not finish starting in time"
    if isinstance(e, FileNotFoundError):
        return f"command not found: {e.filename}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Host:
    def __init__(self, config: HostConfig) -> None:
        self.changed = asyncio.Event()
        self.generation = config.first_generation
        self.servers = {name: Server(name, c, config.environments.get(name, {}), self.changed)
                        for name, c in config.servers.items()}

    def listing(self) -> Listing:
        if self.changed.is_set():
            self.changed.clear()
            self.generation += 1
        return Listing(generation=self.generation, servers=[s.snapshot() for s in self.servers.values()])

    def connection(self) -> Connection:
        return Connection(self)

    def answer(self, line: bytes) -> BaseModel | asyncio.Task[CallReply]:
        """A request's reply, or the task that will give it (a call)."""
        try:
            req = REQUEST.validate_json(line)
        except ValidationError as e:
            return CallReply(refusal=f"bad request to the MCP host: {e.errors()[0]['msg']}")
        if isinstance(req, ListRequest):
            return self.listing()
        server = self.servers.get(req.server)
        if server is None:
            return CallReply(refusal=f"no MCP server named {req.server} on this worker; not run")
        return asyncio.get_running_loop().create_task(server.call(req))


class Connection(asyncio.Protocol):
    """One client's connection (a pool child, or the worker's heartbeat): a request per line, each
    answered before the next is read. A protocol rather than a stream reader: a call costs one
    task, and a client that goes away mid-call (EOF) cancels it from `connection_lost`, which
    tells the server; a stream reader needed a second task per call just to watch for that EOF."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.call: asyncio.Task[CallReply] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        while self.call is None and self.transport is not None and b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            try:
                reply = self.host.answer(line)
            except Exception as e:  # a bug here must still answer, or the client waits forever
                log.exception("the MCP host failed a request")
                reply = CallReply(refusal=f"the MCP host failed the request: {describe(e)}")
            if isinstance(reply, asyncio.Task):
                self.call = reply
                reply.add_done_callback(self._answered)
            else:
                self._send(reply)

    def _answered(self, call: asyncio.Task[CallReply]) -> None:
        self.call = None
        if call.cancelled():
            return  # the client went away
        exc = call.exception()
        if exc is not None:
            log.error("the MCP host failed a call", exc_info=exc)
        failed = None if exc is None else CallReply(refusal=f"the MCP host failed the call: {describe(exc)}")
        self._send(call.result() if failed is None else failed)
        self._next()

    def _send(self, reply: BaseModel) -> None:
        if self.transport is not None:
            self.transport.write(reply.model_dump_json().encode() + b"\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.call is not None:
            self.call.cancel()


async def serve(socket_path: str, config: HostConfig) -> None:
    host = Host(config)
    parent = os.getppid()
    supervisors = [asyncio.create_task(s.supervise()) for s in host.servers.values()]
    await asyncio.gather(*(s.first_start.wait() for s in host.servers.values()))
    server = await asyncio.get_running_loop().create_unix_server(host.connection, path=socket_path)
    os.chmod(socket_path, 0o600)
    sys.stdout.write(host.listing().model_dump_json() + "\n")
    sys.stdout.flush()
    try:
        while os.getppid() == parent:  # the worker is gone (even by SIGKILL): so are we
            await asyncio.sleep(0.5)
    finally:
        server.close()
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*supervisors, return_exceptions=True)


def main() -> None:
    # Its servers run unsandboxed as the worker's user: none may read the worker's secrets.
    hardening.harden()
    hardening.drop_ptrace()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/mcp-host] %(message)s",
                        stream=sys.stderr)
    config = HostConfig.model_validate_json(sys.stdin.read())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(sys.argv[1], config))


if __name__ == "__main__":
    main()
