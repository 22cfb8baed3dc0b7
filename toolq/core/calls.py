"""Calls as toolq sees them, from the router to the queue and back.

`ToolCall` is what the router makes of a call item; `ToolInvocation` is a bound, validated call
that travels to a worker as JSON; `ToolResult` comes back. These are the queue's contract, read
by both the orchestrator and the workers.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from toolq.core import untrusted
from toolq.core.environments import EnvRef
from toolq.core.items import (
    ContentPart,
    CustomToolCallOutputItem,
    FunctionCallOutputItem,
    InputText,
    OutputItem,
    ToolOutputBody,
    ToolSearchOutputItem,
)
from toolq.core.permits import Permit
from toolq.core.states import CallState
from toolq.core.tracing import TraceContext

PayloadKind = Literal["function", "custom", "tool_search"]

#: Codex's `functions` namespace also names the top-level tools (`functions.exec_command`).
FUNCTIONS_NAMESPACE = "functions"


class ToolName(BaseModel):
    """Registry identity: `search` and `workspace/search` are different tools."""

    model_config = ConfigDict(frozen=True)

    namespace: str | None = None
    name: str

    @classmethod
    def plain(cls, name: str) -> ToolName:
        return cls(name=name)

    @classmethod
    def namespaced(cls, namespace: str, name: str) -> ToolName:
        return cls(namespace=namespace, name=name)

    def display(self) -> str:
        # Codex joins them with no separator: `unsupported call: no_such_nsexec_command`.
        return f"{self.namespace or ''}{self.name}"

    def __str__(self) -> str:
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


class FunctionPayload(BaseModel):
    kind: Literal["function"] = "function"
    arguments: str
    """The model's raw JSON text, parsed by the tool's own argument type."""


class CustomPayload(BaseModel):
    kind: Literal["custom"] = "custom"
    input: str


class ToolSearchArgs(BaseModel):
    """A client `tool_search_call`'s arguments, as the model sends them (unknown keys ignored)."""

    model_config = ConfigDict(extra="ignore")
    query: str
    limit: int | None = Field(default=None, json_schema_extra={"type": "number"})


class ToolSearchPayload(BaseModel):
    kind: Literal["tool_search"] = "tool_search"
    query: str
    limit: int | None = None


ToolPayload = Annotated[
    FunctionPayload | CustomPayload | ToolSearchPayload, Field(discriminator="kind")
]


class ToolCall(BaseModel):
    tool_name: ToolName
    call_id: str
    payload: ToolPayload


class ToolInvocation(BaseModel):
    """A call that passed the registry: safe to queue. JSON-serialisable."""

    turn_id: str
    step: int
    output_index: int
    call_id: str
    tool_name: ToolName
    payload: ToolPayload
    deadline: float
    """Epoch seconds after which the call must not start (and is cut off)."""
    workspace: str | None = None
    spec_digest: str = ""
    """Digest of the tool declaration the orchestrator validated against; workers refuse a mismatch."""
    conversation: str | None = None
    """Set by a `Session`: the exec_command sessions this call starts or uses belong to it."""
    stream_output: bool = False
    """Someone watches the turn: publish a running command's output (toolq/workers/streaming.py)."""
    environment: EnvRef | None = None
    """The environment the call runs in (toolq/core/environments.py): only a worker on its host
    runs it, with the environment as its workspace (`workspace` is then unused)."""
    permit: Permit | None = None
    """The tool's max_concurrency permit the orchestrator took for this call: the worker renews it
    while the call runs and releases it at the end (toolq/core/permits.py)."""
    trace: TraceContext | None = None
    """The call's `execute_tool` span (toolq/core/tracing.py), set by the orchestrator only when
    tracing is on: the worker's spans are its children. Inside the signed body, so a worker joins
    only the trace its orchestrator named."""
    sent_at: float | None = None
    """Epoch seconds the task message was made (`Dispatcher._message`): the queue wait starts here."""

    @property
    def task_id(self) -> str:
        return task_id_for(self.turn_id, self.step, self.output_index, self.call_id)


def task_id_for(turn_id: str, step: int, output_index: int, call_id: str) -> str:
    """Deterministic and unique per call: two calls sharing a call_id differ by output index.

    The call_id is the model's text, so it is hashed to keep ids short and URL-safe for Flower.
    """
    digest = hashlib.sha256(call_id.encode()).hexdigest()[:12]
    return f"{turn_id}:{step}:{output_index}:{digest}"


class ToolResult(BaseModel):
    """What a call produced: the model-visible output and what the user wants to see."""

    call_id: str
    output: ToolOutputBody
    status: CallState = CallState.COMPLETED
    """A terminal state (`toolq.core.states`)."""
    success: bool | None = None
    """Internal, like Codex's: never put on the wire."""
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    tools: list[dict[str, Any]] | None = None
    """tool_search results: the specs the search found."""

    @field_validator("output", "tools", mode="before")
    @classmethod
    def _valid_utf8(cls, value: Any) -> Any:
        # Tool output is the outside world's text: a non-UTF-8 file name (`surrogateescape`) or a
        # lone surrogate would raise UnicodeEncodeError in whatever encodes it next (Redis, the
        # next request, the terminal). Each one becomes U+FFFD here, on both sides of the queue.
        return untrusted.scrub(_plain(value))

    @property
    def duration(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def output_text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(p.text for p in self.output if isinstance(p, InputText) and p.text)


def _plain(value: Any) -> Any:
    """Content parts given as models, as the dicts `scrub` walks (validation rebuilds them)."""
    if isinstance(value, list):
        return [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
    return value


def aborted_text(shell_like: bool, elapsed: float) -> str:
    """Codex's text for a call cut short by a cancel (docs/reference/codex-behaviour.md#cancel)."""
    secs = max(elapsed, 0.1)
    if shell_like:
        return f"Wall time: {secs:.1f} seconds\naborted by user"
    return f"aborted by user after {secs:.1f}s"


def output_item(
    kind: PayloadKind, call_id: str, output: ToolOutputBody | list[ContentPart], tools: list[dict] | None = None
) -> OutputItem:
    """The output item a payload kind calls for: the one place that maps kind to output type."""
    if kind == "tool_search":
        return ToolSearchOutputItem(call_id=call_id, tools=tools or [])
    if kind == "custom":
        return CustomToolCallOutputItem(call_id=call_id, output=output)
    return FunctionCallOutputItem(call_id=call_id, output=output)
