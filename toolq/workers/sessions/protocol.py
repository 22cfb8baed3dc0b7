"""What a pool child and its worker's session host say to each other: one JSON line each way."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter


class _Request(BaseModel):
    conversation: str
    """Sessions answer only their own conversation."""
    yield_ms: float
    stream: bool = False
    """Send the output as it comes, in `OutputFrame` lines before the reply (the call streams it)."""


class ExecRequest(_Request):
    op: Literal["exec"] = "exec"
    cmd: str
    shell: str = "bash"
    cwd: str
    workspace: str
    env: dict[str, str]
    tty: bool = False
    front_door: bool = False
    """A front door's process (`process_start`): registered as a session at once, every output byte
    streamed (`OutputFrame`s tagged with their stream) until it exits; the reply is its exit."""
    pipe_stdin: bool = False
    """Front door, no tty: stdin is a pipe `InputRequest`s write to (else it is closed)."""
    extra_env: dict[str, str] = {}
    """Front door: set on top of the command's environment, inside the sandbox only."""
    traced: bool = False
    """The call is traced: the reply says when the spawn began and ended (`toolq.sandbox.start`)."""


class WriteRequest(_Request):
    op: Literal["write"] = "write"
    session_id: int
    chars: str = ""


class InputRequest(_Request):
    """A front door's write (`process_write`): the bytes go to the session's stdin at once."""

    op: Literal["input"] = "input"
    session_id: int
    data: str
    """base64 of the bytes."""


class KillRequest(_Request):
    """A front door's terminate (`process_terminate`): SIGKILL the session's process group."""

    op: Literal["kill"] = "kill"
    session_id: int


Request = ExecRequest | WriteRequest | InputRequest | KillRequest
_REQUEST: TypeAdapter[Request] = TypeAdapter(Annotated[Request, Field(discriminator="op")])


def parse_request(line: bytes) -> Request:
    return _REQUEST.validate_json(line)


class OutputFrame(BaseModel):
    """A piece of a running command's output, sent before the reply to a request that streams."""

    progress: str
    """base64 of the bytes."""
    stream: Literal["stdout", "stderr", "pty"] | None = None
    """Front door: where the bytes came from."""
    session_id: int | None = None
    """Front door: the first frame (no bytes) names the session the process was registered as..."""
    instance: str | None = None
    """...and the worker instance that holds it."""


class Reply(BaseModel):
    output: str = ""
    """base64 of the output produced since the previous call on this process."""
    exit_code: int | None = None
    """Set once the process has exited (and its output is all in)."""
    session_id: int | None = None
    """Set while it is still running."""
    wall_time: float = 0.0
    error: str | None = None
    """A model-visible failure text."""
    limit_note: str | None = None
    """The sandbox limit the command ran into, in words."""
    spawn_errno: int | None = None
    spawn_strerror: str | None = None
    status: Literal["accepted", "stdinClosed", "unknownProcess"] | None = None
    """An `InputRequest`'s answer."""
    running: bool | None = None
    """A `KillRequest`'s answer: whether a live process was killed."""
    spawn_started: float | None = None
    """A traced `ExecRequest`: when the host began the spawn (epoch seconds)..."""
    spawn_ended: float | None = None
    """...when the command was spawned in its sandbox..."""
    sandbox: str | None = None
    """...and the sandbox's backend."""
