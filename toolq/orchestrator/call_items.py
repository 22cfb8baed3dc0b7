"""What a call looks like to its watchers: Codex's item, for the tools whose declaration asks for one.

`codex exec --json` shows a shell command as `command_execution` (its command line and output),
a patch as `file_change` (the files it touches) and a plan as `todo_list`; a tool declares which
it is (`ToolSpec.view`: "command" reads its `cmd` and `shell` arguments, "file_change" its
freeform patch, "todo_list" its `plan`), and every other call stays toolq's `tool_call`. Read
from the call's own arguments and its result, never from a worker's word alone: the streamed
output is shown while the call runs, the result's output once it ends.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from typing import Any

from toolq.core.calls import CustomPayload, FunctionPayload, ToolInvocation, ToolResult
from toolq.core.catalog import ToolSpec
from toolq.core.contracts import STREAM_BYTES
from toolq.core.states import CallState, codex_status
from toolq.core.truncate import TruncationPolicy, truncate_text
from toolq.orchestrator.call_entry import CallEntry
from toolq.orchestrator.turn_events import (
    CommandExecutionView,
    FileChangeView,
    FileUpdateChange,
    TodoItem,
    TodoListView,
    ToolCallView,
)

#: The live view and `--json` show this much of a call's output.
VIEW_OUTPUT_CHARS = 2000
#: `aggregated_output` is cut (head and tail kept) to this much.
AGGREGATED_POLICY = TruncationPolicy.bytes(STREAM_BYTES)
_PATCH_HEADER = re.compile(r"^\*\*\* (Add|Delete|Update) File: (.+)$", re.MULTILINE)
_KINDS = {"Add": "add", "Delete": "delete", "Update": "update"}
#: exec_command's result text (format_exec_output): the output follows this header line.
_OUTPUT_HEADER = "\nOutput:\n"


def call_view(spec: ToolSpec | None, tool: str, inv: ToolInvocation | None, live_output: str,
              result: ToolResult | None, session_command: str | None = None, **fields: Any) -> ToolCallView:
    """The item for one call, as its declaration's `view` says; `fields` are toolq's call fields
    (id, state, step, worker...). `session_command`: a session-routed call's session's command
    line, once the call is routed."""
    view = spec.view if spec is not None else "tool_call"
    if inv is not None and view != "tool_call":
        if view == "command" and spec is not None and spec.route == "session":
            # Codex's exec --json has no item of its own for a write to a session: see ARCHITECTURE
            return CommandExecutionView(tool=tool, command=session_command or "",
                                        aggregated_output=_aggregated(live_output, result), **fields)
        if view == "command" and (args := _arguments(inv)) is not None and isinstance(args.get("cmd"), str):
            shell = args.get("shell") if isinstance(args.get("shell"), str) else "bash"
            return CommandExecutionView(tool=tool, command=shlex.join([shell or "bash", "-c", args["cmd"]]),
                                        aggregated_output=_aggregated(live_output, result), **fields)
        if view == "file_change" and isinstance(inv.payload, CustomPayload):
            return FileChangeView(tool=tool, changes=patch_changes(inv.payload.input, inv.workspace), **fields)
        if view == "todo_list" and (args := _arguments(inv)) is not None and isinstance(args.get("plan"), list):
            return TodoListView(tool=tool, items=[TodoItem(text=str(s.get("step", "")),
                                                           completed=s.get("status") == "completed")
                                                  for s in args["plan"] if isinstance(s, dict)], **fields)
    return ToolCallView(tool=tool, **fields)


def entry_view(entry: CallEntry, step: int) -> ToolCallView:
    """What watchers see of a call now, from its entry in the step (`call_view` plus toolq's fields)."""
    r = entry.result
    view = call_view(entry.spec, entry.tool, entry.inv, entry.live_output, r,
                     session_command=entry.watch.session_command if entry.watch else None, id=entry.call_id,
                     status=codex_status(entry.state), state=entry.state, step=step, worker=entry.worker)
    if entry.queued_at is not None and entry.started_at is not None:
        view.queue_wait = round(max(entry.started_at - entry.queued_at, 0.0), 4)
    if r is None:
        if entry.state is CallState.THROTTLED:
            view.reason = f"waiting for {entry.throttled_by}"
        if entry.live_output and view.type == "tool_call":  # a streaming tool's output so far
            view.output = entry.live_output[:VIEW_OUTPUT_CHARS]
        return view
    text = r.output_text()
    view.success, view.exit_code, view.output = r.success, r.exit_code, text[:VIEW_OUTPUT_CHARS]
    view.worker = r.worker or entry.worker
    view.run_time = None if r.duration is None else round(r.duration, 4)
    view.round_trip = round((entry.finished_at or time.time()) - entry.added_at, 4)
    if entry.state.failed:
        view.reason = failure_reason(r)
    return view


def failure_reason(result: ToolResult) -> str:
    """Why a call failed, in one line: its exit code, or the first line of its output."""
    if result.exit_code not in (None, 0):
        return f"exit code {result.exit_code}"
    lines = result.output_text().strip().splitlines()
    return lines[0][:200] if lines else str(result.status)


def _aggregated(live_output: str, result: ToolResult | None) -> str:
    output = live_output if result is None else result_output(result)
    return truncate_text(output, AGGREGATED_POLICY)


def result_output(result: ToolResult) -> str:
    """The command's own output in an exec_command result (after Codex's header), else the text."""
    text = result.output_text()
    head, sep, rest = text.partition(_OUTPUT_HEADER)
    return rest if sep and head.startswith("Chunk ID: ") else text


def patch_changes(patch: str, workspace: str | None) -> list[FileUpdateChange]:
    """The files a patch names, with absolute paths as Codex reports them."""
    return [FileUpdateChange(path=os.path.join(workspace or "", path.strip()), kind=_KINDS[kind])  # type: ignore[arg-type]
            for kind, path in _PATCH_HEADER.findall(patch)]


def _arguments(inv: ToolInvocation) -> dict[str, Any] | None:
    if not isinstance(inv.payload, FunctionPayload):
        return None
    try:
        args = json.loads(inv.payload.arguments)
    except ValueError:
        return None
    return args if isinstance(args, dict) else None
