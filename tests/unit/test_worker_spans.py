"""The worker's spans cost nothing when traces are off (issue 30): a call's whole span path, run
with no OTEL_* set, imports nothing of OpenTelemetry and starts no thread. The spans themselves
are checked end to end in tests/integration/test_traces_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import json, sys, threading, time
from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.tracing import TraceContext
from toolq.workers import spans
from toolq.workers.processes import run_command

spans.child_started()
inv = ToolInvocation(tool_name=ToolName.plain("noop"), call_id="c1", turn_id="t1", step=0, output_index=0,
                     payload=FunctionPayload(arguments="{}"), spec_digest="d", deadline=time.time() + 60,
                     trace=TraceContext(traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"), sent_at=time.time())
traced = spans.begin_call(inv)
spans.queue_wait(inv, time.time())
with spans.tool(inv, True, "w@h") as span:
    spans.ended(span, __import__("toolq.core.states", fromlist=["x"]).CallState.COMPLETED)
    run_command("true", cwd="/")
    assert spans.start_mcp_call("s", "t") is None and spans.context_of_span(None) is None
with spans.result_store("SUCCESS"):
    pass
spans.call_ended()
spans.child_exiting()
print(json.dumps({"traced": traced, "span": span is not None,
                  "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
                  "threads": threading.active_count()}))
"""


def test_a_calls_span_path_with_traces_off_imports_no_opentelemetry_and_starts_no_thread():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"traced": False, "span": False, "otel": [], "threads": 1}


def test_a_calls_end_exports_nothing_and_waits_for_no_collector(monkeypatch):
    """A task's end only forgets the call: its spans leave with the batch processor's next export
    (an export per call, waited for, cost 25-30% of the calls/s; a collector that was down held
    each call's end ~7 s). A child's exit exports what it holds, waiting at most EXIT_FLUSH_TIMEOUT
    (the SDK's flush ignores its own timeout), in a thread of its own."""
    import threading

    from toolq.core.tracing import TraceContext
    from toolq.telemetry import tracing
    from toolq.workers import spans

    stuck = threading.Event()
    flushes: list[float] = []

    def flush(timeout_s: float = 5.0) -> bool:
        flushes.append(timeout_s)
        stuck.wait(30)  # a collector that never answers
        return True

    monkeypatch.setattr(tracing, "flush", flush)
    monkeypatch.setattr(tracing, "on", lambda: True)
    monkeypatch.setattr(spans, "EXIT_FLUSH_TIMEOUT", 0.01)
    try:
        monkeypatch.setattr(spans, "_traced", True)
        monkeypatch.setattr(spans, "_parent", TraceContext(traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"))
        spans.call_ended()
        assert spans._traced is False and spans._parent is None and flushes == []
        spans.child_exiting()  # returns although the flush never does
        assert len(flushes) == 1
    finally:
        stuck.set()
