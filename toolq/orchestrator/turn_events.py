"""What a turn tells its watchers: typed events, shaped like `codex exec --json`.

`turn.started`, `item.started` / `item.updated` / `item.completed`, `error`, `turn.completed` /
`turn.failed`, and toolq's `turn.aborted`. Items are toolq's `tool_call` (with Codex's `status`:
in_progress / completed / failed, and toolq's finer `state`), `agent_message` and `reasoning`;
a call of exec_command, apply_patch or update_plan is Codex's `command_execution`, `file_change` or
`todo_list` item (with toolq's call fields besides). Every event carries a `timestamp` (epoch
seconds; Codex's events have none). The live view reads the fields; `--json` writes `to_json()` one
per line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from toolq.core.environments import TurnDiff
from toolq.core.states import CallState


class _Json(BaseModel):
    def to_json(self) -> dict[str, Any]:
        d = self.model_dump(mode="json", exclude_none=True)
        return {"type": d.pop("type"), **d} if "type" in d else d  # `type` first, as Codex writes it


class _Event(_Json):
    timestamp: float = Field(default_factory=time.time)
    """When it happened (epoch seconds)."""


class ToolCallView(_Json):
    """One call as the user sees it."""

    id: str
    """The call's `call_id`."""
    type: Literal["tool_call"] = "tool_call"
    tool: str
    status: Literal["in_progress", "completed", "failed"]
    """As `codex exec --json` reports items: a command that exited non-zero is `failed`."""
    state: CallState
    """toolq's own state: which kind of failure, or where an unfinished call is."""
    step: int
    worker: str | None = None
    success: bool | None = None
    exit_code: int | None = None
    reason: str | None = None
    """For a failed call: why, in one line (`exit code 3`, the tool's error, the timeout...); for a
    throttled one, the limit it waits for."""
    output: str | None = None
    """The start of the model-visible output (2,000 characters at most)."""
    queue_wait: float | None = None
    """Seconds from the call's dispatch to a worker starting it."""
    run_time: float | None = None
    """Seconds the worker spent on it."""
    round_trip: float | None = None
    """Seconds from the model's item to the call's output."""


class CommandExecutionView(ToolCallView):
    """An exec_command call (or a write_stdin to its session: `command` is the session's) as
    Codex's `command_execution` item; `aggregated_output` grows in
    `item.updated` events while it runs (streamed by the worker, shown only: the call's output is
    its signed result), and on completion is the result's output section."""

    type: Literal["command_execution"] = "command_execution"  # type: ignore[assignment]
    command: str
    aggregated_output: str = ""


class FileUpdateChange(BaseModel):
    path: str
    kind: Literal["add", "delete", "update"]


class FileChangeView(ToolCallView):
    """An apply_patch call as Codex's `file_change` item: the files its patch names."""

    type: Literal["file_change"] = "file_change"  # type: ignore[assignment]
    changes: list[FileUpdateChange] = Field(default_factory=list)


class TodoItem(BaseModel):
    text: str
    completed: bool


class TodoListView(ToolCallView):
    """An update_plan call as Codex's `todo_list` item: its plan's steps."""

    type: Literal["todo_list"] = "todo_list"  # type: ignore[assignment]
    items: list[TodoItem] = Field(default_factory=list)


class AgentMessageView(_Json):
    id: str | None = None
    type: Literal["agent_message"] = "agent_message"
    text: str


class ReasoningView(_Json):
    id: str | None = None
    type: Literal["reasoning"] = "reasoning"
    text: str


ItemView = Annotated[
    ToolCallView | CommandExecutionView | FileChangeView | TodoListView | AgentMessageView | ReasoningView,
    Field(discriminator="type"),
]


class TurnStarted(_Event):
    type: Literal["turn.started"] = "turn.started"
    turn_id: str
    trace_id: str | None = None
    """The turn's trace (OpenTelemetry, hex) when tracing is on: its spans, the workers' too."""


class _ItemEvent(_Event):
    item: ItemView

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        if isinstance(self.item, CommandExecutionView):
            d["item"].setdefault("exit_code", None)  # Codex writes `"exit_code": null` while it runs
        return d


class ItemStarted(_ItemEvent):
    type: Literal["item.started"] = "item.started"


class ItemUpdated(_ItemEvent):
    type: Literal["item.updated"] = "item.updated"


class ItemCompleted(_ItemEvent):
    type: Literal["item.completed"] = "item.completed"


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    message: str


class TurnCompleted(_Event):
    type: Literal["turn.completed"] = "turn.completed"
    turn_id: str
    trace_id: str | None = None
    usage: dict[str, Any] = Field(default_factory=dict)
    environment: str | None = None
    """The environment the turn ran in (issue 28); absent for the shared workspace."""
    checkpoint: str | None = None
    """The checkpoint taken at the turn's end: `toolq run --from` it."""
    diff: TurnDiff | None = None
    """What the turn changed: a unified diff of text files, binary and deleted files."""


class TurnError(BaseModel):
    message: str


class TurnFailed(_Event):
    type: Literal["turn.failed"] = "turn.failed"
    turn_id: str
    trace_id: str | None = None
    error: TurnError


class TurnAborted(_Event):
    type: Literal["turn.aborted"] = "turn.aborted"
    turn_id: str
    trace_id: str | None = None
    reason: str = "interrupted"


TurnEvent = Annotated[
    TurnStarted | ItemStarted | ItemUpdated | ItemCompleted | ErrorEvent | TurnCompleted | TurnFailed | TurnAborted,
    Field(discriminator="type"),
]

#: Where a turn's events go (the live view, `--json`, a test's list). Must not block.
Emit = Callable[[TurnEvent], None]


def ignore(event: TurnEvent) -> None:
    """An `Emit` for nobody watching."""
