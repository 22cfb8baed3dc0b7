"""The worker's spans join the trace its signed invocation names (issue 30).

Real parts: a private Redis, real `toolq worker` processes (prefork), OTLP over HTTP to a receiver
on loopback that decodes the protobuf it gets (opentelemetry-proto), and an MCP server written
with the official SDK that exports its own span under the `_meta.traceparent` the worker's MCP
host sent it. The test plays the orchestrator: each call carries a `TraceContext` standing for its
`execute_tool` span, signed with the rest of the invocation.

The workers export on the batch processor's schedule (200 ms here), except where a child is
replaced after each call (`--max-tasks-per-child 1`): there the schedule is 10 minutes away
(OTEL_BSP_SCHEDULE_DELAY), so a span arrives only because the child exported it before it exited.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.integration.signed import bound, run_signed
from toolq.core.advert import tool_queue
from toolq.core.calls import ToolName
from toolq.core.catalog import ToolSpec
from toolq.core.session_records import conversation_key
from toolq.core.tracing import TraceContext
from toolq.dev.bench.mcp import McpWorkerProcess
from toolq.dev.otlp_sink import OtlpSink, SinkSpan
from toolq.local.embedded import RedisServer, WorkerProcess
from toolq.workers import isolation
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration

MARKER = "zq-secret-marker"
"""In every command: no span may hold it unless content capture is on."""


# --- the loopback OTLP/HTTP receiver (toolq.dev.otlp_sink) ----------------------------------------

@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpSink]:
    with OtlpSink() as sink:
        yield sink


def wait_for(sink: OtlpSink, trace_id: str, names: set[str], timeout: float = 30) -> list[SinkSpan]:
    """The trace's spans once every name is among them (a name matched by its prefix)."""
    def done(spans: list[SinkSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return all(any(s.name.startswith(n) for s in mine) for n in names)

    return [s for s in sink.wait_for(done, timeout) if s.trace_id == trace_id]


def dump(spans: list[SinkSpan]) -> str:
    """Everything the spans hold, as text (to look for content in it)."""
    return json.dumps([dataclasses.asdict(s) for s in spans], default=str)


def otel_env(receiver: OtlpSink, **more: str) -> dict[str, str]:
    """Traces to the sink, exported on the batch processor's schedule (the sink's 200 ms)."""
    return {**WORKER_ENV, **receiver.env(), **more}


class RecyclingWorker(WorkerProcess):
    """`toolq worker --max-tasks-per-child 1`: each pool child runs one call and is replaced."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--max-tasks-per-child", "1"]


# --- the orchestrator's part: a signed invocation under a parent span -------------------------------

def parent_context() -> TraceContext:
    """What an orchestrator's `execute_tool` span would carry: a fresh trace, sampled."""
    return TraceContext(traceparent=f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")


def send(redis_url: str, spec: ToolSpec, name: ToolName, arguments: dict[str, Any], workspace: Path,
         trace: TraceContext | None, timeout: float = 60, conversation: str | None = None) -> dict[str, Any]:
    """One call, signed and sent to its declaration's queue as the orchestrator sends it; its result."""
    inv = bound(spec, arguments, name=name, timeout=timeout, workspace=str(workspace), turn_prefix="turn-tr",
                trace=trace, sent_at=time.time(), conversation=conversation)
    return run_signed(redis_url, inv, tool_queue(spec), timeout=timeout)


def exec_spec() -> ToolSpec:
    return next(s for s in load_catalog([TEST_TOOLS]) if s.name == "exec_command")


def by_name(spans: list[SinkSpan], prefix: str) -> SinkSpan:
    found = [s for s in spans if s.name.startswith(prefix)]
    assert len(found) == 1, f"{prefix}: {[s.name for s in spans]}"
    return found[0]


def sandboxed() -> bool:
    sandbox = isolation.current()
    return sandbox.backend != "none" and not sandbox.unavailable


# --- the tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def traced_worker(redis_env, receiver, tmp_path_factory) -> Iterator[WorkerProcess]:
    """On a Redis of this module's own: no other test's worker (untraced) takes these calls."""
    w = WorkerProcess(redis_env.url, name="traced@test", queues=["toolq"], concurrency=1, tools=[TEST_TOOLS],
                      env=otel_env(receiver), logdir=tmp_path_factory.mktemp("traced"))
    w.start()
    yield w
    w.stop(grace=5)


def test_a_calls_spans_join_its_invocations_trace_under_the_right_parents(traced_worker, redis_env, receiver,
                                                                          tmp_path):
    parent = parent_context()
    result = send(redis_env.url, exec_spec(), ToolName.plain("exec_command"),
                  {"cmd": f"echo {MARKER}; exit 3"}, tmp_path, parent)
    assert result["exit_code"] == 3 and MARKER in str(result["output"])

    wanted = {"toolq.queue_wait", "toolq.tool exec_command", "toolq.command", "toolq.result.store"}
    if sandboxed():
        wanted.add("toolq.sandbox.start")
    spans = wait_for(receiver, parent.trace_id, wanted)
    parent_id = parent.traceparent[36:52]
    tool = by_name(spans, "toolq.tool exec_command")
    assert tool.parent_id == parent_id
    assert by_name(spans, "toolq.queue_wait").parent_id == parent_id
    assert by_name(spans, "toolq.result.store").parent_id == parent_id
    command = by_name(spans, "toolq.command")
    assert command.parent_id == tool.span_id
    assert command.attributes["process.exit.code"] == 3
    if sandboxed():
        assert by_name(spans, "toolq.sandbox.start").parent_id == tool.span_id
    attributes = tool.attributes
    assert attributes["toolq.worker"] == "traced@test" and attributes["toolq.host"]
    assert attributes["gen_ai.tool.name"] == "exec_command" and attributes["toolq.call.state"] == "failed"
    assert {s.service for s in spans} == {"toolq-worker"}
    # No content without the switch: the command's text is in no span.
    assert "process.command_line" not in command.attributes
    assert MARKER not in dump(spans)


def test_a_command_the_session_host_runs_is_the_calls_command_span(traced_worker, redis_env, receiver, tmp_path):
    """exec_command of a conversation runs in the worker's session host: its span is still the
    call's `toolq.command`, under its `toolq.tool`."""
    r = redis.Redis.from_url(redis_env.url)
    try:
        conversation = "conv-" + secrets.token_hex(4)
        r.set(conversation_key(conversation), "1", ex=600)  # alive, as its orchestrator keeps it
        parent = parent_context()
        result = send(redis_env.url, exec_spec(), ToolName.plain("exec_command"), {"cmd": f"echo {MARKER}"},
                      tmp_path, parent, conversation=conversation)
    finally:
        r.close()
    assert MARKER in str(result["output"])
    wanted = {"toolq.tool exec_command", "toolq.command", "toolq.result.store"}
    if sandboxed():
        wanted.add("toolq.sandbox.start")
    spans = wait_for(receiver, parent.trace_id, wanted)
    command = by_name(spans, "toolq.command")
    tool = by_name(spans, "toolq.tool exec_command")
    assert command.parent_id == tool.span_id
    if sandboxed():  # the session host's spawn, timed there, a span of the pool child's
        start = by_name(spans, "toolq.sandbox.start")
        assert start.parent_id == tool.span_id and start.attributes["toolq.sandbox.backend"] == isolation.current().backend
    assert command.attributes["toolq.session_host"] is True and command.attributes["process.exit.code"] == 0
    assert MARKER not in dump(spans)


def test_a_call_without_a_trace_context_takes_no_parent_from_what_it_runs(traced_worker, redis_env, receiver,
                                                                          tmp_path):
    """Only the signed invocation names a parent: a command printing a traceparent, or a file in the
    workspace holding one, sets none; the call's spans start a trace of their own."""
    planted = parent_context()
    (tmp_path / "traceparent").write_text(planted.traceparent)
    send(redis_env.url, exec_spec(), ToolName.plain("exec_command"),
         {"cmd": f"export TRACEPARENT={planted.traceparent}; echo traceparent: {planted.traceparent}"}, tmp_path, None)
    spans = receiver.wait_for(lambda spans: any(s.name == "toolq.tool exec_command" and not s.parent_id
                                                for s in spans))
    (root,) = [s for s in spans if s.name == "toolq.tool exec_command" and not s.parent_id]
    # One trace for the call, its tool span the root: no queue wait or result store of their own.
    receiver.wait_for(lambda spans: any(s.name == "toolq.command" and s.trace_id == root.trace_id for s in spans))
    assert not [s.name for s in receiver.snapshot() if not s.parent_id and s.name != "toolq.tool exec_command"]
    assert receiver.trace(planted.trace_id) == []
    assert planted.traceparent[36:52] not in {s.parent_id for s in receiver.snapshot()}


def test_no_span_is_lost_when_each_pool_child_is_replaced_after_its_task(receiver, tmp_path):
    """`--max-tasks-per-child 1`: each call's child exits after it (the batch processor's own
    schedule is 10 minutes away); with content capture on, the command's text is in its span."""
    server = RedisServer().__enter__()  # its own: the module's traced worker takes no call of this test
    w = RecyclingWorker(server.url, name="recycling@test", queues=["toolq"], concurrency=2,
                        tools=[TEST_TOOLS], env=otel_env(receiver, OTEL_BSP_SCHEDULE_DELAY="600000",
                                     OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true"),
                        logdir=tmp_path)
    spec = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "noop")
    w.start()
    try:
        parents = []
        for i in range(4):
            parent = parent_context()
            parents.append(parent)
            if i % 2:
                send(server.url, exec_spec(), ToolName.plain("exec_command"), {"cmd": f"echo {MARKER}"},
                     tmp_path, parent)
            else:
                send(server.url, spec, ToolName.plain("noop"), {}, tmp_path, parent)
        pids = set()
        for i, parent in enumerate(parents):
            tool = "toolq.tool exec_command" if i % 2 else "toolq.tool noop"
            spans = wait_for(receiver, parent.trace_id, {"toolq.queue_wait", tool, "toolq.result.store"})
            pids |= {s.resource.get("process.pid") for s in spans}
            if i % 2:
                spans = wait_for(receiver, parent.trace_id, {"toolq.command"})
                assert MARKER in by_name(spans, "toolq.command").attributes["process.command_line"]
        assert len(pids) == 4, "each call ran in a pool child of its own"
    finally:
        w.stop(grace=5)
        server.__exit__(None, None, None)


TRACED_SERVER = '''
"""An MCP server (the official SDK's FastMCP, stdio) that exports its own span, a child of the
request's `_meta.traceparent`, to the OTLP endpoint on its command line."""
import sys

from mcp.server.fastmcp import Context, FastMCP
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

provider = TracerProvider(resource=Resource.create({"service.name": "traced-mcp-server"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1])))
tracer = provider.get_tracer("traced-mcp-server")
server = FastMCP("traced", log_level="WARNING")


@server.tool()
def echo(text: str, ctx: Context) -> str:
    """Say it back."""
    meta = ctx.request_context.meta
    carrier = {k: v for k, v in (meta.model_extra or {}).items() if k in ("traceparent", "tracestate")} if meta else {}
    with tracer.start_as_current_span("traced.echo handled", context=TraceContextTextMapPropagator().extract(carrier)):
        pass
    # A reply naming another trace: the worker must not take it as a parent of anything.
    return "echo: " + text + " traceparent: 00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


server.run()
'''


def test_an_mcp_server_gets_the_calls_context_in_meta_and_its_span_joins_the_trace(redis_env, receiver, tmp_path):
    from tests.integration.test_mcp import fleet_mcp_tools

    script = tmp_path / "traced_server.py"
    script.write_text(TRACED_SERVER)
    w = McpWorkerProcess(redis_env.url, name="mcptraced@test", queues=["mcptraced"], concurrency=1,
                         tools=[TEST_TOOLS], env=otel_env(receiver), logdir=tmp_path,
                         mcp=[f"traced={sys.executable} {script} {receiver.endpoint}/v1/traces"])
    w.start()
    try:
        end = time.monotonic() + 30
        while "echo" not in (offered := fleet_mcp_tools(redis_env.url)).get("traced", {}):
            assert time.monotonic() < end, "the fleet never offered traced.echo"
            time.sleep(0.1)
        spec = offered["traced"]["echo"]
        parent = parent_context()
        result = send(redis_env.url, spec, spec.tool_name, {"text": "hello"}, tmp_path, parent)
        assert "echo: hello" in str(result["output"])
        spans = wait_for(receiver, parent.trace_id, {"toolq.tool traced.echo", "tools/call traced.echo",
                                                    "traced.echo handled", "toolq.result.store"})
    finally:
        w.stop(grace=5)
    tool = by_name(spans, "toolq.tool traced.echo")
    call = by_name(spans, "tools/call traced.echo")
    handled = by_name(spans, "traced.echo handled")
    # orchestrator's context -> worker's tool span -> its MCP client span -> the server's own span
    assert tool.parent_id == parent.traceparent[36:52]
    assert call.parent_id == tool.span_id and call.kind == 3  # SPAN_KIND_CLIENT
    assert call.attributes["mcp.method.name"] == "tools/call"
    assert handled.parent_id == call.span_id and handled.service == "traced-mcp-server"
    # The server's reply named another trace: nothing joined it.
    assert receiver.trace("ab" * 16) == []
