"""OpenTelemetry traces for both ends of a queue, off unless the standard variables turn them on.

On: `OTEL_TRACES_EXPORTER=otlp` (or `console`), the exporter's endpoint from
`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, its protocol from `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`
(`http/protobuf`, the default, or `grpc`). Off: that variable unset or `none`, or
`OTEL_SDK_DISABLED=true`. Off costs one environment read per process: neither the SDK nor the API
is imported (the API alone takes ~40 ms), no thread, no socket. Call sites ask `on()` first.

`setup(service)` makes this process's provider (again in a forked child, whose parent's batch
thread is gone); `tracer()` is toolq's tracer on it. A call's context crosses the queue as a
`TraceContext` (W3C) inside the signed invocation: `current_context()` writes it, `context_of()`
reads it back as a parent.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from toolq.core.tracing import CAPTURE_CONTENT_ENV, TRACEPARENT, TraceContext

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("toolq.tracing")

ORCHESTRATOR = "toolq-orchestrator"
WORKER = "toolq-worker"
MCP_SERVER = "toolq-mcp-server"

_EXPORTERS = ("otlp", "console")

_lock = threading.Lock()
_provider: TracerProvider | None = None
_pid: int | None = None
"""The process `_provider` was made in: a forked child makes its own."""
_on = False
_global_set = False
_tracer: Tracer | None = None
"""toolq's tracer on `_provider` (made once: the SDK's `get_tracer` costs ~40 us a call)."""
"""Whether this process tree gave the API its global provider (once: the API refuses a second)."""


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the variables turn traces on (`OTEL_TRACES_EXPORTER` otlp or console, the SDK not
    disabled). Reads the environment only."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    return bool(exporters & set(_EXPORTERS))


def setup(service: str = ORCHESTRATOR) -> bool:
    """Make this process's tracer provider if the variables ask for one; whether tracing is on.
    Idempotent per process; a forked child (a prefork pool's) makes its own. `OTEL_SERVICE_NAME`
    overrides `service`."""
    global _provider, _pid, _on, _tracer
    if _pid == os.getpid():
        return _on
    with _lock:
        if _pid == os.getpid():
            return _on
        if not wanted():
            _provider, _pid, _on = None, os.getpid(), False
            return False
        try:
            provider = _make_provider(service)
        except ImportError as e:
            log.warning("tracing is off: OTEL_TRACES_EXPORTER asks for traces but the OpenTelemetry SDK is not "
                        "installed (pip install 'toolq[otel]'): %s", e)
            _provider, _pid, _on = None, os.getpid(), False
            return False
        except Exception as e:  # a bad variable must not stop a worker or a turn
            log.warning("tracing is off: %s", e)
            _provider, _pid, _on = None, os.getpid(), False
            return False
        _provider, _pid, _on, _tracer = provider, os.getpid(), True, None
        return True


def _make_provider(service: str) -> TracerProvider:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({
        "service.name": os.environ.get("OTEL_SERVICE_NAME") or service,
        "service.instance.id": f"{uuid.uuid4()}",
        "process.pid": os.getpid(),
    })
    provider = TracerProvider(resource=resource)
    exporters = {e.strip().lower() for e in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")}
    if "otlp" in exporters:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    if "console" in exporters:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    global _global_set
    if not _global_set:  # the first provider of this process tree: other libraries' spans join it too
        trace.set_tracer_provider(provider)
        _global_set = True
    return provider


def _otlp_exporter() -> Any:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc()
    if protocol not in ("http/protobuf", "http"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def install(provider: TracerProvider) -> None:
    """Use this provider (an application's own, or a test's in-memory one) instead of one made from
    the variables: tracing is on in this process from now."""
    global _provider, _pid, _on, _tracer
    with _lock:
        _provider, _pid, _on, _tracer = provider, os.getpid(), True, None


def on() -> bool:
    """Whether this process traces (after `setup`): call sites skip all span work when not."""
    return _on and _pid == os.getpid()


def tracer() -> Tracer:
    """toolq's tracer: on this process's provider, else the API's no-op one (importing the API)."""
    global _tracer
    if on():
        if _tracer is None:
            assert _provider is not None
            _tracer = _provider.get_tracer("toolq")
        return _tracer
    from opentelemetry import trace

    return trace.get_tracer("toolq")


def current_context() -> TraceContext | None:
    """The current span's W3C context, to carry in an invocation; None when there is no valid span."""
    if not on():
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return TraceContext(traceparent=f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}",
                        tracestate=ctx.trace_state.to_header() if ctx.trace_state else "")


def span_context(span: Any) -> TraceContext | None:
    """A span's W3C context (a span not current here, such as a call's `execute_tool`)."""
    if not on() or span is None:
        return None
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return TraceContext(traceparent=f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}",
                        tracestate=ctx.trace_state.to_header() if ctx.trace_state else "")


def context_of(tc: TraceContext | None) -> Context:
    """An OTel context whose parent is `tc`'s span; an empty one (a new root) for None."""
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if tc is None:
        return Context()
    carrier = {"traceparent": tc.traceparent}
    if tc.tracestate:
        carrier["tracestate"] = tc.tracestate
    return TraceContextTextMapPropagator().extract(carrier, context=Context())


def parse_traceparent(value: Any, tracestate: Any = None) -> TraceContext | None:
    """A client's own `traceparent` (and `tracestate`), checked; None when it is not one. Only a
    front door's own client request gives one: never a model's argument, a tool's output or a file."""
    if not isinstance(value, str) or not TRACEPARENT.fullmatch(value):
        return None
    state = tracestate if isinstance(tracestate, str) and len(tracestate) <= 512 else ""
    return TraceContext(traceparent=value, tracestate=state)


def trace_id_of(span: Any) -> str | None:
    """A span's trace id in hex (what `--json` and the trace link carry); None when off."""
    if not on() or span is None:
        return None
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


def flush(timeout_s: float = 5.0) -> bool:
    """Export what this process's spans are waiting for (at a turn's end, before a child exits).
    True when there is nothing left; a cheap no-op when off."""
    if not on() or _provider is None:
        return True
    provider = _provider
    return within(lambda: provider.force_flush(int(timeout_s * 1000)), timeout_s)


def within(work: Callable[[], object], timeout: float) -> bool:
    """Run `work` (an exporter's flush) in a thread of its own, waiting for it at most `timeout`;
    whether it finished by then (and did not answer False). Its failure is logged, never raised.
    The SDK's force_flush exports in the caller's thread and ignores its timeout: a collector that
    never answers held `toolq run`'s end, and each pool child's exit, the exporter's own 10 s."""
    done = threading.Event()

    def run() -> None:
        try:
            if work() is not False:
                done.set()
        except Exception as e:  # an exporter's failure never fails a call
            log.debug("flush: %s", e)

    try:
        threading.Thread(target=run, name="toolq-within", daemon=True).start()
    except RuntimeError:  # no thread to be had (a pool child's bound on processes): not waited for
        return False
    return done.wait(timeout)


def capture_content() -> bool:
    """Whether spans may hold content (prompts, outputs, arguments, command text): only when
    OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true."""
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() == "true"


def trace_link(trace_id: str | None, url: str | None = None) -> str | None:
    """The trace's address in the user's viewer (`TOOLQ_TRACE_URL` with `{trace_id}`), if set."""
    if not trace_id:
        return None
    if url is None:
        url = os.environ.get("TOOLQ_TRACE_URL") or None
    if not url:
        return None
    return url.replace("{trace_id}", trace_id) if "{trace_id}" in url else url.rstrip("/") + "/" + trace_id


def reset_for_tests() -> None:
    """Forget this process's provider (a test that changes the variables sets up again)."""
    global _provider, _pid, _on, _tracer
    with _lock:
        if _provider is not None:
            try:
                _provider.shutdown()
            except Exception:
                pass
        _provider, _pid, _on, _tracer = None, None, False, None
