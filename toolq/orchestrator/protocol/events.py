"""Responses API stream events: one SSE `data` JSON in, one typed `StreamEvent` (or nothing) out.

`EventDecoder` is pure (no I/O). It dispatches on the JSON `type`, never on the SSE `event:` line
(compat servers omit it: docs/reference/responses-stream.md#framing), and it never raises on bad input: malformed
JSON, JSON nested past serde_json's limit (`too_deep`), frames without `type`, unknown types and
events over the size bound (`oversize`, see `sse.py`) are skipped and counted in `skipped` by
reason; lone surrogates become U+FFFD (`untrusted.py`).
Known events that carry nothing toolq acts on (`response.in_progress`, `content_part.*`,
`*.done` text events, hosted-tool progress...) are counted in `ignored` instead.

The commit point is `OutputItemDone`: its item is the authoritative one (ids, `call_id`, arguments
and reasoning `encrypted_content` may all change between `added` and `done` in real traffic).
Deltas are for a live view only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from toolq.core import untrusted
from toolq.core.items import ResponseItem, decode_item
from toolq.core.settings import DEFAULT_MAX_EVENT_BYTES
from toolq.orchestrator.protocol.sse import Frame, Oversize, iter_frames


class Usage(BaseModel):
    """Token counts of one response; `+` sums them over a turn."""

    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_output_tokens: int = 0
    total_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            cached_input_tokens=self.cached_input_tokens + other.cached_input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            reasoning_output_tokens=self.reasoning_output_tokens + other.reasoning_output_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
        )

    @classmethod
    def from_wire(cls, usage: Any) -> Usage | None:
        """From `response.usage`; the `*_details` objects are missing on some servers."""
        if not isinstance(usage, dict):
            return None
        return cls(
            input_tokens=_int(usage.get("input_tokens")),
            cached_input_tokens=_int(_get(usage, "input_tokens_details", "cached_tokens")),
            output_tokens=_int(usage.get("output_tokens")),
            reasoning_output_tokens=_int(_get(usage, "output_tokens_details", "reasoning_tokens")),
            total_tokens=_int(usage.get("total_tokens")),
        )


class ResponseCreated(BaseModel):
    kind: Literal["created"] = "created"
    response_id: str | None = None


class OutputItemAdded(BaseModel):
    """An item opened. Not final: never dispatch from it."""

    kind: Literal["item_added"] = "item_added"
    output_index: int | None = None
    item: ResponseItem


class OutputItemDone(BaseModel):
    """The commit point: the item as the server finished it."""

    kind: Literal["item_done"] = "item_done"
    output_index: int | None = None
    """Absent on some servers (and in Codex's own fixtures)."""
    item: ResponseItem
    size: int = 0
    """Bytes (UTF-8) of the event as the server sent it: never less than the item's own JSON."""
    escaped: int = 0
    """Never less than the item's JSON with every non-ASCII character escaped, as Celery's JSON
    writes it (3 bytes per byte at most: `\\u00e9` for the two bytes of an `é`)."""


class TextDelta(BaseModel):
    kind: Literal["text_delta"] = "text_delta"
    item_id: str | None = None
    output_index: int | None = None
    delta: str


class ReasoningDelta(BaseModel):
    """Reasoning summary text or raw reasoning text (gpt-oss, compat servers)."""

    kind: Literal["reasoning_delta"] = "reasoning_delta"
    item_id: str | None = None
    output_index: int | None = None
    delta: str


class ToolInputDelta(BaseModel):
    """A piece of a function call's `arguments` or a custom call's `input`, for progress only."""

    kind: Literal["tool_input_delta"] = "tool_input_delta"
    item_id: str | None = None
    call_id: str | None = None
    output_index: int | None = None
    delta: str


class Completed(BaseModel):
    kind: Literal["completed"] = "completed"
    response_id: str | None = None
    usage: Usage | None = None
    model: str | None = None
    """The model that answered (`response.model`), for the request's span."""


class Failed(BaseModel):
    """`response.failed`: `code` is an open string (`insufficient_quota` is outside the SDK enum)."""

    kind: Literal["failed"] = "failed"
    code: str | None = None
    message: str | None = None


class Incomplete(BaseModel):
    kind: Literal["incomplete"] = "incomplete"
    reason: str | None = None


class StreamCut(BaseModel):
    """An event over the size bound (`sse.SSEReader`), dropped unread, that may have carried a
    commit (an `output_item.done`, or a type that cannot be read): the response is not whole,
    so the client ends the stream as broken, which is retryable (as Codex treats a broken stream)."""

    kind: Literal["cut"] = "cut"
    event_type: str | None = None
    size: int


class ErrorEvent(BaseModel):
    """A top-level `error` event; OpenAI follows it with `response.failed`."""

    kind: Literal["error"] = "error"
    code: str | None = None
    message: str | None = None


StreamEvent = Annotated[
    (
        ResponseCreated | OutputItemAdded | OutputItemDone | TextDelta | ReasoningDelta | ToolInputDelta
        | Completed | Failed | Incomplete | ErrorEvent | StreamCut
    ),
    Field(discriminator="kind"),
]

#: Known event types toolq has no use for (docs/reference/responses-stream.md#events-toolq-ignores).
IGNORED_TYPES = frozenset(
    {
        "response.in_progress",
        "response.queued",
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.done",
        "response.output_text.annotation.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.function_call_arguments.done",
        "response.custom_tool_call_input.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
        "response.reasoning_summary_text.done",
        "response.reasoning_text.done",
        "response.audio.delta",
        "response.audio.done",
        "response.audio.transcript.delta",
        "response.audio.transcript.done",
        "response.code_interpreter_call.completed",
        "response.code_interpreter_call.in_progress",
        "response.code_interpreter_call.interpreting",
        "response.code_interpreter_call_code.delta",
        "response.code_interpreter_call_code.done",
        "response.compaction.compacting",
        "response.file_search_call.completed",
        "response.file_search_call.in_progress",
        "response.file_search_call.searching",
        "response.image_generation_call.completed",
        "response.image_generation_call.generating",
        "response.image_generation_call.in_progress",
        "response.image_generation_call.partial_image",
        "response.mcp_call.completed",
        "response.mcp_call.failed",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_list_tools.completed",
        "response.mcp_list_tools.failed",
        "response.mcp_list_tools.in_progress",
        "response.shell_call_command.added",
        "response.shell_call_command.delta",
        "response.shell_call_command.done",
        "response.shell_call_output_content.delta",
        "response.shell_call_output_content.done",
        "response.web_search_call.completed",
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.metadata",
    }
)


class EventDecoder:
    """SSE `data` text to `StreamEvent`; `None` means skipped (see `skipped`) or ignored."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self.ignored: Counter[str] = Counter()

    def decode(self, data: Frame) -> StreamEvent | None:
        if isinstance(data, Oversize):
            return self._cut(data)
        if not data:
            # httpx-sse yields empty events after an `id:` line or for `event:`-only frames.
            self.skipped["empty"] += 1
            return None
        if data.startswith("[DONE]"):
            # Never sent by OpenAI on Responses; some proxies add it (Chat Completions habit).
            self.skipped["done_marker"] += 1
            return None
        try:
            obj = untrusted.loads(data)
        except untrusted.TooDeep:
            # serde_json's limit, so Codex skips the same frames; past it Python itself would
            # raise RecursionError here, or pydantic and `json.dumps` later.
            self.skipped["too_deep"] += 1
            return None
        except ValueError:
            self.skipped["malformed_json"] += 1
            return None
        if untrusted.may_hold_surrogate(data):
            # Valid JSON, invalid Unicode: kept, with U+FFFD for each lone surrogate, so nothing
            # downstream (Celery, Redis, the next request, a file path) meets one.
            obj = untrusted.scrub(obj)
        if not isinstance(obj, dict):
            self.skipped["not_an_object"] += 1
            return None
        type_ = obj.get("type")
        if not isinstance(type_, str):
            self.skipped["missing_type"] += 1
            return None
        handler = _HANDLERS.get(type_)
        if handler is None:
            if type_ in IGNORED_TYPES:
                self.ignored[type_] += 1
            else:
                self.skipped[f"unknown_type:{type_}"] += 1
            return None
        event = handler(obj)
        if event is None:
            self.skipped[f"bad_fields:{type_}"] += 1
        elif isinstance(event, OutputItemDone):
            if data.isascii():
                event.size = event.escaped = len(data)
            else:
                event.size = len(data.encode(errors="replace"))
                event.escaped = 3 * event.size
        return event


    def _cut(self, frame: Oversize) -> StreamEvent | None:
        """An event over the bound: counted; harmless ones are dropped, a lost commit is a `StreamCut`."""
        self.skipped["oversize"] += 1
        type_ = frame.type
        if type_ == "response.completed":
            # It repeats the whole output, so it is the event most likely to be cut; the items came
            # in their own `output_item.done` events. Only its usage is lost.
            return Completed()
        if type_ in _LIVE_VIEW_TYPES or type_ in IGNORED_TYPES:
            return None
        return StreamCut(event_type=type_, size=frame.size)


#: Events whose loss costs the live view only: no commit, no terminal state.
_LIVE_VIEW_TYPES = frozenset(
    {
        "response.created",
        "response.output_item.added",
        "response.output_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    }
)


# Handlers check each field by hand so a bad value is skipped, never raised. Item events use
# `model_construct`: the item is already decoded, and re-validating it would reject a
# `MalformedItem` that `decode_item` kept on purpose. The rest, deltas above all (most of a
# stream), use the validating constructor: pydantic-core makes it ~3x faster than `model_construct`.


def _created(obj: dict[str, Any]) -> ResponseCreated:
    return ResponseCreated(response_id=_response_id(obj))


def _item(cls: type[OutputItemAdded] | type[OutputItemDone]) -> Callable[[dict[str, Any]], Any]:
    def handler(obj: dict[str, Any]) -> OutputItemAdded | OutputItemDone | None:
        item = obj.get("item")
        if not isinstance(item, dict):
            return None
        return cls.model_construct(output_index=_opt_int(obj.get("output_index")), item=decode_item(item))

    return handler


def _delta(cls: type[TextDelta] | type[ReasoningDelta] | type[ToolInputDelta]) -> Callable[[dict[str, Any]], Any]:
    def handler(obj: dict[str, Any]) -> TextDelta | ReasoningDelta | ToolInputDelta | None:
        delta = obj.get("delta")
        if not isinstance(delta, str):
            return None
        item_id, output_index = _opt_str(obj.get("item_id")), _opt_int(obj.get("output_index"))
        if cls is ToolInputDelta:  # custom tool input deltas may carry a call_id
            return ToolInputDelta(item_id=item_id, output_index=output_index, delta=delta,
                                  call_id=_opt_str(obj.get("call_id")))
        return cls(item_id=item_id, output_index=output_index, delta=delta)

    return handler


def _completed(obj: dict[str, Any]) -> Completed:
    # Lenient where Codex is strict: a `response.completed` without `response` still completes
    # (compat servers send bare terminal events; the items came in `output_item.done`).
    response = obj.get("response")
    usage = Usage.from_wire(response.get("usage")) if isinstance(response, dict) else None
    model = _opt_str(response.get("model")) if isinstance(response, dict) else None
    return Completed(response_id=_response_id(obj), usage=usage, model=model)


def _failed(obj: dict[str, Any]) -> Failed:
    response = obj.get("response")
    error = response.get("error") if isinstance(response, dict) else None
    if not isinstance(error, dict):
        return Failed()
    return Failed(code=_opt_str(error.get("code")), message=_opt_str(error.get("message")))


def _incomplete(obj: dict[str, Any]) -> Incomplete:
    reason = _get(obj, "response", "incomplete_details", "reason")
    return Incomplete(reason=_opt_str(reason))


def _error(obj: dict[str, Any]) -> ErrorEvent:
    # Real traffic nests the error ({"error": {...}}); the SDK declares it flat. Accept both.
    error = obj.get("error")
    err = error if isinstance(error, dict) else obj
    return ErrorEvent(code=_opt_str(err.get("code")), message=_opt_str(err.get("message")))


_HANDLERS = {
    "response.created": _created,
    "response.output_item.added": _item(OutputItemAdded),
    "response.output_item.done": _item(OutputItemDone),
    "response.output_text.delta": _delta(TextDelta),
    "response.reasoning_summary_text.delta": _delta(ReasoningDelta),
    "response.reasoning_text.delta": _delta(ReasoningDelta),
    "response.function_call_arguments.delta": _delta(ToolInputDelta),
    "response.custom_tool_call_input.delta": _delta(ToolInputDelta),
    "response.completed": _completed,
    "response.failed": _failed,
    "response.incomplete": _incomplete,
    "error": _error,
}

TERMINAL_KINDS = frozenset({"completed", "failed", "incomplete"})


def iter_sse_data(body: bytes | str, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> Iterator[Frame]:
    """The `data` of each SSE event in a whole recorded body, framed as the client frames a stream.

    A body whose last event lacks its blank line gets one: SSE decoders drop an unterminated
    last event, and 3 of the 5 recorded fixtures end that way (tests/fixtures/README.md).
    """
    raw = body.encode() if isinstance(body, str) else body
    if raw and not raw.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
        raw = raw.rstrip(b"\r\n") + b"\n\n"
    yield from iter_frames([raw], max_event_bytes)


def _response_id(obj: dict[str, Any]) -> str | None:
    return _opt_str(_get(obj, "response", "id"))


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0
