"""What a front door (toolq exec-server, issue 29) and the worker's front-door tools share.

A front door turns another agent's process and file requests into toolq calls: `process_start`
runs a command in the worker's session host and its pool child appends the command's output, as it
comes, to a Redis stream (`process_stream_key`) as signed `ProcessEvent`s: `started` first, then
`output`s, then `exit`, numbered 1, 2, ... with no gap. The front door reads the stream and pushes
the events to its client; `process_write`/`process_terminate` reach the same session
(`route="session"`), and `fs` is one confined file operation (`FsRequest` in, `FsResult` out).

Import-safe: no Redis, no Celery, nothing of the workers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolq.core.signing import Signer

PROCESS_START = "process_start"
PROCESS_WRITE = "process_write"
PROCESS_TERMINATE = "process_terminate"
FS = "fs"
#: The front-door tools: front doors call them, a model is never offered them (`ToolSpec.offered`).
FRONT_DOOR_TOOLS = (PROCESS_START, PROCESS_WRITE, PROCESS_TERMINATE, FS)




#: A front door's process lives at most this long (its call's timeout; `TOOLQ_TOOL_LIMITS` may lower
#: it). As exec_command's: a worker's graceful stop waits for its longest tool, and the deploy
#: files' grace periods follow it (tests/unit/test_deploy.py).
PROCESS_TIMEOUT = 300.0
"""A front-door process's call timeout, in seconds (TOOLQ_TOOL_LIMITS may lower it)."""
PROCESS_STREAM_BYTES = 16 << 20
"""At most this many output bytes of one process are kept in its stream; the rest is read and dropped."""
STREAM_TTL = 600
"""Seconds a process's stream key lives after its last entry."""
CHUNK_BYTES = 8192
"""At most this many bytes per `output` event (Codex's own chunk size)."""
READ_FILE_BYTES = 64 << 20
"""The largest file `fs` readFile returns (larger: a `tooLarge` error)."""
WRITE_FILE_BYTES = 64 << 20
"""The largest data `fs` writeFile takes."""

_PROCESS_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
#: The note of the one `output` entry written when a process passes PROCESS_STREAM_BYTES.
STREAM_CAP_NOTE = f"\n[toolq: output past {PROCESS_STREAM_BYTES >> 20} MiB not kept]\n"
#: The stream entry's fields: the event's canonical JSON and its signature.
EVENT_FIELD = "event"
SIG_FIELD = "sig"


def process_stream_key(turn_id: str, process_key: str) -> str:
    """The Redis stream a process's events go to: `toolq:proc:<turn>:<key>`.

    `process_key` is the front door's own name for the process (sanitised: `[A-Za-z0-9_.:-]{1,200}`);
    anything else is a ValueError."""
    if not _PROCESS_KEY.fullmatch(process_key):
        raise ValueError("a process key is 1 to 200 of the characters A-Z a-z 0-9 _ . : -")
    if not turn_id:
        raise ValueError("a process stream needs a turn id")
    return f"toolq:proc:{turn_id}:{process_key}"


class ProcessEvent(BaseModel):
    """One entry of a process's stream, in order."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["started", "output", "exit"]
    n: int = Field(ge=1)
    """1, 2, ... per stream, gap-free (the writer's own counter)."""
    session_id: int | None = None
    """started: the toolq session the process is (process_write/process_terminate name it)."""
    instance: str | None = None
    """started: the worker instance holding the session."""
    stream: Literal["stdout", "stderr", "pty"] | None = None
    """output: where the bytes came from (`pty` for a tty process)."""
    data: str | None = None
    """output: the bytes, base64."""
    exit_code: int | None = None
    """exit: the process's exit code (128+n when a signal n ended it)."""
    note: str | None = None
    """exit: a limit toolq hit (the sandbox's time or memory cap, ...), in words."""


def _body(event: ProcessEvent) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude_none=True)


def seal_event(signer: Signer, key: str, event: ProcessEvent) -> dict[str, str]:
    """The XADD fields of `event` on stream `key`: its JSON and a signature over key + event."""
    body = _body(event)
    return {EVENT_FIELD: json.dumps(body, sort_keys=True, separators=(",", ":")),
            SIG_FIELD: signer.seal_process_event(key, body)}


def _text(value: bytes | str | None) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value


def open_event(signer: Signer, key: str, fields: Mapping[bytes | str, bytes | str]) -> ProcessEvent | None:
    """The event an entry of stream `key` holds, or None when it is forged, altered, moved or malformed."""
    text: dict[str, str | None] = {}
    for name, value in fields.items():
        label = _text(name)
        if label is not None:
            text[label] = _text(value)
    raw, sig = text.get(EVENT_FIELD), text.get(SIG_FIELD)
    if raw is None or sig is None:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # a forged entry of deep JSON: refused as any other
        return None
    if not signer.process_event_genuine(key, body, sig):
        return None
    try:
        return ProcessEvent.model_validate(body)
    except ValidationError:
        return None


FsOp = Literal["getMetadata", "readFile", "writeFile", "createDirectory", "remove", "readDirectory", "copy"]
FsErrorKind = Literal["notFound", "isDirectory", "notDirectory", "exists", "denied", "invalid", "tooLarge"]


class FsRequest(BaseModel):
    """The `fs` tool's arguments: one file operation, every path workspace-relative ("" = the root)."""

    model_config = ConfigDict(extra="forbid")

    op: FsOp
    path: str
    to: str | None = None
    """copy: the destination."""
    data: str | None = None
    """writeFile: the bytes, base64."""
    recursive: bool = False
    """createDirectory: make the parents too; remove/copy: a directory with what it holds."""
    force: bool = False
    """remove: a missing path is no error."""


class FsError(BaseModel):
    kind: FsErrorKind
    message: str


class FsResult(BaseModel):
    """The `fs` tool's JSON result: `{"ok": {...}}` or `{"error": {"kind", "message"}}`.

    ok per op: getMetadata {isDirectory, isFile, isSymlink, size, createdAtMs, modifiedAtMs};
    readFile {dataBase64}; readDirectory {entries: [{fileName, isDirectory, isFile, isSymlink}]};
    the others {}."""

    ok: dict[str, Any] | None = None
    error: FsError | None = None

    @classmethod
    def failed(cls, kind: FsErrorKind, message: str) -> FsResult:
        return cls(error=FsError(kind=kind, message=message))

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


class ProcessStartArgs(BaseModel):
    """`process_start`'s arguments."""

    model_config = ConfigDict(extra="forbid")

    argv: list[str] = Field(min_length=1)
    workdir: str | None = None
    """Workspace-relative; None: the workspace's root."""
    env: dict[str, str] = Field(default_factory=dict)
    """Set on top of the command's usual environment, inside the sandbox only."""
    tty: bool = False
    pipe_stdin: bool = False
    """Without tty: keep stdin open for process_write (else it is closed)."""
    stream_key: str
    """The Redis stream the events go to (`process_stream_key`)."""


class ProcessWriteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: int
    data: str
    """The bytes to write to the process's stdin, base64."""


class ProcessTerminateArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: int
