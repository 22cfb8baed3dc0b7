"""One MCP `tools/call` run on the fleet: a toolq turn of its own holding that one call.

The turn is `Fleet.run_calls([item], turn_id=T, conversation=C, environment=E)` then
`Fleet.end_turn(T)`: the call is in the ledger (`toolq status T`), under the fleet's limits, in
the sandbox, and `toolq cancel T` stops it (its processes killed) from any process. The turn's
events give the call's verdict (a failed call is an MCP `isError` result) and, while it runs, its
streamed output (an exec_command's), which the caller may pass on as progress.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mcp import types

from toolq.core.environments import EnvironmentRecord
from toolq.core.tracing import TraceContext
from toolq.frontdoors.mcp_server.tools import Offered
from toolq.orchestrator import spans
from toolq.orchestrator.environments import Environment
from toolq.orchestrator.fleet import Fleet
from toolq.orchestrator.turn_events import ItemCompleted, ItemUpdated, ToolCallView, TurnEvent

log = logging.getLogger("toolq.mcp_server")

#: The `_meta` keys of a result: which turn ran the call and how it ended in toolq's own words.
META_TURN = "toolq/turn"
META_STATE = "toolq/state"

#: How an MCP task ends (`tasks/get`'s status) for each way a call's turn ended.
Ending = Literal["completed", "failed", "cancelled"]


@dataclass
class CallWatch:
    """The `emit` of the call's turn: keeps the call's last view and hands each new piece of its
    streamed output to `on_output` (never blocking: it is called from the turn's own loop)."""

    on_output: Callable[[str], None] | None = None
    view: ToolCallView | None = None
    _shown: str = field(default="", repr=False)

    def __call__(self, event: TurnEvent) -> None:
        if not isinstance(event, ItemUpdated | ItemCompleted) or not isinstance(event.item, ToolCallView):
            return
        self.view = event.item
        if isinstance(event, ItemUpdated) and self.on_output is not None:
            text = getattr(event.item, "aggregated_output", None) or (event.item.output or "")
            # The aggregate keeps its head and tail once long: a new middle shows whole.
            piece = text[len(self._shown):] if text.startswith(self._shown) else text
            self._shown = text
            if piece:
                self.on_output(piece)


@dataclass
class CallOutcome:
    result: types.CallToolResult
    ending: Ending
    message: str | None = None
    """Why the call failed or was cancelled, in one line (an MCP task's `statusMessage`)."""


async def run_call(fleet: Fleet, offered: Offered, arguments: dict[str, Any], *, turn_id: str,
                   conversation: str | None, environment: Environment | EnvironmentRecord | None,
                   on_output: Callable[[str], None] | None = None,
                   trace: TraceContext | None = None) -> CallOutcome:
    """Run the call as turn `turn_id` and end the turn; never raises for what the call did (its
    failure is the result's `isError`), only for the fleet itself (Redis away). `trace`: the
    client's own `_meta.traceparent` (never anything the call's arguments say), the parent of the
    call's spans when tracing is on."""
    span = spans.start_front_door_call("tools/call", offered.tool.name, turn_id, trace)
    if span is None:
        return await _run_call(fleet, offered, arguments, turn_id=turn_id, conversation=conversation,
                               environment=environment, on_output=on_output)
    from opentelemetry import context
    from opentelemetry import trace as otel

    token = context.attach(otel.set_span_in_context(span))  # this task's: the call's execute_tool span's parent
    outcome: CallOutcome | None = None
    try:
        outcome = await _run_call(fleet, offered, arguments, turn_id=turn_id, conversation=conversation,
                                  environment=environment, on_output=on_output)
        return outcome
    finally:
        context.detach(token)
        spans.end_front_door_call(span, outcome.ending if outcome is not None else "failed",
                                  outcome.result.isError if outcome is not None else True)


async def _run_call(fleet: Fleet, offered: Offered, arguments: dict[str, Any], *, turn_id: str,
                    conversation: str | None, environment: Environment | EnvironmentRecord | None,
                    on_output: Callable[[str], None] | None = None) -> CallOutcome:
    try:
        item = offered.call_item(arguments, call_id="call_" + turn_id.removeprefix("turn-"))
    except ValueError as e:
        return CallOutcome(error_result(str(e)), "failed", str(e))
    watch = CallWatch(on_output)
    ending: Ending = "completed"
    try:
        outputs = await fleet.run_calls([item], turn_id=turn_id, emit=watch, conversation=conversation,
                                        environment=environment, label=f"(mcp-server: {offered.tool.name})")
    except Exception as e:
        await fleet.end_turn(turn_id, status="failed", error=f"{type(e).__name__}: {e}")
        outputs = getattr(e, "outputs", None) or []  # a broken contract (`Fatal`) still answers the call
        if not outputs:
            raise
        ending = "failed"
    else:
        await fleet.end_turn(turn_id)
    if await fleet.ledger.is_cancelled(turn_id):
        ending = "cancelled"
    view = watch.view
    failed = ending != "completed" or (view is not None and view.status == "failed")
    result = types.CallToolResult(content=content_of(outputs[0].get("output", "") if outputs else ""),
                                  isError=failed)
    result.meta = {META_TURN: turn_id, **({META_STATE: str(view.state)} if view is not None else {})}
    reason = view.reason if view is not None else None
    return CallOutcome(result, ending, reason if ending != "completed" else None)


def content_of(output: Any) -> list[types.ContentBlock]:
    """A call's output (text, or Responses content parts) as MCP content."""
    if isinstance(output, str):
        return [types.TextContent(type="text", text=output)]
    blocks: list[types.ContentBlock] = []
    for part in output if isinstance(output, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            blocks.append(types.TextContent(type="text", text=part["text"]))
        elif kind == "input_image" and isinstance(url := part.get("image_url"), str) and url.startswith("data:"):
            head, _, data = url.partition(",")
            blocks.append(types.ImageContent(type="image", data=data,
                                             mimeType=head.removeprefix("data:").split(";")[0] or "image/png"))
    return blocks or [types.TextContent(type="text", text="")]


def error_result(message: str) -> types.CallToolResult:
    """A call that never reached the fleet (an unknown tool, an input MCP cannot carry)."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], isError=True)
