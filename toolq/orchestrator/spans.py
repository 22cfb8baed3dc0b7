"""The orchestrator's spans, after the OpenTelemetry GenAI conventions: a turn (`invoke_agent
toolq`, the root), each model request (`chat {model}`) and each tool call (`execute_tool {tool}`,
from its item's `output_item.done` to its output in the barrier), children of the turn.

Every function here is a no-op returning None when tracing is off (`tracing.on()`, one bool):
nothing of OpenTelemetry is imported then. No span holds content (prompts, outputs, arguments)
unless OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true (`tracing.capture_content`).
Spans are started and ended explicitly and never made current, so a turn's spans cannot leak
into another turn's context in a process that runs many (`toolq batch`, a front door).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from toolq.core import tracing as names
from toolq.core import untrusted
from toolq.core.calls import ToolInvocation, ToolResult
from toolq.core.flower_args import secret_name
from toolq.core.honest import Known
from toolq.core.mcp_specs import MCP_QUEUE_PREFIX
from toolq.core.states import CallState
from toolq.telemetry import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from toolq.orchestrator.binding import BoundCall

log = logging.getLogger("toolq.spans")

#: What a content attribute holds at most (characters): a span is not a transcript store.
CONTENT_CHARS = 16_384
#: What a name taken from the model's text (an undeclared tool's) holds at most.
NAME_CHARS = 128
#: The provider the Responses API speaks for (the conventions' `gen_ai.provider.name`).
PROVIDER = "openai"

#: Why toolq, not the tool, wrote a call's output, by the call's final state (`honest.Known`);
#: "" (absent): the tool's own result, a success or its own failure.
_REASONS = {
    CallState.REJECTED: Known.NOT_RUN,
    CallState.LOST: Known.INTERRUPTED,
    CallState.TIMED_OUT: Known.STOPPED,
    CallState.CANCELLED: Known.STOPPED,
}


def output_reason(state: CallState) -> str:
    """`toolq.output.reason`: a `Known` value when toolq wrote the output, else ""."""
    known = _REASONS.get(state)
    return known.value if known is not None else ""


def _cut(text: str, room: int = CONTENT_CHARS) -> str:
    return text if len(text) <= room else text[:room - 1] + "…"


def masked(value: Any) -> Any:
    """Content as a span may hold it (capture on): wherever a call's `arguments` appear (the
    history's and the answer's function calls), a secret-named argument's value (`api_key`,
    `password`...: Flower's rule, `flower_args.secret_name`) by its length only."""
    if isinstance(value, dict):
        return {k: masked_arguments(v) if k == "arguments" and isinstance(v, str) else masked(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def masked_arguments(text: str) -> str:
    """A call's arguments (the model's JSON text) with each secret-named value shown by its length."""
    try:
        args = untrusted.loads(text)
    except (ValueError, RecursionError, TypeError):
        return text  # not JSON: no names to tell a secret by
    if not isinstance(args, (dict, list)):
        return text
    hidden = _hide(args)
    return text if hidden == args else json.dumps(hidden)


def _hide(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _length(v) if isinstance(k, str) and secret_name(k) else _hide(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hide(v) for v in value]
    return value


def _length(value: Any) -> str:
    n = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
    return f"<hidden: {n} chars>"


def _parent(span: Any) -> Any:
    """The context a child of `span` starts in: `span`'s, or the caller's current one (a library
    user's own span, a front door's client context) when there is no turn span."""
    from opentelemetry import context, trace

    return trace.set_span_in_context(span) if span is not None else context.get_current()


def _end(span: Any, error: str | None) -> None:
    from opentelemetry.trace import StatusCode

    if error:
        span.set_attribute(names.ERROR_TYPE, error)
        span.set_status(StatusCode.ERROR)
    span.end()


# --- the turn ------------------------------------------------------------------------------------

def start_turn(turn_id: str, conversation: str | None, *, resumed: bool = False) -> Span | None:
    if not tracing.on():
        return None
    attributes: dict[str, Any] = {names.OPERATION: "invoke_agent", names.AGENT_NAME: "toolq",
                                  names.PROVIDER: PROVIDER, names.TURN_ID: turn_id}
    if conversation:
        attributes[names.CONVERSATION_ID] = conversation
    if resumed:
        attributes["toolq.turn.resumed"] = True
    from opentelemetry.trace import SpanKind

    return tracing.tracer().start_span(names.INVOKE_AGENT, context=_parent(None), kind=SpanKind.INTERNAL,
                                       attributes=attributes)


def end_turn(span: Span | None, status: str, usage: Any = None, requests: int = 0) -> None:
    """`status`: the turn's (completed, failed, cancelled); `usage`: its `Usage` summed over requests."""
    if span is None:
        return
    try:
        span.set_attribute("toolq.turn.status", status)
        span.set_attribute("toolq.turn.requests", requests)
        if usage is not None:
            span.set_attribute(names.INPUT_TOKENS, int(usage.input_tokens or 0))
            span.set_attribute(names.OUTPUT_TOKENS, int(usage.output_tokens or 0))
        _end(span, None if status == "completed" else status)
    except Exception as e:  # telemetry never costs a turn its outcome
        log.debug("could not end the turn's span: %s", e)


def trace_id(span: Span | None) -> str | None:
    return tracing.trace_id_of(span)


# --- a model request -----------------------------------------------------------------------------

def start_chat(turn: Span | None, model: str, body: dict[str, Any]) -> Span | None:
    if not tracing.on():
        return None
    from opentelemetry.trace import SpanKind

    attributes: dict[str, Any] = {names.OPERATION: "chat", names.PROVIDER: PROVIDER, names.REQUEST_MODEL: model}
    if tracing.capture_content():
        attributes["gen_ai.input.messages"] = _cut(json.dumps(masked(body.get("input", [])), default=str))
        if body.get("instructions"):
            attributes["gen_ai.system_instructions"] = _cut(str(body["instructions"]))
    return tracing.tracer().start_span(f"{names.CHAT} {model}", context=_parent(turn), kind=SpanKind.CLIENT,
                                       attributes=attributes)


class ChatRecord:
    """What a model request's span learns from its stream (fed one event at a time)."""

    __slots__ = ("calls", "items", "model", "reason", "response_id", "usage")

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.model: str | None = None
        self.usage: Any = None
        self.calls = 0
        self.reason: str | None = None
        self.items: list[Any] = []

    def event(self, event: Any) -> None:
        kind = event.kind
        if kind == "created" or kind == "completed":
            self.response_id = event.response_id or self.response_id
            self.model = getattr(event, "model", None) or self.model
            if kind == "completed":
                self.usage = event.usage
                self.reason = self.reason or ("tool_calls" if self.calls else "stop")
        elif kind == "item_done":
            if getattr(event.item, "call_id", None) is not None:
                self.calls += 1
            if tracing.capture_content():
                self.items.append(event.item)
        elif kind == "incomplete":
            self.reason = "length" if event.reason == "max_output_tokens" else (event.reason or "incomplete")
        elif kind == "failed":
            self.reason = "error"


def end_chat(span: Span | None, record: ChatRecord, error: BaseException | None = None) -> None:
    if span is None:
        return
    try:
        if record.response_id:  # the server's words: bounded
            span.set_attribute(names.RESPONSE_ID, _cut(record.response_id, NAME_CHARS))
        if record.model:
            span.set_attribute(names.RESPONSE_MODEL, _cut(record.model, NAME_CHARS))
        if record.usage is not None:
            span.set_attribute(names.INPUT_TOKENS, int(record.usage.input_tokens or 0))
            span.set_attribute(names.OUTPUT_TOKENS, int(record.usage.output_tokens or 0))
        if record.reason:
            span.set_attribute(names.FINISH_REASONS, [record.reason])
        if record.items:
            span.set_attribute("gen_ai.output.messages", _cut(json.dumps(
                masked([_wire(i) for i in record.items]), default=str)))
        _end(span, _error_type(error))
    except Exception as e:
        log.debug("could not end a chat span: %s", e)


def _wire(item: Any) -> Any:
    return item.to_wire() if hasattr(item, "to_wire") else str(item)


def _error_type(error: BaseException | None) -> str | None:
    if error is None:
        return None
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return str(status)
    return type(error).__name__


# --- a tool call ---------------------------------------------------------------------------------

def start_tool(turn: Span | None, call: BoundCall) -> Span | None:
    """At the call's `output_item.done` (`Step.add`)."""
    if not tracing.on():
        return None
    from opentelemetry.trace import SpanKind

    spec, inv = call.spec, call.invocation
    tool = str(spec.tool_name) if spec is not None else None
    attributes: dict[str, Any] = {
        names.OPERATION: "execute_tool",
        names.TOOL_NAME: tool or _cut(call.tool, NAME_CHARS),
        names.TOOL_CALL_ID: _cut(call.call_id, NAME_CHARS),
        names.TOOL_TYPE: _tool_type(spec),
    }
    if inv is not None:
        attributes[names.TURN_ID] = inv.turn_id
        attributes[names.TASK_ID] = inv.task_id
        if tracing.capture_content():
            payload = inv.payload
            text = getattr(payload, "arguments", None) or getattr(payload, "input", None) \
                or getattr(payload, "query", None) or ""
            attributes[names.TOOL_ARGUMENTS] = _cut(masked_arguments(text) if isinstance(text, str) else str(text))
    # The span's name is low-cardinality: an undeclared tool's name is the model's text.
    name = f"{names.EXECUTE_TOOL} {tool}" if tool else names.EXECUTE_TOOL
    return tracing.tracer().start_span(name, context=_parent(turn), kind=SpanKind.INTERNAL, attributes=attributes)


def _tool_type(spec: Any) -> str:
    """The conventions' `gen_ai.tool.type`: an MCP server's tool is an extension, the rest functions."""
    if spec is not None and spec.queue.startswith(MCP_QUEUE_PREFIX):
        return "extension"
    return "function"


def sent(span: Span | None, inv: ToolInvocation, queue: str | None) -> ToolInvocation:
    """The invocation as it is sent: carrying its `execute_tool` span's context (signed with it)."""
    if span is None:
        return inv
    try:
        if queue:
            span.set_attribute(names.QUEUE, queue)
        tc = tracing.span_context(span)
        return inv.model_copy(update={"trace": tc}) if tc is not None else inv
    except Exception as e:
        log.debug("could not put a call's trace context on its invocation: %s", e)
        return inv


def end_tool(span: Span | None, result: ToolResult, worker: str | None = None) -> None:
    """Where the call's final state is decided (`CallEntry.settle`, the first settle wins)."""
    if span is None:
        return
    try:
        state = result.status
        span.set_attribute(names.CALL_STATE, state.value)
        reason = output_reason(state)
        if reason:
            span.set_attribute(names.OUTPUT_REASON, reason)
        if worker or result.worker:
            span.set_attribute(names.WORKER, str(worker or result.worker))
        if result.exit_code is not None:
            span.set_attribute("toolq.exit_code", result.exit_code)
        if tracing.capture_content():
            span.set_attribute(names.TOOL_RESULT, _cut(result.output_text()))
        _end(span, None if state is CallState.COMPLETED else state.value)
    except Exception as e:
        log.debug("could not end a call's span: %s", e)


# --- a front door's call -------------------------------------------------------------------------

def start_front_door_call(method: str, tool: str, turn_id: str, parent: Any) -> Span | None:
    """A front door's request (MCP `tools/call {tool}`), its parent the client's own trace context
    (`tracing.parse_traceparent` of what the client sent) or none."""
    if not tracing.on():
        return None
    from opentelemetry.trace import SpanKind

    return tracing.tracer().start_span(
        f"{method} {tool}", context=tracing.context_of(parent), kind=SpanKind.SERVER,
        attributes={"mcp.method.name": method, names.OPERATION: "execute_tool", names.TOOL_NAME: tool,
                    names.TURN_ID: turn_id})


def end_front_door_call(span: Span | None, ending: str, is_error: bool) -> None:
    if span is None:
        return
    try:
        span.set_attribute("toolq.turn.status", ending)
        _end(span, ending if ending != "completed" else ("tool_error" if is_error else None))
    except Exception as e:
        log.debug("could not end a front door call's span: %s", e)
