"""ResponseItem -> ToolCall: pure protocol normalisation, no side effects (Codex `router.rs`).

Only typed call items are calls; a message is never a call, whatever its text (contract 1).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from toolq.core.calls import CustomPayload, FunctionPayload, ToolCall, ToolName, ToolSearchPayload
from toolq.core.errors import RespondToModel
from toolq.core.items import (
    CustomToolCallItem,
    FunctionCallItem,
    ResponseItem,
    ToolSearchCallItem,
)

TOOL_SEARCH = ToolName.plain("tool_search")


class _SearchParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    query: str
    limit: int | None = None


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
            params = _SearchParams.model_validate(item.arguments)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "arguments"
            raise RespondToModel(f"failed to parse tool_search arguments: {field}: {err['msg']}") from None
        return ToolCall(
            tool_name=TOOL_SEARCH,
            call_id=item.call_id,
            payload=ToolSearchPayload(query=params.query, limit=params.limit),
        )
    return None
