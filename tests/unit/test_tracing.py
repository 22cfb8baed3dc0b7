"""Traces' pure parts (toolq/telemetry/tracing.py, toolq/orchestrator/spans.py, the Flower trace
field, the loopback OTLP sink): turned on only by the variables, nothing loaded when off, the
context round trip, a forked child's own provider, the call's span on the in-memory barrier and
its context in the invocation it sends. The whole path over real workers is
tests/integration/test_traces.py."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from tests.unit.conftest import OTEL_VARIABLES
from toolq.core import tracing as names
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName, ToolResult
from toolq.core.catalog import ToolSpec
from toolq.core.flower_args import flower_args
from toolq.core.honest import Known
from toolq.core.states import CallState
from toolq.core.tracing import TraceContext
from toolq.dev.otlp_sink import OtlpSink, decode_traces
from toolq.orchestrator import spans
from toolq.orchestrator.protocol.events import Completed, Incomplete, OutputItemDone, Usage
from toolq.telemetry import tracing

from .test_barrier import Harness, sync

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"



def run_python(code: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


# --- on and off -----------------------------------------------------------------------------------

@pytest.mark.parametrize("env, on", [
    ({}, False),
    ({"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, False),  # an endpoint alone turns nothing on
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "zipkin,otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
])
def test_only_the_standard_variables_turn_traces_on(env, on):
    assert tracing.wanted(env) is on


def test_off_loads_no_sdk_starts_no_thread_and_every_span_call_is_a_no_op():
    out = run_python("""
        import sys, threading
        from toolq.telemetry import tracing
        from toolq.orchestrator import spans, barrier, turn
        before = threading.active_count()
        print(tracing.setup(), tracing.on(), tracing.current_context(), tracing.flush())
        print(spans.start_turn("turn-x", None), spans.start_chat(None, "m", {}))
        print(threading.active_count() - before)
        print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter"))))
    """, {})
    assert out.split("\n")[:4] == ["False False None True", "None None", "0", "[]"]


def test_on_exports_to_the_endpoint_with_the_service_and_a_fresh_instance_per_process():
    with OtlpSink() as sink:
        code = """
            import os
            from toolq.telemetry import tracing
            assert tracing.setup(tracing.WORKER)
            with tracing.tracer().start_as_current_span("parent"):
                tc = tracing.current_context()
            with tracing.tracer().start_as_current_span("child", context=tracing.context_of(tc)):
                pass
            print(tc.traceparent)
            pid = os.fork()
            if pid == 0:  # a prefork pool's child: its own provider, its spans exported by it
                assert tracing.on() is False and tracing.setup(tracing.WORKER)
                with tracing.tracer().start_as_current_span("in-child", context=tracing.context_of(tc)):
                    pass
                tracing.flush()
                os._exit(0)
            os.waitpid(pid, 0)
            tracing.flush()
        """
        out = run_python(code, sink.env())
        traceparent = out.split()[0]
        got = sink.wait_for(lambda s: {"parent", "child", "in-child"} <= {x.name for x in s})
    by = {s.name: s for s in got}
    tc = TraceContext(traceparent=traceparent)
    assert by["parent"].parent_id == "" and by["parent"].span_id == traceparent[36:52]
    assert by["child"].parent_id == by["parent"].span_id == by["in-child"].parent_id
    assert {s.trace_id for s in got} == {tc.trace_id}
    assert {s.service for s in got} == {"toolq-worker"}
    assert by["in-child"].resource["service.instance.id"] != by["parent"].resource["service.instance.id"]
    assert not sink.errors


def test_a_broken_exporter_setting_leaves_tracing_off_with_one_line():
    out = run_python("""
        from toolq.telemetry import tracing
        print(tracing.setup(), tracing.on())
    """, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"})
    assert out.split("\n")[0] == "False False"


def test_traces_asked_for_without_the_otel_extra_leave_tracing_off_with_one_line_naming_it():
    # The SDK is the `otel` extra: a process where it cannot be imported (None in sys.modules makes
    # its import fail, as an install without the extra does) says what to install, once, and runs on.
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import logging, sys
        sys.modules["opentelemetry.sdk"] = None
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from toolq.telemetry import tracing
        print(tracing.setup(), tracing.on())
    """)], env={**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_TRACES_EXPORTER": "otlp"},
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split("\n")[0] == "False False", done
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and "pip install 'toolq[otel]'" in said[0], said


def test_the_content_switch_is_the_standard_variable_and_only_true_turns_it_on(monkeypatch):
    monkeypatch.delenv(names.CAPTURE_CONTENT_ENV, raising=False)
    assert not tracing.capture_content()
    monkeypatch.setenv(names.CAPTURE_CONTENT_ENV, "1")
    assert not tracing.capture_content()
    monkeypatch.setenv(names.CAPTURE_CONTENT_ENV, "True")
    assert tracing.capture_content()


# --- contexts, links --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, 7, "", "00-" + "0" * 32 + "-b7ad6b7169203331-01", TP.upper(),
                                   TP + "-x", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                   {"traceparent": TP}])
def test_a_traceparent_that_is_not_w3c_is_no_parent(value):
    assert tracing.parse_traceparent(value) is None


def test_a_w3c_traceparent_is_a_parent_and_an_oversized_tracestate_is_dropped():
    assert tracing.parse_traceparent(TP, "a=b") == TraceContext(traceparent=TP, tracestate="a=b")
    assert tracing.parse_traceparent(TP, "x" * 600) == TraceContext(traceparent=TP)


def test_context_of_none_is_a_new_root_and_of_a_context_its_span(memory):
    with tracing.tracer().start_as_current_span("outer"):
        root = tracing.tracer().start_span("root", context=tracing.context_of(None))
        child = tracing.tracer().start_span("child", context=tracing.context_of(TraceContext(traceparent=TP)))
    assert root.parent is None
    assert child.parent is not None and f"{child.parent.span_id:016x}" == TP[36:52]
    assert f"{child.get_span_context().trace_id:032x}" == TP[3:35]


def test_the_trace_link_fills_in_the_trace_id(monkeypatch):
    monkeypatch.delenv("TOOLQ_TRACE_URL", raising=False)
    assert tracing.trace_link("abc") is None
    assert tracing.trace_link(None, "http://j/{trace_id}") is None
    assert tracing.trace_link("abc", "http://jaeger:16686/trace/{trace_id}") == "http://jaeger:16686/trace/abc"
    monkeypatch.setenv("TOOLQ_TRACE_URL", "https://ui.honeycomb.io/t/")
    assert tracing.trace_link("abc") == "https://ui.honeycomb.io/t/abc"


# --- the call's state, reason and span ------------------------------------------------------------

@pytest.mark.parametrize("state, reason", [
    (CallState.COMPLETED, ""), (CallState.FAILED, ""), (CallState.REJECTED, Known.NOT_RUN.value),
    (CallState.LOST, Known.INTERRUPTED.value), (CallState.TIMED_OUT, Known.STOPPED.value),
    (CallState.CANCELLED, Known.STOPPED.value),
])
def test_the_reason_is_a_known_statement_only_when_toolq_wrote_the_output(state, reason):
    assert spans.output_reason(state) == reason


def recording(h: Harness) -> list[ToolInvocation]:
    """The invocations the harness's step sends, as they leave it (the list fills as they go)."""
    sent: list[ToolInvocation] = []
    send = h.transport.send

    async def keep(inv, spec):  # type: ignore[no-untyped-def]
        sent.append(inv)
        await send(inv, spec)

    h.transport.send = keep  # type: ignore[method-assign]
    return sent


@sync
async def test_each_call_is_an_execute_tool_span_and_its_invocation_carries_that_span(memory, tmp_path):
    h = Harness(tmp_path)
    sent = recording(h)
    turn = spans.start_turn("turn-mem", "conv-1")
    h.step.trace_parent = turn
    # The model's arguments name a trace: it is an argument, nothing more.
    h.add("call_ok", seconds=0.0, text=json.dumps({"traceparent": TP, "_meta": {"traceparent": TP}}))
    h.add("call_exit", name="exits", seconds=0.0)
    h.add("call_unknown", name="no_such_tool")
    await h.step.wait()
    spans.end_turn(turn, "completed")
    got = {s.attributes.get(names.TOOL_CALL_ID): s for s in memory.get_finished_spans()
           if s.name.startswith(names.EXECUTE_TOOL)}
    root = next(s for s in memory.get_finished_spans() if s.name == names.INVOKE_AGENT)
    assert root.attributes[names.CONVERSATION_ID] == "conv-1" and root.parent is None
    assert set(got) == {"call_ok", "call_exit", "call_unknown"}
    ok = got["call_ok"]
    assert ok.name == "execute_tool sleep_echo" and ok.parent.span_id == root.context.span_id
    assert ok.attributes[names.CALL_STATE] == "completed" and names.OUTPUT_REASON not in ok.attributes
    assert ok.attributes[names.TOOL_TYPE] == "function" and ok.attributes[names.QUEUE].startswith("toolq.t.sleep_echo.")
    assert ok.attributes[names.TASK_ID].startswith("turn-mem:0:0:")
    assert names.TOOL_ARGUMENTS not in ok.attributes and names.TOOL_RESULT not in ok.attributes  # no content
    assert got["call_exit"].attributes[names.CALL_STATE] == "failed"
    unknown = got["call_unknown"]
    assert unknown.name == "execute_tool"  # the model's made-up name is not a span name
    assert unknown.attributes[names.CALL_STATE] == "rejected"
    assert unknown.attributes[names.OUTPUT_REASON] == "not run"
    by_call = {inv.call_id: inv for inv in sent}
    assert by_call["call_ok"].trace is not None
    assert by_call["call_ok"].trace.traceparent[36:52] == f"{ok.context.span_id:016x}"
    assert by_call["call_ok"].trace.trace_id == f"{root.context.trace_id:032x}"


@sync
async def test_with_the_content_switch_a_call_span_holds_its_arguments_and_output(memory, tmp_path, monkeypatch):
    monkeypatch.setenv(names.CAPTURE_CONTENT_ENV, "true")
    h = Harness(tmp_path)
    h.add("call_ok", seconds=0.0, text="the output")
    await h.step.wait()
    (span,) = memory.get_finished_spans()
    assert json.loads(span.attributes[names.TOOL_ARGUMENTS]) == {"seconds": 0.0, "text": "the output"}
    assert span.attributes[names.TOOL_RESULT] == "the output"
    assert span.parent is None  # no turn, no span of the caller's: a root


@sync
async def test_off_the_invocation_carries_no_trace(tmp_path, monkeypatch):
    for var in OTEL_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    tracing.reset_for_tests()
    h = Harness(tmp_path)
    sent = recording(h)
    h.add("call_ok", seconds=0.0)
    await h.step.wait()
    assert [inv.trace for inv in sent] == [None] and h.step.entries[0].span is None


def test_a_chat_span_has_the_model_usage_response_and_finish_reason_and_no_text(memory):
    from toolq.core.items import FunctionCallItem

    span = spans.start_chat(None, "gpt-5", {"input": [{"role": "user", "content": "secret prompt"}]})
    record = spans.ChatRecord()
    record.event(OutputItemDone.model_construct(output_index=0, item=FunctionCallItem(call_id="c", name="t",
                                                                                          arguments="{}")))
    record.event(Completed(response_id="resp_1", model="gpt-5-2025", usage=Usage(input_tokens=11, output_tokens=7)))
    spans.end_chat(span, record)
    (s,) = memory.get_finished_spans()
    assert s.name == "chat gpt-5"
    a = s.attributes
    assert (a[names.REQUEST_MODEL], a[names.RESPONSE_MODEL], a[names.RESPONSE_ID]) == ("gpt-5", "gpt-5-2025", "resp_1")
    assert (a[names.INPUT_TOKENS], a[names.OUTPUT_TOKENS], tuple(a[names.FINISH_REASONS])) == (11, 7, ("tool_calls",))
    assert "secret prompt" not in json.dumps(dict(a))


def test_a_failed_chat_says_its_error_type_and_an_incomplete_one_its_reason(memory):
    from toolq.orchestrator.model_client import ModelError

    span = spans.start_chat(None, "m", {})
    record = spans.ChatRecord()
    record.event(Incomplete(reason="max_output_tokens"))
    spans.end_chat(span, record, ModelError("Incomplete response returned", retryable=False))
    (s,) = memory.get_finished_spans()
    assert tuple(s.attributes[names.FINISH_REASONS]) == ("length",)
    assert s.attributes[names.ERROR_TYPE] == "ModelError" and s.status.status_code.name == "ERROR"


# --- Flower -----------------------------------------------------------------------------------------

def _spec() -> ToolSpec:
    return ToolSpec(name="t", description="d", parameters={"type": "object", "properties": {"a": {}}})


def test_flower_shows_the_trace_link_or_id_only_for_a_w3c_context(monkeypatch):
    monkeypatch.delenv("TOOLQ_TRACE_URL", raising=False)
    inv = {"call_id": "c", "turn_id": "t", "payload": {"kind": "function", "arguments": '{"a": 1}'}}
    assert "trace" not in flower_args(inv, _spec())
    assert "trace" not in flower_args({**inv, "trace": {"traceparent": "nope"}}, _spec())
    traced = {**inv, "trace": {"traceparent": TP}}
    assert flower_args(traced, _spec()) == f"(call_id='c', turn='t', a=1, trace='{TP[3:35]}')"
    shown = flower_args(traced, _spec(), "http://jaeger:16686/trace/{trace_id}")
    assert shown.endswith(f"trace='http://jaeger:16686/trace/{TP[3:35]}')")
    monkeypatch.setenv("TOOLQ_TRACE_URL", "http://x/{trace_id}" + "y" * 500)  # the worker's end reads the variable
    assert len(flower_args(traced, None)) < 300


def test_the_invocation_carries_its_trace_in_the_signed_body():
    from toolq.core.signing import Signer

    signer = Signer("k" * 32)
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName(name="x"),
                         payload=FunctionPayload(arguments="{}"), deadline=time.time() + 60,
                         trace=TraceContext(traceparent=TP), sent_at=1.5)
    body = inv.model_dump(mode="json")
    signature = signer.sign_invocation("toolq.run", inv.task_id, body)
    assert signer.invocation_refusal("toolq.run", inv.task_id, body, signature) is None
    moved = {**body, "trace": {"traceparent": TP.replace("b7ad", "c7ad"), "tracestate": ""}}
    assert signer.invocation_refusal("toolq.run", inv.task_id, moved, signature) is not None
    assert ToolInvocation.model_validate(body).trace == TraceContext(traceparent=TP)


def test_a_result_of_a_call_is_what_its_span_ends_with(memory):
    from toolq.orchestrator.binding import BoundCall

    call = BoundCall(0, "c", "function", "x")
    span = spans.start_tool(None, call)
    spans.end_tool(span, ToolResult(call_id="c", output="x was not run: gone", status=CallState.REJECTED), "w1")
    (s,) = memory.get_finished_spans()
    assert s.attributes[names.OUTPUT_REASON] == "not run" and s.attributes[names.WORKER] == "w1"
    assert s.attributes[names.ERROR_TYPE] == "rejected"


# --- the loopback sink --------------------------------------------------------------------------------

def _request(sink: OtlpSink, path: str, body: bytes, gzipped: bool) -> int:
    headers = {"Content-Type": "application/x-protobuf"}
    if gzipped:
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    req = urllib.request.Request(sink.endpoint + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("gzipped", [False, True])
def test_the_sink_decodes_otlp_protobuf_plain_and_gzipped(gzipped):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    span = Span(trace_id=bytes.fromhex(TP[3:35]), span_id=bytes(range(1, 9)), parent_span_id=bytes(range(2, 10)),
                name="execute_tool x", attributes=[KeyValue(key="k", value=AnyValue(int_value=3))])
    rs = ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])
    rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value="svc")))
    body = ExportTraceServiceRequest(resource_spans=[rs]).SerializeToString()
    assert decode_traces(body)[0].name == "execute_tool x"
    with OtlpSink() as sink:
        assert _request(sink, "/v1/traces", body, gzipped) == 200
        assert _request(sink, "/v1/traces", b"\xff\xff not protobuf", gzipped) == 400
        assert _request(sink, "/v1/logs", body, gzipped) == 404
        (got,) = sink.wait_for(lambda s: len(s) == 1)
    assert (got.trace_id, got.span_id, got.parent_id) == (TP[3:35], "0102030405060708", "0203040506070809")
    assert (got.service, got.attributes) == ("svc", {"k": 3})
    assert len(sink.errors) == 1


def test_the_sink_takes_the_sdks_own_metric_export():
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    with OtlpSink() as sink:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=sink.endpoint + "/v1/metrics"),
                                               export_interval_millis=60_000)
        provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "m"}))
        meter = provider.get_meter("t")
        meter.create_counter("toolq_calls").add(2, {"state": "completed"})
        meter.create_histogram("toolq_run").record(0.5)
        provider.force_flush()
        provider.shutdown()
    points = {p.name: p for p in sink.points}
    assert points["toolq_calls"].value == 2 and points["toolq_calls"].attributes == {"state": "completed"}
    assert points["toolq_run"].value == 1 and points["toolq_calls"].service == "m"
