"""Route and bind one committed item: what the stream layer calls at `response.output_item.done`.

`bind_item` is pure (no I/O): it turns an item into a `BoundCall` the barrier runs, or into a
call already answered (unknown tool, bad arguments, an unsupported `local_shell` call, a
`tool_search` answered from the registry), or None when the item is not a call. Like pydantic-ai's
`validate_tool_call` beside `execute_tool_call`: validation and execution are two steps with a
typed value between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from toolq.core.calls import PayloadKind, ToolInvocation, ToolResult, ToolSearchPayload
from toolq.core.catalog import ToolSpec
from toolq.core.errors import Fatal, RespondToModel
from toolq.core.items import (
    CustomToolCallItem,
    FunctionCallItem,
    LocalShellCallItem,
    ResponseItem,
    ToolSearchCallItem,
)
from toolq.core.search import search_catalog
from toolq.core.states import CallState
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.router import build_tool_call

log = logging.getLogger("toolq.binding")


@dataclass(frozen=True)
class BoundCall:
    """One call of a response, ready for the barrier: an invocation to run, or its answer."""

    output_index: int
    call_id: str
    kind: PayloadKind
    """The payload kind, which decides the output item's type."""
    tool: str
    """The tool's display name (`namespace.name`)."""
    invocation: ToolInvocation | None = None
    spec: ToolSpec | None = None
    answer: ToolResult | None = None
    """Set when the call is answered without a task; its output is this result's."""
    fatal: Fatal | None = None
    """A runtime contract broke: the turn ends after this step (the call is answered `aborted`)."""

    @property
    def serial(self) -> bool:
        return self.spec is not None and not self.spec.parallel

    @property
    def shell_like(self) -> bool:
        return self.spec is not None and self.spec.shell_like


def bind_item(item: ResponseItem, registry: Registry, ctx: StepContext, output_index: int) -> BoundCall | None:
    """The call an item asks for, bound and validated; None for a message or any non-call. Never raises."""
    if isinstance(item, LocalShellCallItem):
        return _answered(item.call_id or item.id or "", "function", "local_shell", "unsupported call: local_shell",
                         output_index)
    try:
        call = build_tool_call(item)
    except RespondToModel as e:  # a client tool_search with unreadable arguments
        return _answered(getattr(item, "call_id", None) or "", _kind_of(item), _name_of(item), e.message, output_index)
    if call is None:
        return None
    tool = str(call.tool_name)
    try:
        inv = registry.bind(call, ctx, output_index)
    except RespondToModel as e:
        return _answered(call.call_id, call.payload.kind, tool, e.message, output_index)
    except Fatal as e:
        log.error("%s (call_id=%s)", e, call.call_id)
        return _answered(call.call_id, call.payload.kind, tool, "aborted", output_index, fatal=e)
    spec = registry.lookup(call.tool_name)
    if isinstance(call.payload, ToolSearchPayload):
        # A lookup over the specs this orchestrator will expose: answered here, with no side
        # effects; a worker would answer from its own catalog, which may load other modules.
        try:
            tools = search_catalog(registry.catalog, call.payload)
        except RespondToModel as e:
            return _answered(call.call_id, "tool_search", tool, e.message, output_index, state=CallState.FAILED)
        answer = ToolResult(call_id=call.call_id, output="", tools=tools, success=True)
        return BoundCall(output_index, call.call_id, "tool_search", tool, inv, spec, answer=answer)
    return BoundCall(output_index, call.call_id, call.payload.kind, tool, inv, spec)


def _answered(call_id: str, kind: PayloadKind, tool: str, text: str, output_index: int, *,
              state: CallState = CallState.REJECTED, fatal: Fatal | None = None) -> BoundCall:
    """A call answered without a task: its error is its output."""
    answer = ToolResult(call_id=call_id, output=text, status=state, success=False)
    return BoundCall(output_index, call_id, kind, tool, answer=answer, fatal=fatal)


def _kind_of(item: ResponseItem) -> PayloadKind:
    if isinstance(item, CustomToolCallItem):
        return "custom"
    if isinstance(item, ToolSearchCallItem):
        return "tool_search"
    return "function"


def _name_of(item: ResponseItem) -> str:
    if isinstance(item, (FunctionCallItem, CustomToolCallItem)):
        return f"{item.namespace}.{item.name}" if item.namespace else item.name
    return "tool_search" if isinstance(item, ToolSearchCallItem) else "local_shell"
