"""The worker's spans of a call (issue 30), children of the orchestrator's `execute_tool` span.

A call's parent is the `TraceContext` inside its signed invocation, and nothing else: never a
workspace file, a variable a command set, an MCP server's reply or a model's argument. Under it:
`toolq.queue_wait` (the send to the task's start), `toolq.tool {tool}` (the handler; inside it
`toolq.sandbox.start`, `toolq.command` and an MCP call's `tools/call {tool}`), and
`toolq.result.store` (Celery storing the result, after the task body returned).

Off (no OTEL_* turning traces on), every function here returns at its first test of
`tracing.on()`: nothing of OpenTelemetry is imported. A pool child sets up its own provider after
the fork (`child_started`); its batch processor exports on its schedule, and what the child still
holds goes before it exits (`child_exiting`), so a child replaced after its task
(`--max-tasks-per-child`) loses no span.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from toolq.core import tracing as names
from toolq.core.states import CallState
from toolq.core.tracing import (
    COMMAND,
    COMMAND_LINE,
    MCP_CALL,
    QUEUE_WAIT,
    RESULT_STORE,
    SANDBOX_BACKEND,
    SANDBOX_START,
    SESSION_HOST,
    TOOL,
    TraceContext,
)
from toolq.telemetry import tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from toolq.core.calls import ToolInvocation

log = logging.getLogger("toolq.worker")


#: How long a pool child on its way out waits for its spans' export.
EXIT_FLUSH_TIMEOUT = 5.0
#: After a child's exit did not see its export done in time (a collector down, or one that never
#: answers), how long the children exiting next do not wait for theirs. Shared by the worker's
#: processes (a page mapped before the pool forks): children replaced after each call
#: (--max-tasks-per-child 1) would otherwise each hold the next call EXIT_FLUSH_TIMEOUT.
EXIT_BACKOFF = 30.0
_down_until = mmap.mmap(-1, 8)  # MAP_SHARED | MAP_ANONYMOUS: the pool children forked later share it

#: States that end a call (Celery's), the stores `toolq.result.store` times (not STARTED).
_READY = frozenset({"SUCCESS", "FAILURE", "REVOKED"})

_parent: TraceContext | None = None
"""The running call's parent (its invocation's): a pool child runs one call at a time."""
_traced = False
"""Whether this process's current call is traced (the store's span is then made)."""


def child_started() -> None:
    """In each pool child, after the fork (`worker_process_init`): its own provider, if traces are on."""
    tracing.setup(tracing.WORKER)


def _ns(epoch_s: float) -> int:
    return int(epoch_s * 1e9)


def _tool_label(inv: ToolInvocation, known: bool) -> str:
    """A span name's tool: the declared name when this worker serves it, else `unknown`."""
    return str(inv.tool_name) if known else "unknown"


def begin_call(inv: ToolInvocation) -> bool:
    """A call starts here (its signature checked): remember its parent for the store. Whether traced."""
    global _parent, _traced
    _traced = tracing.on()
    _parent = inv.trace if _traced else None
    return _traced


def queue_wait(inv: ToolInvocation, picked_at: float, queue: str | None = None) -> None:
    """`toolq.queue_wait`: from the orchestrator's send (`sent_at`) to this worker taking the call.
    Hosts' clocks differ: a send that looks later than the take is a span of no length."""
    if not _traced or inv.sent_at is None or inv.trace is None:  # untraced: the tool span is the one root
        return
    try:
        start = min(inv.sent_at, picked_at)
        attributes: dict[str, Any] = {names.TASK_ID: inv.task_id}
        if queue:
            attributes[names.QUEUE] = queue
        span = tracing.tracer().start_span(QUEUE_WAIT, context=tracing.context_of(inv.trace),
                                           start_time=_ns(start), attributes=attributes)
        span.end(end_time=_ns(picked_at))
    except Exception as e:  # a span never fails a call
        log.debug("queue_wait span: %s", e)


@contextlib.contextmanager
def tool(inv: ToolInvocation, known: bool, hostname: str) -> Iterator[Span | None]:
    """`toolq.tool {tool}` around the handler, current while it runs (its commands' spans and its
    MCP call hang under it). `ended` sets its final state."""
    if not _traced:
        yield None
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    attributes = {names.TOOL_NAME: _tool_label(inv, known), names.TASK_ID: inv.task_id,
                  names.TOOL_CALL_ID: inv.call_id[:128], names.WORKER: hostname, names.HOST: socket.gethostname()}
    span = tracing.tracer().start_span(f"{TOOL} {_tool_label(inv, known)}", context=tracing.context_of(inv.trace),
                                       attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        otel_context.detach(token)
        span.end()


def ended(span: Span | None, state: CallState) -> None:
    """The call's final state on its `toolq.tool` span; an error status when it did not complete."""
    if span is None:
        return
    try:
        span.set_attribute(names.CALL_STATE, state.value)
        if state is not CallState.COMPLETED:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute(names.ERROR_TYPE, state.value)
            span.set_status(Status(StatusCode.ERROR, state.value))
    except Exception as e:
        log.debug("tool span: %s", e)


@contextlib.contextmanager
def result_store(state: str) -> Iterator[None]:
    """`toolq.result.store` around Celery's store of the call's final meta (not its STARTED one)."""
    if not _traced or state not in _READY or _parent is None:  # untraced: the tool span is the one root
        yield
        return
    span = tracing.tracer().start_span(RESULT_STORE, context=tracing.context_of(_parent),
                                       attributes={"toolq.result.state": state})
    try:
        yield
    finally:
        span.end()


def call_ended() -> None:
    """At the task's end: forget the call's parent. Its spans are not exported here: they leave with
    the batch processor's next export (`OTEL_BSP_SCHEDULE_DELAY`, 5 s by default), many calls' in
    one request, and what a child still holds goes before it exits (`child_exiting`). An export
    per call, waited for at each task's end, cost the fleet 25-30% of its calls/s on the bench
    (docs/benchmarks.md, telemetry), and a collector that was down held every call's end ~7 s."""
    global _parent, _traced
    _parent, _traced = None, False


def child_exiting() -> None:
    """A pool child on its way out (replaced, or its pool closing): what it holds goes out first."""
    if tracing.on():
        exit_flush(lambda: tracing.flush(EXIT_FLUSH_TIMEOUT))


def exit_flush(work: Callable[[], object]) -> bool:
    """An exporter's flush as a pool child exits (its spans, its OTLP metric points), waited for at
    most EXIT_FLUSH_TIMEOUT; not at all for EXIT_BACKOFF after one, in any process of this
    worker, that did not finish in time. Whether it finished."""
    now = time.monotonic()  # CLOCK_MONOTONIC: one clock for all the machine's processes
    if now < struct.unpack("d", _down_until[:8])[0]:
        return False
    if tracing.within(work, EXIT_FLUSH_TIMEOUT):
        return True
    _down_until[:8] = struct.pack("d", time.monotonic() + EXIT_BACKOFF)
    log.warning("telemetry: the collector did not take a pool child's export in %gs; children exiting in the "
                "next %gs do not wait for theirs", EXIT_FLUSH_TIMEOUT, EXIT_BACKOFF)
    return False


# --- spans inside a handler: children of whatever span is current (the call's `toolq.tool`) ------

def _current_traced() -> bool:
    return _traced and tracing.on()


def start(name: str, attributes: dict[str, Any] | None = None, start_time: float | None = None,
          kind: str = "internal") -> Span | None:
    """A span under the current one (None when this call is not traced); the caller ends it."""
    if not _current_traced():
        return None
    from opentelemetry.trace import SpanKind

    try:
        return tracing.tracer().start_span(
            name, attributes=attributes, start_time=None if start_time is None else _ns(start_time),
            kind=SpanKind.CLIENT if kind == "client" else SpanKind.INTERNAL)
    except Exception as e:
        log.debug("span %s: %s", name, e)
        return None


def end(span: Span | None, end_time: float | None = None, error: str | None = None,
        **attributes: Any) -> None:
    if span is None:
        return
    try:
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)
        if error:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute(names.ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=None if end_time is None else _ns(end_time))
    except Exception as e:
        log.debug("span end: %s", e)


def start_command(command: Any, backend: str | None = None, session_host: bool = False) -> Span | None:
    """`toolq.command` under the current span: the command's text only when content capture is on.
    `session_host`: run by the worker's session host (its sandbox cell), not by this process."""
    if not _current_traced():
        return None
    attributes = command_attributes(command, backend)
    if session_host:
        attributes[SESSION_HOST] = True
    return start(COMMAND, attributes)


def command_attributes(command: Any, backend: str | None = None) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    if backend:
        attributes[SANDBOX_BACKEND] = backend
    if tracing.capture_content():
        text = command if isinstance(command, str) else " ".join(str(a) for a in command)
        attributes[COMMAND_LINE] = text[:4096]
    return attributes


def sandbox_started(backend: str, started: float, ended_at: float | None = None) -> None:
    """`toolq.sandbox.start`: from `started` to `ended_at` (now), under the current span."""
    span = start(SANDBOX_START, {SANDBOX_BACKEND: backend}, start_time=started)
    end(span, end_time=ended_at)


def start_mcp_call(server: str, tool: str, stdio: bool = True) -> Span | None:
    """`tools/call {tool}`, a client span (the MCP conventions' name and attributes) under the
    current one: its context goes to the MCP host, which sends it in the request's `_meta`."""
    if not _current_traced():
        return None
    return start(f"{MCP_CALL} {server}.{tool}", {
        "mcp.method.name": MCP_CALL, names.TOOL_NAME: f"{server}.{tool}", names.OPERATION: "execute_tool",
        "mcp.server.name": server, "network.transport": "pipe" if stdio else "tcp"}, kind="client")


def context_of_span(span: Span | None) -> TraceContext | None:
    """A span's W3C context, for a request to another process of this worker (the MCP host)."""
    return None if span is None else tracing.span_context(span)


def now() -> float:
    return time.time()
