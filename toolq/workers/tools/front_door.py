"""The front doors' tools (issue 29): `process_start`, `process_write`, `process_terminate` and `fs`.

A front door (`toolq exec-server`) turns another agent's process and file requests into these
calls, so each one is a toolq call: in the ledger, under the fleet's limits, sandboxed, cancellable.
They are declared `offered=False`: no model or MCP client is ever offered them. A model that names
one anyway gets it as any call, and it is exactly as confined as `exec_command` (the same sandbox,
cell and conversation bounds) and the file tools (the same fd-confined operations).

`process_start` runs in the worker's session host as a session registered at once (its id from the
conversation's counter, so `process_write`/`process_terminate`, `route="session"`, reach it) and
appends all its output, as it comes, to a Redis stream as signed `ProcessEvent`s
(`toolq.core.front_doors`): `started`, the `output`s (at most CHUNK_BYTES each), then `exit`.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import os
import shlex
import stat
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import redis

from toolq.core.catalog import ToolContext, ToolReturn, tool
from toolq.core.errors import RespondToModel
from toolq.core.front_doors import (
    CHUNK_BYTES,
    FS,
    PROCESS_START,
    PROCESS_STREAM_BYTES,
    PROCESS_TERMINATE,
    PROCESS_TIMEOUT,
    PROCESS_WRITE,
    READ_FILE_BYTES,
    STREAM_CAP_NOTE,
    STREAM_TTL,
    WRITE_FILE_BYTES,
    FsErrorKind,
    FsRequest,
    FsResult,
    ProcessEvent,
    ProcessStartArgs,
    ProcessTerminateArgs,
    ProcessWriteArgs,
    process_stream_key,
    seal_event,
)
from toolq.core.signing import Signer
from toolq.workers.reading import read_at_most
from toolq.workers.sessions import calls as sessions
from toolq.workers.sessions.protocol import OutputFrame
from toolq.workers.workspace import NotARegularFile, Target, Workspace, describe, open_entry, resolve_in_workspace, walk

#: The shells whose `[shell, -c|-lc, cmd]` runs as that shell and that command (anything else is
#: an argv, run by bash as its shell-quoted words).
_SHELL_FLAGS = ("-c", "-lc")


class EventStream:
    """The events of one process, appended to its Redis stream in order, numbered from 1."""

    def __init__(self, r: redis.Redis, signer: Signer, key: str) -> None:
        self.r, self.signer, self.key = r, signer, key
        self.n = 0
        self.kept = 0
        """Output bytes appended so far (at most PROCESS_STREAM_BYTES)."""
        self.capped = False
        self.session_id: int | None = None
        """The session the process was registered as (its first frame names it)."""

    def append(self, *events: dict[str, Any]) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for fields in events:
                self.n += 1
                pipe.xadd(self.key, seal_event(self.signer, self.key, ProcessEvent(n=self.n, **fields)))  # type: ignore[arg-type]
            pipe.expire(self.key, STREAM_TTL)
            pipe.execute()

    def frame(self, frame: OutputFrame) -> None:
        """One frame from the session host: the first names the session, the rest are output."""
        if frame.session_id is not None:
            self.session_id = frame.session_id
            self.append({"kind": "started", "session_id": frame.session_id, "instance": frame.instance})
            return
        data = base64.b64decode(frame.progress)
        if self.capped or not data:
            return
        room = PROCESS_STREAM_BYTES - self.kept
        kept = data[:room]
        pieces = [{"kind": "output", "stream": frame.stream or "stdout", "data": _b64(kept[i:i + CHUNK_BYTES])}
                  for i in range(0, len(kept), CHUNK_BYTES)]
        self.kept += len(kept)
        if len(data) > room:  # the process reads on; what it prints from here is dropped
            self.capped = True
            pieces.append({"kind": "output", "stream": "stderr",
                           "data": _b64(STREAM_CAP_NOTE.encode())})
        self.append(*pieces)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _fleet_redis() -> tuple[redis.Redis, Signer]:
    """This worker's Redis and the fleet's signer (a pool child of a running worker has both)."""
    from toolq.core import signing
    from toolq.workers import app

    signer = signing.signer_for(app.app.conf.get(signing.CONF_KEY))
    if signer is None:
        raise RespondToModel("process_start refused: this worker has no TOOLQ_SIGNING_KEY to seal its events with")
    return app.redis_client(), signer


def shell_command(argv: list[str]) -> tuple[str, str]:
    """(shell, command) for an argv: `[sh, -c|-lc, cmd]` is sh running cmd; any other argv is bash
    running its words, shell-quoted."""
    if len(argv) == 3 and argv[1] in _SHELL_FLAGS:
        return argv[0], argv[2]
    return "bash", shlex.join(argv)


@tool(name=PROCESS_START, parameters=ProcessStartArgs.model_json_schema(), strict=False, offered=False,
      sessions=True, timeout=PROCESS_TIMEOUT, flower_args={"argv": "value"})
def process_start(args: ProcessStartArgs, ctx: ToolContext) -> ToolReturn:
    """Runs a process for a front door (toolq exec-server) and streams its output to `stream_key`.

    Never offered to a model; one that names it gets it exactly as confined as exec_command: the
    same sandbox (writes only inside the workspace, not `.git/`; no network; memory, process, CPU
    and file-size limits), the same cell, and the same bounds on the conversation's sessions.
    The process is a session at once (process_write and process_terminate name it); its output
    goes to the Redis stream `stream_key` as signed events (started, output..., exit), and the
    result is `{"exit_code": n, "session_id": s}` once it has exited.
    """
    if not _own_stream(args.stream_key, ctx.invocation.turn_id):
        raise RespondToModel("process_start refused: stream_key must name a process stream of this call's own turn "
                             "(toolq:proc:<turn>:<key>)")
    if not sessions.available(ctx):
        raise RespondToModel("process_start refused: it needs a conversation and a worker with a session host")
    shell, cmd = shell_command(args.argv)
    cwd = resolve_in_workspace(ctx.workspace, args.workdir) if args.workdir else Path(ctx.workspace)
    if not cwd.is_dir():  # said here in words (a sandbox may start the shell and fail there instead)
        raise RespondToModel(f"process_start failed: workdir {args.workdir}: "
                             f"{describe(OSError(errno.ENOENT, os.strerror(errno.ENOENT)))}")
    r, signer = _fleet_redis()
    events = EventStream(r, signer, args.stream_key)
    reply = sessions.start_in_host(cmd, shell=shell, cwd=cwd, tty=args.tty, pipe_stdin=args.pipe_stdin,
                                   env=args.env, ctx=ctx, frames=events.frame)
    if reply.spawn_errno is not None:
        raise RespondToModel(f"process_start failed: {describe(OSError(reply.spawn_errno, reply.spawn_strerror))}")
    if reply.exit_code is None:
        raise RespondToModel("process_start failed: the process did not end within its call")
    events.append({"kind": "exit", "exit_code": reply.exit_code, "note": reply.limit_note})
    result = {"exit_code": reply.exit_code, "session_id": events.session_id}
    return ToolReturn(output=json.dumps(result), success=reply.exit_code == 0, exit_code=reply.exit_code)


def _own_stream(key: str, turn_id: str) -> bool:
    """Whether `key` is a process stream of turn `turn_id`: the events it gets are signed with the
    fleet's key, so a caller (a model may name this tool) must not pick another turn's stream (a
    front door would push them to its client as its command's output) or any other key."""
    try:
        return process_stream_key(turn_id, key.removeprefix(f"toolq:proc:{turn_id}:")) == key
    except ValueError:
        return False


@tool(name=PROCESS_WRITE, parameters=ProcessWriteArgs.model_json_schema(), strict=False, offered=False,
      sessions=True, route="session", session_gone='{"status": "unknownProcess"}',
      flower_args={"session_id": "value", "data": "length"})
def process_write(args: ProcessWriteArgs, ctx: ToolContext) -> str:
    """Writes bytes (base64) to a front door's process's stdin at once: `{"status": "accepted" |
    "stdinClosed" | "unknownProcess"}`. Never offered to a model (as confined as write_stdin)."""
    try:
        base64.b64decode(args.data, validate=True)
    except binascii.Error:
        raise RespondToModel("process_write refused: data is not base64") from None
    if not sessions.available(ctx):
        return json.dumps({"status": "unknownProcess"})
    return json.dumps({"status": sessions.input_in_host(args.session_id, args.data, ctx).status})


@tool(name=PROCESS_TERMINATE, parameters=ProcessTerminateArgs.model_json_schema(), strict=False, offered=False,
      sessions=True, route="session", session_gone='{"running": false}', flower_args={"session_id": "value"})
def process_terminate(args: ProcessTerminateArgs, ctx: ToolContext) -> str:
    """Kills a front door's process (SIGKILL to its process group and cell): `{"running": true}` if
    it was running (its process_start then ends with exit 137), false if it had exited or is
    unknown. Never offered to a model."""
    if not sessions.available(ctx):
        return json.dumps({"running": False})
    return json.dumps({"running": bool(sessions.kill_in_host(args.session_id, ctx).running)})


# --- fs ------------------------------------------------------------------------------------


class FsFailure(Exception):
    def __init__(self, kind: FsErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_ERRORS: tuple[tuple[type[OSError], FsErrorKind], ...] = (
    (FileNotFoundError, "notFound"), (IsADirectoryError, "isDirectory"), (NotADirectoryError, "notDirectory"),
    (FileExistsError, "exists"), (PermissionError, "denied"), (NotARegularFile, "invalid"),
)


@tool(name=FS, parameters=FsRequest.model_json_schema(), strict=False, offered=False, whole_output=True,
      flower_args={"op": "value", "path": "value"})
def fs(args: FsRequest, ctx: ToolContext) -> ToolReturn:
    """One file operation for a front door, every path workspace-relative ("" is the root): the
    file tools' confined operations (no symlink followed out of the workspace, nothing under
    `.git` changed, FIFOs never waited on, at most 64 MiB read or written). The result is
    `{"ok": {...}}` or `{"error": {"kind", "message"}}`. Never offered to a model."""
    try:
        with Workspace(ctx.workspace) as ws:
            ok = _OPS[args.op](ws, args)
    except FsFailure as e:
        result = FsResult.failed(e.kind, str(e))
    except RespondToModel as e:  # a way out of the workspace, `..`, `.git`, a file with other hard links
        result = FsResult.failed("denied", str(e))
    except OSError as e:
        kind = next((k for cls, k in _ERRORS if isinstance(e, cls)), None)
        if kind is None:
            kind = "denied" if e.errno in (errno.ELOOP, errno.EXDEV, errno.EROFS) else "invalid"
        result = FsResult.failed(kind, describe(e))
    else:
        result = FsResult(ok=ok)
    return ToolReturn(output=result.to_json(), success=result.error is None)


def _metadata(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    target = ws.locate(args.path)
    link = False
    if target.rel.parts:
        parent = ws.directory_of(target)
        try:
            own = os.stat(target.rel.name, dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)
        link = stat.S_ISLNK(own.st_mode)
    try:
        fd = ws.open(target, os.O_PATH)
    except (RespondToModel, OSError):
        if not link:
            raise
        status = own  # a link out of the workspace (or to nothing): the link itself, never its target
    else:
        try:
            status = os.fstat(fd)
        finally:
            os.close(fd)
    return {"isDirectory": stat.S_ISDIR(status.st_mode), "isFile": stat.S_ISREG(status.st_mode),
            "isSymlink": link, "size": status.st_size, "createdAtMs": _ms(getattr(status, "st_birthtime", None)
                                                                            or status.st_ctime),
            "modifiedAtMs": _ms(status.st_mtime)}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _read_bytes(ws: Workspace, target: Target, limit: int) -> bytes:
    fd, status = ws.open_file(target)
    try:
        if status.st_size > limit:
            raise FsFailure("tooLarge", f"{target.given} is {status.st_size} bytes; at most {limit} are read")
        data = read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FsFailure("tooLarge", f"{target.given} is over {limit} bytes; at most {limit} are read")
    return data


def _read(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    return {"dataBase64": _b64(_read_bytes(ws, ws.locate(args.path), READ_FILE_BYTES))}


def _write(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    if args.data is None:
        raise FsFailure("invalid", "writeFile needs data (base64)")
    if len(args.data) > (WRITE_FILE_BYTES // 3 + 1) * 4:
        raise FsFailure("tooLarge", f"at most {WRITE_FILE_BYTES} bytes are written")
    try:
        data = base64.b64decode(args.data, validate=True)
    except binascii.Error:
        raise FsFailure("invalid", "data is not base64") from None
    ws.write_file(ws.locate(args.path), data)
    return {}


def _mkdir(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    ws.make_directory(ws.locate(args.path), parents=args.recursive)
    return {}


def _remove(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    target = ws.locate(args.path)
    ws.check_removable(target)
    parent = ws.directory_of(target)
    try:
        try:
            own = os.stat(target.rel.name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            if args.force:
                return {}
            raise
        if not stat.S_ISDIR(own.st_mode):  # a file, or a symlink itself (never what it points to)
            os.unlink(target.rel.name, dir_fd=parent)
        elif not args.recursive:
            os.rmdir(target.rel.name, dir_fd=parent)  # ENOTEMPTY unless empty
        else:
            _remove_tree(parent, target)
    finally:
        os.close(parent)
    return {}


def _remove_tree(parent: int, target: Target) -> None:
    """The directory `target` and all it holds removed by fd, bottom-up, never through a symlink.
    A tree holding a `.git` or a git directory of another name is not removed (the sandbox keeps
    them read-only): each directory is checked as it is listed, just before its entries go, so a
    repository a command moves into the tree meanwhile is found (or its folder's rmdir fails),
    never removed unseen (a check of the whole tree first, then a removal, lost that race)."""
    top = open_entry(parent, target.rel.name, directory=True)
    stack: list[tuple[int, str, list[os.DirEntry[str]]]] = []
    try:
        stack.append((top, target.rel.name, _listed_removable(top, target.given)))
        while stack:
            fd, name, entries = stack[-1]
            if not entries:
                stack.pop()
                os.close(fd)
                os.rmdir(name, dir_fd=stack[-1][0] if stack else parent)  # ENOTEMPTY if one came in
                continue
            entry = entries.pop()
            if entry.is_dir(follow_symlinks=False):
                sub = open_entry(fd, entry.name, directory=True)
                try:
                    stack.append((sub, entry.name, _listed_removable(sub, target.given)))
                except BaseException:
                    os.close(sub)
                    raise
            else:
                os.unlink(entry.name, dir_fd=fd)  # a file, a link (never what it names), a FIFO
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _listed_removable(fd: int, given: str) -> list[os.DirEntry[str]]:
    with os.scandir(fd) as it:
        entries = list(it)
    names = {e.name: e for e in entries}
    if any(n.lower() == ".git" for n in names) or (
            "HEAD" in names and names["HEAD"].is_file(follow_symlinks=False)
            and all(n in names and names[n].is_dir(follow_symlinks=False) for n in ("objects", "refs"))):
        raise FsFailure("denied", f"{given} holds a `.git` or a git directory, which is not removed")
    return entries


def _list(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    fd = ws.open_dir(ws.locate(args.path))
    try:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
    finally:
        os.close(fd)
    return {"entries": [{"fileName": e.name, "isDirectory": e.is_dir(follow_symlinks=False),
                         "isFile": e.is_file(follow_symlinks=False), "isSymlink": e.is_symlink()} for e in entries]}


def _copy(ws: Workspace, args: FsRequest) -> dict[str, Any]:
    if args.to is None:
        raise FsFailure("invalid", "copy needs `to`, the destination")
    source, dest = ws.locate(args.path), ws.locate(args.to)
    fd = ws.open(source, os.O_RDONLY | os.O_NONBLOCK)
    try:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        if not is_dir:
            os.close(fd)
            fd = -1
            ws.write_file(dest, _read_bytes(ws, source, READ_FILE_BYTES))
            return {}
        if not args.recursive:
            raise FsFailure("isDirectory", f"{args.path} is a directory: copy it with recursive")
        if dest.rel.parts[:len(source.rel.parts)] == source.rel.parts:
            raise FsFailure("invalid", f"cannot copy {args.path} into itself")
        _copy_tree(ws, fd, dest)
    finally:
        if fd >= 0:
            os.close(fd)
    return {}


def _copy_tree(ws: Workspace, top: int, dest: Target) -> None:
    """The tree open at `top` copied to `dest`: directories and regular files (at most
    READ_FILE_BYTES in all), symlinks as the same links; nothing followed, nothing else copied."""
    budget = READ_FILE_BYTES
    made: set[tuple[int, int]] = set()
    """The directories this copy made: never walked into (a destination inside the source through
    a link, `copy a alias/b` with `alias -> a`, would copy itself without end)."""

    def make(to: Target) -> None:
        ws.make_directory(to, parents=True)
        fd = ws.open(to, os.O_PATH | os.O_DIRECTORY)
        try:
            status = os.fstat(fd)
        finally:
            os.close(fd)
        made.add((status.st_dev, status.st_ino))

    def enter(entry: os.DirEntry[str]) -> bool:
        status = entry.stat(follow_symlinks=False)
        return (status.st_dev, status.st_ino) not in made

    make(dest)
    with closing(walk(top, enter=enter)) as tree:
        for fd, where, entries in tree:
            here = dest.rel / where if where else dest.rel
            for e in entries:
                to = Target(f"{dest.given}/{where}/{e.name}".replace("//", "/"), here / e.name)
                if e.is_dir(follow_symlinks=False):
                    if enter(e):
                        make(to)
                elif e.is_symlink():
                    _link_like(ws, to, os.readlink(e.name, dir_fd=fd))
                elif e.is_file(follow_symlinks=False):
                    budget -= _copy_file(ws, fd, e.name, to, budget)


def _copy_file(ws: Workspace, dir_fd: int, name: str, to: Target, budget: int) -> int:
    src = open_entry(dir_fd, name)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            return 0
        data = read_at_most(src, budget + 1)
    finally:
        os.close(src)
    if len(data) > budget:
        raise FsFailure("tooLarge", f"the tree is over {READ_FILE_BYTES} bytes; at most that much is copied")
    ws.write_file(to, data)
    return len(data)


def _link_like(ws: Workspace, to: Target, link: str) -> None:
    ws.check_removable(to)  # its directory is no `.git`
    parent = ws.directory_of(to)
    try:
        os.symlink(link, to.rel.name, dir_fd=parent)
    finally:
        os.close(parent)


_OPS: dict[str, Callable[[Workspace, FsRequest], dict[str, Any]]] = {
    "getMetadata": _metadata, "readFile": _read, "writeFile": _write, "createDirectory": _mkdir,
    "remove": _remove, "readDirectory": _list, "copy": _copy,
}
