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


class WriteRequest(_Request):
    op: Literal["write"] = "write"
    session_id: int
    chars: str = ""


Request = ExecRequest | WriteRequest
_REQUEST: TypeAdapter[Request] = TypeAdapter(Annotated[Request, Field(discriminator="op")])


def parse_request(line: bytes) -> Request:
    return _REQUEST.validate_json(line)


class OutputFrame(BaseModel):
    """A piece of a running command's output, sent before the reply to a request that streams."""

    progress: str
    """base64 of the bytes."""


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
