"""Responses API output items: one discriminated union on the wire's `type`.

Decoding is lenient (extra fields are kept and round-trip) and never raises: an unknown
`type` becomes `UnknownItem`, which keeps its raw JSON (like Codex's `Other`). The same
types serve for items parsed from `response.output_item.done`, for history, and for the
`input` of the next request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError


class _Wire(BaseModel):
    # Real traffic carries fields newer than any SDK; keep them so they round-trip.
    model_config = ConfigDict(extra="allow")

    def to_wire(self) -> dict[str, Any]:
        """The JSON object to send back to the model (server ids and namespaces included)."""
        return self.model_dump(mode="json", exclude_none=True)


# --- content parts -------------------------------------------------------------------------


class InputText(_Wire):
    type: Literal["input_text"] = "input_text"
    text: str


class OutputText(_Wire):
    type: Literal["output_text"] = "output_text"
    text: str


class InputImage(_Wire):
    type: Literal["input_image"] = "input_image"
    image_url: str | None = None
    detail: str | None = None


class Refusal(_Wire):
    type: Literal["refusal"] = "refusal"
    refusal: str


class UnknownPart(_Wire):
    type: str | None = None


def _part_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in _PART_TYPES else "unknown"


_PART_TYPES = {"input_text", "output_text", "input_image", "refusal"}

ContentPart = Annotated[
    (
        Annotated[InputText, Tag("input_text")]
        | Annotated[OutputText, Tag("output_text")]
        | Annotated[InputImage, Tag("input_image")]
        | Annotated[Refusal, Tag("refusal")]
        | Annotated[UnknownPart, Tag("unknown")]
    ),
    Discriminator(_part_tag),
]

#: A tool output is a plain string or a list of content parts (text and images).
ToolOutputBody = str | list[ContentPart]


# --- items ---------------------------------------------------------------------------------


class MessageItem(_Wire):
    type: Literal["message"] = "message"
    id: str | None = None
    role: str
    content: str | list[ContentPart] = Field(default_factory=list)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(
            p.text if isinstance(p, (OutputText, InputText)) else getattr(p, "refusal", "")
            for p in self.content
        )


class ReasoningItem(_Wire):
    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


class FunctionCallItem(_Wire):
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    """The envelope's id (`fc_...`). Never used for pairing: that is `call_id`."""
    call_id: str
    """Pairs this call with its `function_call_output`. Two calls may share one."""
    name: str
    namespace: str | None = None
    """Set when the tool came from a namespace; must be round-tripped."""
    arguments: str
    """Raw JSON text, parsed only once a handler is chosen."""
    status: str | None = None


class CustomToolCallItem(_Wire):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str | None = None
    call_id: str
    name: str
    namespace: str | None = None
    input: str
    """Freeform text (e.g. an apply_patch envelope), never JSON-parsed."""
    status: str | None = None


class ToolSearchCallItem(_Wire):
    type: Literal["tool_search_call"] = "tool_search_call"
    id: str | None = None
    call_id: str | None = None
    execution: str = "server"
    """`client`: we run the search and answer; `server`: the provider already did."""
    arguments: Any = None
    """A JSON object here, not a string (unlike function_call)."""
    status: str | None = None


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    call_id: str
    output: ToolOutputBody


class CustomToolCallOutputItem(_Wire):
    type: Literal["custom_tool_call_output"] = "custom_tool_call_output"
    id: str | None = None
    call_id: str
    name: str | None = None
    output: ToolOutputBody


class ToolSearchOutputItem(_Wire):
    type: Literal["tool_search_output"] = "tool_search_output"
    id: str | None = None
    call_id: str | None = None
    status: str = "completed"
    execution: str = "client"
    tools: list[dict[str, Any]] = Field(default_factory=list)


class LocalShellCallItem(_Wire):
    type: Literal["local_shell_call"] = "local_shell_call"
    id: str | None = None
    call_id: str | None = None
    status: str | None = None
    action: dict[str, Any] = Field(default_factory=dict)


#: Tools the provider runs itself: recorded and replayed, never executed or answered here.
HOSTED_TYPES = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "computer_call",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "shell_call",
        "apply_patch_call",
        "compaction",
    }
)


class HostedToolItem(_Wire):
    type: str
    id: str | None = None
    status: str | None = None


class UnknownItem(_Wire):
    """An item type we do not know. Kept aside with its JSON; never sent back, never a call."""

    type: str | None = None


_ITEM_TYPES = {
    "message",
    "reasoning",
    "function_call",
    "custom_tool_call",
    "tool_search_call",
    "function_call_output",
    "custom_tool_call_output",
    "tool_search_output",
    "local_shell_call",
}


def _item_tag(v: Any) -> str:
    if isinstance(v, dict):
        t = v.get("type")
        if t is None and "role" in v:  # `{role, content}` is a message without its tag
            return "message"
    else:
        t = getattr(v, "type", None)
    if t in _ITEM_TYPES:
        return t
    return "hosted" if t in HOSTED_TYPES else "unknown"


ResponseItem = Annotated[
    (
        Annotated[MessageItem, Tag("message")]
        | Annotated[ReasoningItem, Tag("reasoning")]
        | Annotated[FunctionCallItem, Tag("function_call")]
        | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
        | Annotated[ToolSearchCallItem, Tag("tool_search_call")]
        | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
        | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
        | Annotated[ToolSearchOutputItem, Tag("tool_search_output")]
        | Annotated[LocalShellCallItem, Tag("local_shell_call")]
        | Annotated[HostedToolItem, Tag("hosted")]
        | Annotated[UnknownItem, Tag("unknown")]
    ),
    Discriminator(_item_tag),
]

CallItem = FunctionCallItem | CustomToolCallItem | ToolSearchCallItem | LocalShellCallItem
OutputItem = FunctionCallOutputItem | CustomToolCallOutputItem | ToolSearchOutputItem

ResponseItemAdapter: TypeAdapter[ResponseItem] = TypeAdapter(ResponseItem)


class MalformedItem(UnknownItem):
    """A known item type whose fields do not fit (e.g. a function_call without call_id)."""

    error: str | None = None


def decode_item(obj: Any) -> ResponseItem:
    """Decode one item; never raises. Malformed known types become `MalformedItem`."""
    try:
        return ResponseItemAdapter.validate_python(obj)
    except ValidationError as e:
        raw = obj if isinstance(obj, dict) else {"value": obj}
        return MalformedItem.model_validate({**raw, "error": _first_error(e)})


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"][1:] or err["loc"])
    return f"{where}: {err['msg']}"


def is_api_item(item: ResponseItem) -> bool:
    """Whether the item belongs in the model's `input` (unknown and malformed ones do not)."""
    return not isinstance(item, UnknownItem)


def is_call(item: ResponseItem) -> bool:
    return isinstance(item, (FunctionCallItem, CustomToolCallItem, LocalShellCallItem)) or (
        isinstance(item, ToolSearchCallItem) and item.execution == "client" and item.call_id is not None
    )
