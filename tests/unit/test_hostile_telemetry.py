"""Issue 30's red team, the pure parts: what a hostile model, command or MCP server could make of
toolq's traces and metrics. Each test is an attack, and asserts it fails. The attacks on real
workers are tests/integration/test_hostile_telemetry.py.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from toolq.core import tracing as names
from toolq.core.calls import FunctionPayload
from toolq.core.errors import ConfigurationError
from toolq.core.items import FunctionCallItem
from toolq.core.settings import Settings
from toolq.orchestrator import spans
from toolq.orchestrator.protocol.events import Completed, OutputItemDone, Usage
from toolq.telemetry import metrics, tracing
from toolq.workers import hardening
from toolq.workers.isolation.policy import Policy

LEAK = "sk-vendor-LEAKED-0123456789"



# --- 1. secrets: a command's environment ---------------------------------------------------------------

WORKER_ENV = {
    "PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
    "OTEL_EXPORTER_OTLP_HEADERS": f"x-honeycomb-team={LEAK}",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer {LEAK}",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS": f"api-key={LEAK}",
    "PROMETHEUS_MULTIPROC_DIR": "/tmp/toolq-metrics-x", "TOOLQ_METRICS_DIR": "/tmp/toolq-metrics-x",
}


def test_a_command_never_gets_the_exporters_headers_or_the_metrics_directory_even_when_the_operator_passes_otel():
    """An operator passes OTEL_* to commands (instrumented test programs): the exporter's headers (a
    vendor's API key, which a command would print into the model's context) and the worker's
    metrics directory (where a command would forge samples) still never reach one."""
    policy = Policy.from_settings(Settings(sandbox_env=["OTEL_*", "PROMETHEUS_*"]))
    env = policy.command_env(dict(WORKER_ENV), home="/tmp/h")
    assert LEAK not in json.dumps(env)
    assert not {"PROMETHEUS_MULTIPROC_DIR", "TOOLQ_METRICS_DIR"} & set(env)
    assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://collector:4318"  # what the operator asked for
    # By default, nothing of either.
    env = Policy.from_settings(Settings()).command_env(dict(WORKER_ENV), home="/tmp/h")
    assert not [k for k in env if k.startswith(("OTEL_", "PROMETHEUS_", "TOOLQ_"))]


@pytest.mark.parametrize("name", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                                  "PROMETHEUS_MULTIPROC_DIR"])
def test_naming_the_exporters_headers_for_commands_is_refused(name):
    with pytest.raises(ConfigurationError, match=name):
        Policy.from_settings(Settings(sandbox_env=[name]))


def test_the_worker_wipes_the_exporters_headers_from_what_proc_environ_shows():
    """An unsandboxed MCP server of the worker's user reads /proc/<worker>/environ where it can:
    the headers are among the values the worker overwrites there."""
    import fnmatch

    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS"):
        assert any(fnmatch.fnmatchcase(name, p) for p in hardening.SECRET_ENV), name


# --- 2. content: secret-named arguments stay hidden with capture on -----------------------------------------

def test_with_capture_on_a_secret_named_argument_is_its_length_only_in_the_call_span(memory, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv(names.CAPTURE_CONTENT_ENV, "true")
    arguments = json.dumps({"text": "shown", "api_key": LEAK, "nested": {"db_password": LEAK, "user": "me"}})
    inv = SimpleNamespace(turn_id="turn-1", task_id="turn-1:0:0:x", payload=FunctionPayload(arguments=arguments))
    call = SimpleNamespace(spec=None, invocation=inv, tool="login", call_id="call_1")
    span = spans.start_tool(None, call)
    assert span is not None
    span.end()
    (s,) = memory.get_finished_spans()
    text = s.attributes[names.TOOL_ARGUMENTS]
    assert LEAK not in text
    args = json.loads(text)
    assert args["text"] == "shown" and args["nested"]["user"] == "me"
    assert args["api_key"] == f"<hidden: {len(LEAK)} chars>"


def test_with_capture_on_a_chat_span_hides_secret_named_arguments_of_the_history_and_the_answer(memory,
                                                                                               monkeypatch):
    monkeypatch.setenv(names.CAPTURE_CONTENT_ENV, "true")
    history = [{"role": "user", "content": "log in"},
               {"type": "function_call", "call_id": "c0", "name": "login",
                "arguments": json.dumps({"user": "me", "password": LEAK})}]
    span = spans.start_chat(None, "gpt-5", {"input": history})
    record = spans.ChatRecord()
    record.event(OutputItemDone.model_construct(output_index=0, item=FunctionCallItem(
        call_id="c1", name="http", arguments=json.dumps({"url": "https://x", "headers": {"Authorization": LEAK}}))))
    record.event(Completed(response_id="r", model="gpt-5", usage=Usage(input_tokens=1, output_tokens=1)))
    spans.end_chat(span, record)
    (s,) = memory.get_finished_spans()
    shown = json.dumps(dict(s.attributes))
    assert LEAK not in shown
    assert "log in" in s.attributes["gen_ai.input.messages"]  # the content switch is on: the rest is there
    assert "https://x" in s.attributes["gen_ai.output.messages"]


def test_masking_keeps_what_is_not_json_or_names_no_secret():
    assert spans.masked_arguments("not json {") == "not json {"
    assert spans.masked_arguments('{"cmd": "ls"}') == '{"cmd": "ls"}'
    assert LEAK not in spans.masked_arguments(json.dumps([{"token": LEAK}]))


# --- 3. parent forging at the front door ---------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, 42, "", "00-" + "0" * 32 + "-" + "1" * 16 + "-01",  # the all-zero trace id is invalid
    "00-" + "a" * 32 + "-" + "0" * 16 + "-01",  # the all-zero span id too
    "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",  # version ff is forbidden
    "00-" + "A" * 32 + "-" + "b" * 16 + "-01",  # upper case
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01\n", "00-" + "a" * 32 + "-" + "b" * 16 + "-01-extra",
    "00-" + "a" * 32 + "-" + "b" * 16 + "-01" + " " * 10_000,
])
def test_a_client_traceparent_that_is_not_w3c_parents_nothing(value):
    tc = tracing.parse_traceparent(value)
    if tc is not None:  # the parser takes it: then OTel must find it invalid, a new root
        from opentelemetry import trace

        assert not trace.get_current_span(tracing.context_of(tc)).get_span_context().is_valid


def test_an_oversized_tracestate_is_dropped():
    tc = tracing.parse_traceparent("00-" + "a" * 32 + "-" + "b" * 16 + "-01", "k=" + "v" * 100_000)
    assert tc is not None and tc.tracestate == ""


# --- 4. cardinality: label values stay bounded ----------------------------------------------------------


def label_values(port: int, label: str) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels[label] for f in text_string_to_metric_families(text) for s in f.samples if label in s.labels}


def test_a_hostile_mcp_servers_thousands_of_tools_do_not_grow_the_tool_label_without_bound(served):
    """An MCP server lists 5,000 tools (or new names at each list_changed): each is declared, and
    each call of one is counted; the label's values stop at TOOL_LABELS, the rest are 'unknown'."""
    names_ = [f"evil.t{i}" for i in range(5000)]
    metrics.know_tools(names_)
    for name in names_:
        metrics.call_settled(name, "completed", "ok", 0.01)
        metrics.limit_wait("rate", name, 0.01)
    tools = label_values(served, "tool")
    assert len(tools) <= metrics.TOOL_LABELS + 1 and "unknown" in tools


def test_an_undeclared_tool_and_a_model_made_up_name_are_unknown(served):
    metrics.know_tools(["exec_command"])
    metrics.call_settled(None, "rejected", "not run: no such tool", 0.0)
    metrics.cancel_to_dead(0.1, tool="rm -rf / #" + "x" * 1000)
    assert label_values(served, "tool") <= {"unknown", "exec_command"}


def test_reason_is_a_known_statement_or_empty_whatever_the_tool_wrote(served):
    """A tool's output that starts like toolq's own statements, or anything else it prints, is no
    label value: reason is '' or one of toolq's Known values."""
    from toolq.core.honest import Known

    metrics.know_tools(["t"])
    for output in ("aborted by user after 1.0s", "not run: x", LEAK, "stopped by toolq" + "!" * 500, "\n" * 10):
        metrics.call_settled("t", "completed", output, 0.0)
    assert label_values(served, "reason") <= {"", *(k.value for k in Known)}


# --- 5. faults: a collector that never answers ---------------------------------------------------------

def test_an_exporters_flush_that_never_returns_is_waited_for_only_its_bound():
    """A pool child's exit flushes its spans and its OTLP metric points; the SDK's force_flush
    ignores its own timeout (a black-holed collector held each recycled child ~10 s for metrics):
    each flush runs in a thread of its own, waited for at most its bound."""
    import threading

    from toolq.telemetry.tracing import within

    release = threading.Event()
    try:
        assert within(lambda: release.wait(600), 0.2) is False  # not waited for past 0.2 s
        assert within(lambda: None, 30) is True  # metrics.flush returns None when done
        assert within(lambda: False, 0.2) is False  # tracing.flush: not all exported
        assert within(lambda: 1 / 0, 0.2) is False  # a failing exporter: logged, never raised
    finally:
        release.set()


def test_after_an_exit_flush_that_did_not_finish_the_next_exits_do_not_wait(monkeypatch):
    """Children replaced after each call against a collector that never answers: the first exit
    waits its bound, and the next ones (other processes of the worker: the state is a shared page)
    do not wait at all for EXIT_BACKOFF."""
    import mmap
    import os
    import threading

    from toolq.workers import spans as worker_spans

    monkeypatch.setattr(worker_spans, "EXIT_FLUSH_TIMEOUT", 0.2)
    monkeypatch.setattr(worker_spans, "_down_until", mmap.mmap(-1, 8))
    release = threading.Event()
    started: list[int] = []
    try:
        assert worker_spans.exit_flush(lambda: release.wait(600)) is False  # waited 0.2 s, then the backoff
        pid = os.fork()
        if pid == 0:  # a child forked afterwards, as a replaced pool child is
            os._exit(0 if worker_spans.exit_flush(lambda: started.append(1)) is False and not started else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a later exit waited for its export"
    finally:
        release.set()


def test_a_flush_against_a_collector_that_never_answers_returns_by_its_timeout(monkeypatch):
    """`toolq run` flushes its spans at its end: against a collector that accepts and never answers,
    the SDK's force_flush held it the exporter's 10 s whatever the timeout asked."""
    import os
    import socket
    import subprocess
    import sys
    import textwrap

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    try:
        code = textwrap.dedent("""
            import threading
            from toolq.telemetry import tracing
            assert tracing.setup()
            tracing.tracer().start_span("x").end()
            ok = tracing.flush(0.5)
            # Returned while the export it asked for still waits on the collector (never by timing).
            exporting = any(t.name == "toolq-within" and t.is_alive() for t in threading.enumerate())
            print(ok, exporting, flush=True)
            import os; os._exit(0)  # as toolq run exits
        """)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.getsockname()[1]}"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["False", "True"]  # not finished, and not waited for
    finally:
        hole.close()


def test_the_bench_sink_process_imports_nothing_from_the_folder_it_is_started_in(tmp_path, monkeypatch):
    """`toolq bench` may run in a workspace: its receiver process must not import a planted `toolq`."""
    from toolq.dev.otlp_sink import SinkProcess

    (tmp_path / "toolq").mkdir()
    (tmp_path / "toolq" / "__init__.py").write_text('raise SystemExit("planted toolq imported")\n')
    monkeypatch.chdir(tmp_path)
    with SinkProcess() as sink:
        assert sink.counts() == {"spans": 0, "points": 0, "errors": 0}
