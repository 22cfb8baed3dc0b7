"""`toolq mcp-server`'s server: the official `mcp` SDK's low-level `Server`, whose tools are the
fleet's and whose every `tools/call` is a toolq turn (calls.py), over stdio or streamable HTTP.

- An MCP client session is one toolq conversation (its exec_command sessions live as long as it,
  so write_stdin works across its calls) and, with `--upload/--git/--from`, one environment made
  at its first call and destroyed when the session ends.
- `notifications/cancelled` (or the client going away) cancels the call's turn as `toolq cancel`
  does: its worker task is revoked and its processes killed.
- A call with a `progressToken` gets its streamed output (an exec_command's) as
  `notifications/progress` messages; `progress` counts the characters sent so far.
- A task-augmented call (MCP tasks) answers at once with a task (id = the turn id) and runs on in
  this process, even past its client's session; tasks.py keeps its state in Redis, so any replica
  answers `tasks/get`, `tasks/result` and `tasks/cancel`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.models import InitializationOptions
from mcp.server.session import ServerSession
from mcp.shared.exceptions import McpError
from mcp.shared.experimental.tasks.helpers import RELATED_TASK_METADATA_KEY

from toolq.core.signing import required_signer
from toolq.core.tracing import TraceContext
from toolq.frontdoors.mcp_server.calls import CallOutcome, error_result, run_call
from toolq.frontdoors.mcp_server.tasks import POLL_MS, TERMINAL, TaskRecord, TaskStore
from toolq.frontdoors.mcp_server.tools import Offered, offered_tools
from toolq.orchestrator.environments import Environment
from toolq.orchestrator.fleet import Fleet, new_turn_id
from toolq.orchestrator.transport.conversation import ConversationLease, new_conversation_id
from toolq.orchestrator.turn_scope import stop
from toolq.telemetry import tracing

log = logging.getLogger("toolq.mcp_server")

#: Makes a client session's environment (`fleet.environment(upload=...)`), or None: the shared workspace.
EnvironmentFactory = Callable[[Fleet], Environment]
#: How long a stopping server waits for its cancelled calls to record their ends.
STOP_WAIT = 15.0
#: How long `tasks/result` waits for a task cancelled elsewhere to get its result from its runner.
CANCELLED_RESULT_WAIT = 10.0


class ClientState:
    """One MCP client session's toolq side: its conversation and its environment, both made at its
    first call and ended once the session and every task it started are over."""

    def __init__(self, fleet: Fleet, make_environment: EnvironmentFactory | None) -> None:
        self.fleet = fleet
        self.conversation = ConversationLease(fleet.ledger.r, new_conversation_id())
        self._make_environment = make_environment
        self.environment: Environment | None = None
        self._lock = asyncio.Lock()
        self._users = 1
        """The session itself, and each of its tasks still running."""

    async def ready(self) -> Environment | None:
        async with self._lock:
            await self.conversation.hold()
            if self._make_environment is not None and self.environment is None:
                self.environment = await self._make_environment(self.fleet).open()
            return self.environment

    def enter(self) -> None:
        self._users += 1

    async def leave(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        try:
            await self.conversation.release()  # its exec_command sessions are killed
        finally:
            if self.environment is not None:
                await self.environment.aclose()


class _TaskServer(Server[ClientState, Any]):
    """The SDK's low-level server, saying it takes task-augmented `tools/call`s and `tasks/cancel`
    (its own task machinery, deprecated and per process, is not used: tasks.py is)."""

    def get_capabilities(self, notification_options: Any, experimental_capabilities: Any) -> types.ServerCapabilities:
        capabilities = super().get_capabilities(notification_options, experimental_capabilities)
        capabilities.tasks = types.ServerTasksCapability(
            cancel=types.TasksCancelCapability(),
            requests=types.ServerTasksRequestsCapability(tools=types.TasksToolsCapability(
                call=types.TasksCallCapability())))
        return capabilities


class McpFrontDoor:
    """The fleet's tools as one MCP server (the same for every transport and every client session)."""

    def __init__(self, fleet: Fleet, *, make_environment: EnvironmentFactory | None = None) -> None:
        self.fleet = fleet
        self.make_environment = make_environment
        tracing.setup(tracing.MCP_SERVER)  # off unless OTEL_* turn it on
        self.tasks = TaskStore(fleet.ledger, required_signer(fleet.settings.signing_key, "toolq mcp-server"))
        self._background: set[asyncio.Task[Any]] = set()
        self._running: dict[str, asyncio.Task[Any]] = {}
        """The calls running here, by turn: `stop_calls` cancels their turns."""
        self._answering: set[asyncio.Task[Any]] = set()
        """The requests of plain calls not answered yet: a stop waits for their answers."""
        try:
            version = metadata.version("toolq")
        except metadata.PackageNotFoundError:
            version = "0"
        self.server: Server[ClientState, Any] = _TaskServer("toolq", version=version, lifespan=self._client_session,
                                                         instructions="The tools of a toolq worker fleet: each "
                                                         "call runs on a worker, sandboxed, recorded in toolq's "
                                                         "ledger; `toolq cancel TURN` stops one (its turn is in "
                                                         "the result's _meta).")
        handlers: dict[type, Callable[[Any], Awaitable[types.ServerResult]]] = {
            types.ListToolsRequest: self._list_tools, types.CallToolRequest: self._call_tool,
            types.GetTaskRequest: self._get_task, types.GetTaskPayloadRequest: self._task_result,
            types.CancelTaskRequest: self._cancel_task}
        self.server.request_handlers.update(handlers)

    def options(self) -> InitializationOptions:
        return self.server.create_initialization_options()

    @asynccontextmanager
    async def _client_session(self, _server: Server[ClientState, Any]) -> AsyncIterator[ClientState]:
        session = ClientState(self.fleet, self.make_environment)
        try:
            yield session
        finally:
            with anyio.CancelScope(shield=True):  # a session ended by a shutdown still releases its own
                await _logged(session.leave(), "could not end an MCP client session's conversation")

    async def stop_calls(self) -> None:
        """A stop's first step, while the transport still carries answers: every call and task
        running here has its turn cancelled at once, as `toolq cancel` does (worker tasks revoked,
        processes killed, tasks recorded cancelled), and each plain call in flight is answered with
        its aborted output (`isError`) before this returns (at most STOP_WAIT)."""
        turns = list(self._running)
        await asyncio.gather(*(_logged(self.fleet.ledger.cancel_turn(turn_id, reason="toolq mcp-server stopped"),
                                       f"could not cancel {turn_id}") for turn_id in turns))
        waiting = [*self._running.values(), *self._answering]
        if waiting:
            await asyncio.wait(waiting, timeout=STOP_WAIT)

    async def aclose(self) -> None:
        """Stop the calls and tasks still running here (`stop_calls`), then whatever is left."""
        await self.stop_calls()
        for task in list(self._background):
            await stop(task)

    # --- tools ---------------------------------------------------------------------------------

    async def offered(self) -> dict[str, Offered]:
        await self.fleet.follow_fleet_tools()  # the MCP servers live workers host now
        registry = self.fleet.registry
        return offered_tools(registry.model_visible_specs(frozenset(s.tool_name for s in registry.catalog)))

    async def _list_tools(self, _req: types.ListToolsRequest) -> types.ServerResult:
        return types.ServerResult(types.ListToolsResult(tools=[o.tool for o in (await self.offered()).values()]))

    async def _call_tool(self, req: types.CallToolRequest) -> types.ServerResult:
        ctx = self.server.request_context
        turn_id = new_turn_id()
        try:
            offered = (await self.offered()).get(req.params.name)
            if offered is None:
                return types.ServerResult(error_result(f"unknown tool {req.params.name!r}: tools/list names the "
                                                       "fleet's tools"))
            record = await self.tasks.create(turn_id, req.params.task.ttl) if req.params.task is not None else None
        except Exception as e:  # Redis away: the answer says so
            return types.ServerResult(_failed(f"toolq could not start the call: {e}").result)
        arguments = req.params.arguments or {}
        trace = client_trace(req.params.meta) if tracing.on() else None
        session = ctx.lifespan_context
        if record is not None:
            session.enter()  # the conversation lives on for the task, past the client's session
            self._spawn(self._run_task(session, offered, arguments, turn_id, trace))
            return types.ServerResult(types.CreateTaskResult(task=record.task()))
        token = ctx.meta.progressToken if ctx.meta is not None else None
        progress = Progress(ctx.session, token, ctx.request_id) if token is not None else None
        run = asyncio.create_task(self._run(session, offered, arguments, turn_id, progress, trace))
        me = asyncio.current_task()
        if me is not None:
            self._answering.add(me)
        try:
            outcome = await asyncio.shield(run)  # a cancelled request must not cancel the turn's own task
        except asyncio.CancelledError:  # notifications/cancelled, or the client went away
            self._spawn(self.fleet.ledger.cancel_turn(turn_id, reason="MCP client cancelled the call"))
            self._keep(run)
            raise
        finally:
            if me is not None:
                self._answering.discard(me)
            if progress is not None:
                await progress.close()
        return types.ServerResult(outcome.result)

    async def _run(self, session: ClientState, offered: Offered, arguments: dict[str, Any], turn_id: str,
                   progress: Progress | None, trace: TraceContext | None = None) -> CallOutcome:
        """Every failure is the call's answer (an `isError` result saying why in one line)."""
        me = asyncio.current_task()
        assert me is not None
        self._running[turn_id] = me
        try:
            try:
                environment = await session.ready()
            except Exception as e:  # the environment could not be made (no host, an upload refused...)
                return _failed(f"toolq could not make this session's environment: {e}")
            try:
                return await run_call(self.fleet, offered, arguments, turn_id=turn_id,
                                      conversation=session.conversation.id, environment=environment,
                                      on_output=progress, trace=trace)
            except Exception as e:  # the fleet itself (Redis away, a workspace refused)
                return _failed(f"toolq could not run the call: {e}")
        finally:
            self._running.pop(turn_id, None)

    async def _run_task(self, session: ClientState, offered: Offered, arguments: dict[str, Any],
                        turn_id: str, trace: TraceContext | None = None) -> None:
        try:
            outcome = await self._run(session, offered, arguments, turn_id, None, trace)
        except asyncio.CancelledError:  # this server stops: the task's turn with it
            await self.fleet.ledger.cancel_turn(turn_id, reason="toolq mcp-server stopped")
            await self.tasks.finish(turn_id, "cancelled", "toolq mcp-server stopped", error_result("cancelled"))
            raise
        finally:
            await _logged(session.leave(), "could not end an MCP client session's conversation")
        await self.tasks.finish(turn_id, outcome.ending, outcome.message, outcome.result)

    # --- tasks ---------------------------------------------------------------------------------

    async def _task(self, task_id: str) -> TaskRecord:
        record = await self.tasks.get(task_id)
        if record is None:
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS, message=f"Task not found: {task_id}"))
        return record

    async def _get_task(self, req: types.GetTaskRequest) -> types.ServerResult:
        task = (await self._task(req.params.taskId)).task()
        return types.ServerResult(types.GetTaskResult(**task.model_dump()))

    async def _task_result(self, req: types.GetTaskPayloadRequest) -> types.ServerResult:
        """Waits for the task to end (as the spec asks), then its `CallToolResult`."""
        task_id = req.params.taskId
        waited_cancelled = 0.0
        while True:
            record = await self._task(task_id)
            if record.result is not None:
                break
            if record.status == "failed" or (record.status == "cancelled" and waited_cancelled > CANCELLED_RESULT_WAIT):
                record.result = error_result(record.message or record.status).model_dump(mode="json", by_alias=True,
                                                                                          exclude_none=True)
                break
            if record.status == "cancelled":
                waited_cancelled += POLL_MS / 1000
            await asyncio.sleep(POLL_MS / 1000)
        meta = {**(record.result.get("_meta") or {}), RELATED_TASK_METADATA_KEY: {"taskId": task_id}}
        return types.ServerResult(types.GetTaskPayloadResult.model_validate({**record.result, "_meta": meta}))

    async def _cancel_task(self, req: types.CancelTaskRequest) -> types.ServerResult:
        task_id = req.params.taskId
        if (record := await self._task(task_id)).status in TERMINAL:
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS,
                                           message=f"Cannot cancel task {task_id}: it is already {record.status}"))
        record = await self._task(task_id) if (got := await self.tasks.cancel(task_id)) is None else got
        return types.ServerResult(types.CancelTaskResult(**record.task().model_dump()))

    # --- background work -------------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        self._keep(asyncio.create_task(work))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a task that outlives its request until it ends (a lost one's error is logged)."""
        if task.done():
            return
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("an MCP call's background work failed: %s", t.exception())

        task.add_done_callback(done)


class Progress:
    """A call's streamed output as `notifications/progress` messages on its request, in order."""

    def __init__(self, session: ServerSession, token: str | int, request_id: Any) -> None:
        self.session, self.token, self.request_id = session, token, request_id
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self._sent = 0
        self._sender = asyncio.ensure_future(self._send())

    def __call__(self, piece: str) -> None:
        self._pieces.put_nowait(piece)

    async def _send(self) -> None:
        while (piece := await self._pieces.get()) is not None:
            self._sent += len(piece)
            try:
                await self.session.send_progress_notification(self.token, float(self._sent), None, piece,
                                                              related_request_id=self.request_id)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the client went away

    async def close(self) -> None:
        """Send what is queued, then stop (the result follows the last piece)."""
        self._pieces.put_nowait(None)
        with anyio.CancelScope(shield=True):
            try:
                await asyncio.wait_for(asyncio.shield(self._sender), 5.0)
            except (TimeoutError, asyncio.CancelledError):
                pass
        self._sender.cancel()


def client_trace(meta: Any) -> TraceContext | None:
    """The W3C trace context a client put in its request's `_meta` (`traceparent`, `tracestate`,
    as MCP's trace-context convention has it), checked; None when there is none or it is not one.
    Only the client's own request gives one: a call's arguments never do."""
    extra = getattr(meta, "model_extra", None) if meta is not None else None
    if not extra:
        return None
    return tracing.parse_traceparent(extra.get("traceparent"), extra.get("tracestate"))


def _failed(message: str) -> CallOutcome:
    log.warning("%s", message)
    return CallOutcome(error_result(message), "failed", message)


async def _logged(work: Awaitable[Any], what: str) -> None:
    try:
        await work
    except Exception as e:
        log.warning("%s: %s", what, e)
