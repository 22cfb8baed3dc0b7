"""ResponseItem -> ToolCall: pure protocol normalisation, no side effects (Codex `router.rs`).

Only typed call items are calls; a message is never a call, whatever its text (contract 1).
"""

from __future__ import annotations

from pydantic import ValidationError

from toolq.core.calls import CustomPayload, FunctionPayload, ToolCall, ToolName, ToolSearchArgs, ToolSearchPayload
from toolq.core.errors import RespondToModel, problems
from toolq.core.items import (
    CustomToolCallItem,
    FunctionCallItem,
    ResponseItem,
    ToolSearchCallItem,
)

TOOL_SEARCH = ToolName.plain("tool_search")


def build_tool_call(item: ResponseItem) -> ToolCall | None:
    """The call an item asks for, or None for anything that is not a client-side call.

    Raises RespondToModel only for a client tool_search whose arguments cannot be parsed.
    """
    if isinstance(item, FunctionCallItem):
        return ToolCall(
            tool_name=ToolName(namespace=item.namespace, name=item.name),
            call_id=item.call_id,
            payload=FunctionPayload(arguments=item.arguments),
        )
    if isinstance(item, CustomToolCallItem):
        return ToolCall(
            tool_name=ToolName(namespace=item.namespace, name=item.name),
            call_id=item.call_id,
            payload=CustomPayload(input=item.input),
        )
    if isinstance(item, ToolSearchCallItem) and item.execution == "client" and item.call_id:
        try:
            params = ToolSearchArgs.model_validate(item.arguments)
        except ValidationError as e:
            where, message, _ = problems(e)[0]
            raise RespondToModel(f"failed to parse tool_search arguments: {where or 'arguments'}: {message}") from None
        return ToolCall(
            tool_name=TOOL_SEARCH,
            call_id=item.call_id,
            payload=ToolSearchPayload(query=params.query, limit=params.limit),
        )
    return None
