"""A client session (an exec-server `sessionId`): one toolq conversation (its processes are toolq
sessions, which die with it), two turns (`calls.py`), optionally one environment made for it, and
its process table.

A process is a `process_start` call: its events come through a Redis stream the worker appends to
(`toolq.core.front_doors`), read here and pushed to the attached client (`processes.ProcessLog`
numbers them). The connection may drop: the session is kept, its processes running and their
events retained, for `resume_seconds`; a client that comes back with `resumeSessionId` gets it
again and catches up with `process/read`. Past that the session is reaped: its processes killed
(the conversation released), its turns ended, its environment destroyed."""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from toolq.core.environments import EnvSource
from toolq.core.front_doors import (
    FS,
    PROCESS_START,
    PROCESS_TERMINATE,
    PROCESS_WRITE,
    FsRequest,
    FsResult,
    ProcessEvent,
    ProcessStartArgs,
    open_event,
    process_stream_key,
)
from toolq.core.signing import Signer
from toolq.frontdoors.exec_server import policy
from toolq.frontdoors.exec_server.calls import READ_SHARE, Calls, PayloadBudget, new_call_id
from toolq.frontdoors.exec_server.paths import Root, file_uri, local_path
from toolq.frontdoors.exec_server.processes import Event, ProcessLog
from toolq.frontdoors.exec_server.protocol import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    SHELL,
    FsCopyParams,
    FsCreateDirectoryParams,
    FsParams,
    FsRemoveParams,
    FsWriteFileParams,
    ProcessParams,
    ProcessReadParams,
    ProcessStartParams,
    ProcessWriteParams,
    RpcError,
    decode_base64,
    not_found,
    parse_params,
)
from toolq.orchestrator.environments import Environment
from toolq.orchestrator.fleet import Fleet
from toolq.orchestrator.transport.conversation import ConversationLease, new_conversation_id
from toolq.orchestrator.turn_scope import stop

log = logging.getLogger("toolq.exec_server")

#: How long a stream read blocks before it looks whether the call itself ended (a worker lost).
READ_BLOCK_MS = 250
#: After a resume, a process's events wait this long for the client's `process/read` catch-up
#: before they are pushed (Codex reads each live process at once; a client that does not still
#: gets everything, in order).
RESUME_HOLD = 1.0
#: The longest `process/read` long-poll (`waitMs`).
MAX_WAIT_MS = 30_000
#: Finished processes remembered per session (for `process/read` and `process/terminate`).
KEEP_FINISHED = 64
#: How long a reaped session waits for each process to be killed, then for its end.
KILL_WAIT = 10.0
#: How long `process/write`/`terminate` wait for a process whose call has not started yet.
START_WAIT = 30.0


@dataclass
class Context:
    """What every session of one server shares."""

    fleet: Fleet
    root: Root
    source: EnvSource | Path | None
    """The environment each session gets (made from it), or None: the fleet's shared workspace."""
    streams: Redis
    """The Redis the workers append process events to; blocking reads use their own connections."""
    signer: Signer
    resume_seconds: float
    payloads: PayloadBudget = field(default_factory=PayloadBudget)
    """File contents in flight through Redis, over every session (`calls.PAYLOAD_BUDGET`)."""


Push = Callable[[dict[str, Any]], None]


class Process:
    def __init__(self, params: ProcessStartParams, turn_id: str) -> None:
        self.id = params.process_id
        self.tty, self.pipe_stdin = params.tty, params.pipe_stdin
        self.log = ProcessLog(self.id)
        self.stream_key = process_stream_key(turn_id, process_key(self.id))
        self.call_id = new_call_id()
        self.session_id: int | None = None
        self.started = asyncio.Event()
        self.done = asyncio.Event()
        self.held = False
        """Resumed: events wait for the client's catch-up read (or RESUME_HOLD) before they are pushed."""
        self.writing = asyncio.Lock()
        """Writes reach the process in the order they came."""
        self.task: asyncio.Task[None] | None = None
        self.stopped: str | None = None
        """Why the server ended it (`ExecSession.stop`): its end is exit -1 with this line on stderr."""

    async def started_or_done(self, seconds: float) -> None:
        waits = [asyncio.create_task(self.started.wait()), asyncio.create_task(self.done.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


#: How a digested key ends: an id that ends so is digested too, so no id is another's key.
_DIGESTED = re.compile(r"-[0-9a-f]{16}\Z")


def process_key(process_id: str) -> str:
    """A client's processId as a stream key's last part: itself when it is one, else a readable
    prefix and a digest (two ids never share a key)."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "_.:-") else "_" for c in process_id)
    if safe == process_id and len(safe) <= 200 and not _DIGESTED.search(safe):  # else it could be another's
        return safe
    return f"{safe[:150]}-{sha256(process_id.encode()).hexdigest()[:16]}"


class ExecSession:
    def __init__(self, ctx: Context, on_closed: Callable[[ExecSession], None]) -> None:
        self.ctx = ctx
        self.id = str(uuid.uuid4())
        self.conversation = ConversationLease(ctx.fleet.ledger.r, new_conversation_id())
        self.environment = Environment(ctx.fleet.environments, ctx.source, lease=self.conversation) \
            if ctx.source is not None else None
        self.calls = Calls(ctx.fleet, self.conversation.id, self.environment)
        self.processes: dict[str, Process] = {}
        self._push: Push | None = None
        self._ready: asyncio.Task[None] | None = None
        self._reaper: asyncio.TimerHandle | None = None
        self._closing: asyncio.Future[None] | None = None
        self._on_closed = on_closed
        self.closed = False

    # ---- life ------------------------------------------------------------------------------

    def open(self) -> None:
        """Hold the conversation and make the environment in the background: `initialize` is
        answered at once (Codex gives it 10 s), the first call waits for them."""
        self._ready = asyncio.create_task(self._open())
        log.info("exec-server session %s: turn %s (control calls on %s), conversation %s", self.id,
                 self.calls.turn_id, self.calls.control_turn, self.conversation.id)

    async def _open(self) -> None:
        await self.conversation.hold()
        if self.environment is not None:
            await self.environment.open()

    async def ready(self) -> None:
        if self._ready is None:
            raise RpcError(INTERNAL_ERROR, "the session is not open")
        try:
            await asyncio.shield(self._ready)
        except Exception as e:
            raise RpcError(INTERNAL_ERROR, one_line(f"toolq could not open this session (its conversation or "
                                                    f"environment): {e}")) from None

    def attach(self, push: Push, *, resumed: bool) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        self._push = push
        if resumed:
            for proc in self.processes.values():
                proc.held = True
            asyncio.get_running_loop().call_later(RESUME_HOLD, self._release_held)

    def detach(self, push: Push) -> None:
        """The connection that pushed with `push` went away: keep the session for `resume_seconds`."""
        if self._push != push or self.closed:  # bound methods: equal, never the same object
            return  # another connection resumed it meanwhile
        self._push = None
        self._reaper = asyncio.get_running_loop().call_later(self.ctx.resume_seconds, self._reap)

    def _reap(self) -> None:
        self._closing = asyncio.ensure_future(self.close())  # held: the loop keeps only a weak reference

    async def close(self) -> None:
        """Reap: kill the processes still running, end the turns, destroy the environment and
        release the conversation (whose toolq sessions its hosts then kill, whatever was missed). Once."""
        if self.closed:
            return
        self.closed = True
        self._push = None
        if self._reaper is not None:
            self._reaper.cancel()
        self._on_closed(self)
        running = [p for p in self.processes.values() if not p.done.is_set()]
        log.info("exec-server session %s ends: %d process(es) still running are killed", self.id, len(running))
        await asyncio.gather(*(self._kill(p) for p in running))
        try:
            if self._ready is not None:
                await stop(self._ready)
            if self.environment is not None:
                await self.environment.destroy()  # releases the conversation too (its lease)
        except Exception as e:  # its host's reaper destroys it once the conversation's key is gone
            log.warning("session %s: could not destroy its environment: %s", self.id, e)
        finally:
            await self.conversation.release()
        try:
            await self.calls.end()
        except Exception as e:
            log.warning("session %s: could not record the end of its turns: %s", self.id, e)

    async def stop(self, reason: str) -> None:
        """The server stops: end the session as a reap does, but first tell the attached client how
        each live process ended (its remaining output, then toolq's `reason` on stderr, exited -1,
        closed), so it finishes the command at once instead of trying to resume. Both turns are
        cancelled as `toolq cancel` does (the calls revoked, the processes killed), so they are
        recorded cancelled."""
        if self.closed:
            return
        running = [p for p in self.processes.values() if not p.done.is_set()]
        for proc in running:
            if not proc.log.exited:
                proc.stopped = reason
        ledger = self.ctx.fleet.ledger
        for turn in (self.calls.turn_id, self.calls.control_turn):
            try:
                await ledger.cancel_turn(turn, reason=reason)
            except Exception as e:  # the reap below still kills them, through their conversation
                log.warning("session %s: could not cancel %s: %s", self.id, turn, e)
        if running:
            await asyncio.wait([asyncio.create_task(p.done.wait()) for p in running], timeout=KILL_WAIT)
        for proc in running:  # the rest of a process whose end did not come in time
            if not proc.done.is_set():
                self._emit(proc, proc.log.output("stderr", reason_line(reason)))
                self._emit(proc, proc.log.close(-1))
        await self.close()

    async def _kill(self, proc: Process) -> None:
        try:
            await asyncio.wait_for(self.process_terminate({"processId": proc.id}), KILL_WAIT)
            await asyncio.wait_for(proc.done.wait(), KILL_WAIT)
        except Exception as e:  # the conversation's release kills it on its host
            log.warning("session %s: process %s did not end when killed: %s", self.id, proc.id, e)
        if proc.task is not None:
            await stop(proc.task)

    # ---- pushing events --------------------------------------------------------------------------

    def _flush(self, proc: Process) -> None:
        if self._push is None or proc.held:
            return
        for event in proc.log.unsent():
            self._send(proc, event)

    def _send(self, proc: Process, event: Event) -> None:
        if self._push is not None:
            method, params = event.notification(proc.id)
            self._push({"method": method, "params": params})

    def _release_held(self) -> None:
        for proc in self.processes.values():
            if proc.held:
                proc.held = False
                self._flush(proc)

    # ---- requests --------------------------------------------------------------------------------

    def environment_info(self) -> dict[str, Any]:
        return {"shell": SHELL, "cwd": self.ctx.root.uri}

    async def handle(self, method: str, params: Any) -> Any:
        """One request's result; RpcError for an error answer."""
        handler = HANDLERS.get(method)
        if handler is None:
            raise RpcError(-32601, f"toolq exec-server does not implement `{method}`")
        return await handler(self, params)

    async def process_start(self, params: Any) -> dict[str, Any]:
        p = parse_params(ProcessStartParams, params)
        if p.process_id in self.processes:
            raise RpcError(INVALID_REQUEST, f"process {p.process_id} already exists")
        if (why := policy.refusal(p.sandbox, self.ctx.root.path)) is not None:
            raise RpcError(INTERNAL_ERROR, why)
        workdir = self.ctx.root.relative(p.cwd)
        if workdir is None:
            raise spawn_not_found(f"{local_path(p.cwd)} is outside the workspace toolq serves ({self.ctx.root.path})")
        proc = self.processes[p.process_id] = Process(p, self.calls.turn_id)  # a pipelined duplicate sees it
        try:
            await self.ready()
            if workdir and not await self._is_directory(workdir):
                raise spawn_not_found()
        except BaseException:
            del self.processes[p.process_id]
            raise
        args = ProcessStartArgs(argv=p.argv, workdir=workdir or None, env=p.env, tty=p.tty,
                                pipe_stdin=p.pipe_stdin, stream_key=proc.stream_key)
        proc.task = asyncio.create_task(self._run(proc, args.model_dump()))
        self._forget_finished()
        return {"processId": p.process_id}

    async def _is_directory(self, workdir: str) -> bool:
        _, reply = await self.calls.run(FS, FsRequest(op="getMetadata", path=workdir).model_dump(exclude_none=True))
        ok = reply.get("ok") if isinstance(reply, dict) else None
        return isinstance(ok, dict) and bool(ok.get("isDirectory"))

    def _forget_finished(self) -> None:
        finished = [pid for pid, proc in self.processes.items() if proc.done.is_set()]
        for pid in finished[:max(0, len(finished) - KEEP_FINISHED)]:
            del self.processes[pid]

    async def _run(self, proc: Process, args: dict[str, Any]) -> None:
        """The process's call, and its stream read until its exit (or the call's end without one)."""
        call = asyncio.create_task(self.calls.run(PROCESS_START, args, control=False, call_id=proc.call_id))
        try:
            await self._follow(proc, call)
            if proc.stopped is not None and not proc.log.exited:  # the server stopped it: why, then exit -1
                self._emit(proc, proc.log.output("stderr", reason_line(proc.stopped)))
            elif not proc.log.exited:  # the call ended with no exit: toolq's reason, then exit -1
                text, reply = await call
                code = reply.get("exit_code") if isinstance(reply, dict) else None
                if isinstance(code, int) and not isinstance(code, bool):
                    self._emit(proc, proc.log.exit(code))
                else:
                    self._emit(proc, proc.log.output("stderr", reason_line(text)))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("process %s: %s", proc.id, e)
            self._emit(proc, proc.log.output("stderr", reason_line(f"toolq lost this process: {e}")))
        finally:
            self._emit(proc, proc.log.close(-1))
            proc.done.set()
            if not call.done():
                await stop(call)
            elif not call.cancelled() and call.exception() is not None:
                log.warning("process %s: its call failed: %s", proc.id, call.exception())
            try:
                await self.ctx.streams.delete(proc.stream_key)
            except Exception as e:  # it expires by itself (STREAM_TTL)
                log.debug("could not delete %s: %s", proc.stream_key, e)

    async def _follow(self, proc: Process, call: asyncio.Task[Any]) -> None:
        last, expected = "0-0", 1
        while not proc.log.exited:
            ended = call.done()
            found: Any = await self.ctx.streams.xread({proc.stream_key: last}, count=512,
                                                 block=None if ended else READ_BLOCK_MS)
            entries = [entry for _, items in found or [] for entry in items]
            for entry_id, fields in entries:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                event = open_event(self.ctx.signer, proc.stream_key, fields)
                if event is None:
                    log.warning("process %s: an entry of its stream is not genuine; skipped", proc.id)
                    continue
                if event.n < expected:  # a genuine entry of this stream written again: a replay
                    log.warning("process %s: stream entry %d replayed (%d was due); skipped", proc.id, event.n,
                                expected)
                    continue
                if event.n != expected:
                    log.warning("process %s: stream entry %d where %d was due", proc.id, event.n, expected)
                expected = event.n + 1
                self._apply(proc, event)
            if ended and not entries:
                return

    def _apply(self, proc: Process, event: ProcessEvent) -> None:
        if event.kind == "started":
            proc.session_id = event.session_id
            proc.started.set()
        elif event.kind == "output" and event.data:
            self._emit(proc, proc.log.output(event.stream or "stdout", base64.b64decode(event.data)))
        elif event.kind == "exit" and proc.stopped is not None:  # killed by the stop: its end is the stop's
            return
        elif event.kind == "exit":
            if event.note:
                self._emit(proc, proc.log.output("stderr", reason_line(event.note)))
            self._emit(proc, proc.log.exit(event.exit_code if event.exit_code is not None else -1))

    def _emit(self, proc: Process, events: list[Event]) -> None:
        if events:
            self._flush(proc)

    async def process_write(self, params: Any) -> dict[str, Any]:
        p = parse_params(ProcessWriteParams, params)
        decode_base64(p.chunk, "chunk")
        proc = self.processes.get(p.process_id)
        if proc is None:
            return {"status": "unknownProcess"}
        if not (proc.tty or proc.pipe_stdin):
            return {"status": "stdinClosed"}
        async with proc.writing:
            await proc.started_or_done(START_WAIT)
            if proc.session_id is None or proc.log.exited:
                return {"status": "stdinClosed"}
            text, reply = await self.calls.run(PROCESS_WRITE, {"session_id": proc.session_id, "data": p.chunk})
        status = reply.get("status") if isinstance(reply, dict) else None
        if status not in ("accepted", "stdinClosed", "unknownProcess"):
            raise RpcError(INTERNAL_ERROR, one_line(text))
        return {"status": status}

    async def process_terminate(self, params: Any) -> dict[str, Any]:
        p = parse_params(ProcessParams, params)
        proc = self.processes.get(p.process_id)
        if proc is None or proc.log.exited:
            return {"running": False}
        if proc.session_id is None:  # queued or throttled: it never runs
            await self.calls.cancel_call(proc.call_id)
            await proc.started_or_done(START_WAIT)
            if proc.session_id is None:
                return {"running": True}
        if proc.log.exited:
            return {"running": False}
        text, reply = await self.calls.run(PROCESS_TERMINATE, {"session_id": proc.session_id})
        if not isinstance(reply, dict) or not isinstance(reply.get("running"), bool):
            raise RpcError(INTERNAL_ERROR, one_line(text))
        return {"running": reply["running"]}

    async def process_read(self, params: Any) -> dict[str, Any]:
        p = parse_params(ProcessReadParams, params)
        proc = self.processes.get(p.process_id)
        if proc is None:
            raise RpcError(INVALID_REQUEST, f"unknown process id {p.process_id}")
        await proc.log.wait(p.after_seq, min(p.wait_ms or 0, MAX_WAIT_MS) / 1000)
        result = proc.log.read(p.after_seq, p.max_bytes)
        proc.held = False  # caught up: what comes next is pushed
        self._flush(proc)
        return result

    # ---- files -------------------------------------------------------------------------------------

    async def _fs(self, op: str, uri: str, sandbox: Any, *, write: bool, to: str | None = None,
                  **fields: Any) -> dict[str, Any]:
        path = self._served(uri, write=write)
        target = self._served(to, write=True) if to is not None else None
        if write and (why := policy.refusal(sandbox, self.ctx.root.path)) is not None:
            raise RpcError(INTERNAL_ERROR, why)
        await self.ready()
        request = FsRequest.model_validate({"op": op, "path": path, "to": target, **fields})
        share = len(request.data or "") if op == "writeFile" else READ_SHARE if op == "readFile" else 0
        async with self.ctx.payloads.hold(share):
            text, reply = await self.calls.run(FS, request.model_dump(exclude_none=True))
        try:
            result = FsResult.model_validate(reply)
        except ValueError:
            raise RpcError(INTERNAL_ERROR, one_line(text)) from None
        if result.error is not None:
            raise fs_error(result.error.kind, result.error.message, local_path(uri))
        return result.ok or {}

    def _served(self, uri: str, *, write: bool) -> str:
        """The workspace path of `uri`; outside the workspace a read is "not found" (no call), a write refused."""
        relative = self.ctx.root.relative(uri)
        if relative is not None:
            return relative
        if write:
            raise RpcError(INTERNAL_ERROR, f"{local_path(uri)} is outside the workspace toolq serves "
                                           f"({self.ctx.root.path}): toolq writes nothing there")
        raise not_found()

    async def fs_get_metadata(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsParams, params)
        return await self._fs("getMetadata", p.path, p.sandbox, write=False)

    async def fs_read_file(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsParams, params)
        return await self._fs("readFile", p.path, p.sandbox, write=False)

    async def fs_read_directory(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsParams, params)
        return await self._fs("readDirectory", p.path, p.sandbox, write=False)

    async def fs_write_file(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsWriteFileParams, params)
        decode_base64(p.data_base64, "dataBase64")
        return await self._fs("writeFile", p.path, p.sandbox, write=True, data=p.data_base64)

    async def fs_create_directory(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsCreateDirectoryParams, params)
        return await self._fs("createDirectory", p.path, p.sandbox, write=True, recursive=p.recursive)

    async def fs_remove(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsRemoveParams, params)
        return await self._fs("remove", p.path, p.sandbox, write=True, recursive=p.recursive, force=p.force)

    async def fs_copy(self, params: Any) -> dict[str, Any]:
        p = parse_params(FsCopyParams, params)
        return await self._fs("copy", p.source_path, p.sandbox, write=True, to=p.destination_path,
                              recursive=p.recursive)

    async def fs_canonicalize(self, params: Any) -> dict[str, Any]:
        """Lexical: `..` folded. Links are the worker's to resolve, and it never follows one out."""
        return {"path": file_uri(local_path(parse_params(FsParams, params).path))}

    async def environment_info_method(self, params: Any) -> dict[str, Any]:
        return self.environment_info()


def spawn_not_found(message: str = "No such file or directory (os error 2)") -> RpcError:
    return RpcError(INTERNAL_ERROR, message, {"kind": "spawnNotFound"})


def fs_error(kind: str, message: str, path: str) -> RpcError:
    """The `fs` tool's error kind as the code Codex acts on (-32004: apply_patch makes the parent)."""
    if kind == "notFound":
        return not_found()
    if kind == "isDirectory":
        return RpcError(INVALID_REQUEST, f"path `{path}` is not a file")
    if kind == "invalid":
        return RpcError(INVALID_PARAMS, one_line(message))
    return RpcError(INTERNAL_ERROR, one_line(message))


def one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def reason_line(text: str) -> bytes:
    """toolq's word on a process, as a line of its stderr."""
    return f"\n[toolq: {one_line(text)}]\n".encode()


HANDLERS = {
    "process/start": ExecSession.process_start,
    "process/write": ExecSession.process_write,
    "process/terminate": ExecSession.process_terminate,
    "process/read": ExecSession.process_read,
    "fs/getMetadata": ExecSession.fs_get_metadata,
    "fs/readFile": ExecSession.fs_read_file,
    "fs/writeFile": ExecSession.fs_write_file,
    "fs/createDirectory": ExecSession.fs_create_directory,
    "fs/remove": ExecSession.fs_remove,
    "fs/readDirectory": ExecSession.fs_read_directory,
    "fs/copy": ExecSession.fs_copy,
    "fs/canonicalize": ExecSession.fs_canonicalize,
    "environment/info": ExecSession.environment_info_method,
}
