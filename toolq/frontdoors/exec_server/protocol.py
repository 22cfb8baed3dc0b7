"""Codex's exec-server protocol as Codex CLI 0.171.0 speaks it: JSON-RPC messages without the
`jsonrpc` field, one per WebSocket text frame or stdio line, requests pipelined (answered in any
order), and the error codes Codex reacts to (-32004 is how apply_patch learns a path is missing).

Everything here is pure: decoding a frame, checking a method's params (as serde would word the
error), and building the frames toolq sends."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from pydantic.alias_generators import to_camel

NOT_FOUND = -32004
"""A path that does not exist (fs ENOENT): apply_patch creates the parent folder only on this code."""
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
PARSE_ERROR = -32700

#: The largest frame toolq reads: fs/writeFile of the largest file the `fs` tool takes (64 MiB) in base64.
MAX_MESSAGE_BYTES = 96 << 20

ENOENT_MESSAGE = "No such file or directory (os error 2)"
SHELL = {"name": "bash", "path": "/bin/bash"}
"""The shell Codex puts in argv[0] of every command (`environmentInfo.shell`)."""


class RpcError(Exception):
    """One error answer: `{"id": N, "error": {"code", "message", "data"?}}`."""

    def __init__(self, code: int, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def to_wire(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def not_found() -> RpcError:
    return RpcError(NOT_FOUND, ENOENT_MESSAGE)


@dataclass(frozen=True)
class Request:
    id: int | str
    method: str
    params: Any


@dataclass(frozen=True)
class Notification:
    method: str
    params: Any


class Undecodable(Exception):
    """A frame that is no request nor notification; `id` when one could be read (then it is answered)."""

    def __init__(self, error: RpcError, id: int | str | None = None) -> None:
        super().__init__(error.message)
        self.error, self.id = error, id


def decode(frame: str | bytes) -> Request | Notification:
    """One frame → a request or a notification; `Undecodable` otherwise (never another exception)."""
    try:
        message = json.loads(frame)
    except (ValueError, RecursionError) as e:
        raise Undecodable(RpcError(PARSE_ERROR, f"not JSON: {e}")) from None
    if not isinstance(message, dict):
        raise Undecodable(RpcError(INVALID_REQUEST, "a message is a JSON object"))
    id_ = message.get("id")
    if isinstance(id_, bool) or not isinstance(id_, (int, str, type(None))):
        raise Undecodable(RpcError(INVALID_REQUEST, "`id` is a number or a string"))
    method = message.get("method")
    if not isinstance(method, str) or not method:
        raise Undecodable(RpcError(INVALID_REQUEST, "missing field `method`"), id_)
    params = message.get("params")
    return Notification(method, params) if id_ is None else Request(id_, method, params)


def result_frame(id_: int | str | None, result: Any) -> dict[str, Any]:
    return {"id": id_, "result": result}


def error_frame(id_: int | str | None, error: RpcError) -> dict[str, Any]:
    return {"id": id_, "error": error.to_wire()}


def notification_frame(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"method": method, "params": params}


def encode(frame: dict[str, Any]) -> str:
    return json.dumps(frame, separators=(",", ":"), ensure_ascii=False)


# ---- params, named as Codex names them (camelCase on the wire) ---------------------------------

class Params(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class InitializeParams(Params):
    client_name: str | None = None
    resume_session_id: str | None = None


class ProcessStartParams(Params):
    process_id: str
    argv: list[str]
    cwd: str
    env: dict[str, str] = {}
    tty: bool = False
    pipe_stdin: bool = False
    arg0: str | None = None
    sandbox: Any = None
    """Codex's portable sandbox policy (None: none asked): toolq's cell applies whatever it says,
    and a policy stricter than the cell is refused (`policy.refusal`)."""

    @field_validator("argv")
    @classmethod
    def _argv(cls, argv: list[str]) -> list[str]:
        if not argv:
            raise ValueError("argv must not be empty")
        return argv

    @field_validator("process_id")
    @classmethod
    def _process_id(cls, process_id: str) -> str:
        if not process_id or len(process_id) > 1000:
            raise ValueError("processId must be 1 to 1000 characters")
        return process_id


class ProcessParams(Params):
    process_id: str


class ProcessWriteParams(ProcessParams):
    chunk: str
    write_id: str | None = None


class ProcessReadParams(ProcessParams):
    after_seq: int | None = None
    max_bytes: int | None = None
    wait_ms: int | None = None


class FsParams(Params):
    path: str
    sandbox: Any = None


class FsWriteFileParams(FsParams):
    data_base64: str


class FsCreateDirectoryParams(FsParams):
    recursive: bool = True


class FsRemoveParams(FsParams):
    recursive: bool = True
    force: bool = True


class FsCopyParams(Params):
    source_path: str
    destination_path: str
    recursive: bool = False
    sandbox: Any = None


P = TypeVar("P", bound=Params)


def parse_params(model: type[P], params: Any) -> P:
    """The method's params, or -32602 worded as Codex's server words it (``missing field `argv` ``)."""
    try:
        return model.model_validate(params if params is not None else {})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "params"
        if first["type"] == "missing":
            raise RpcError(INVALID_PARAMS, f"missing field `{where}`") from None
        if first["type"] == "value_error":  # our own validators' sentences
            raise RpcError(INVALID_PARAMS, str(first["ctx"]["error"])) from None
        raise RpcError(INVALID_PARAMS, f"invalid `{where}`: {first['msg']}") from None


def decode_base64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RpcError(INVALID_PARAMS, f"`{field}` is not base64") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
