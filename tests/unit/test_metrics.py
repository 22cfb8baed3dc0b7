"""The metrics layer (`toolq/telemetry/metrics.py`): off costs nothing, an orchestrator's
`/metrics` over HTTP has the declared names and bounded labels, a port in use is one line, and a
worker's prefork children are counted through the multiprocess directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from toolq.core import metrics as declared
from toolq.core.honest import Known, not_run
from toolq.telemetry import metrics


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def test_off_imports_nothing_and_records_nothing() -> None:
    code = textwrap.dedent("""
        import sys
        from toolq.telemetry import metrics
        from toolq.orchestrator import call_entry, limits, turn  # the recording call sites
        metrics.call_settled("exec_command", "completed", "out", 0.1)
        metrics.turn_started(); metrics.turn_ended("completed"); metrics.model_request("completed")
        metrics.limit_wait("rate", "exec_command", 1.0); metrics.sandbox_started("bwrap", 0.1)
        metrics.worker_task("exec_command", "q", {}, {"status": "completed"})
        metrics.cancel_to_dead(0.1); metrics.sessions_in_flight(2)
        assert metrics.serve_orchestrator(None) is None and not metrics.on()
        # (redis-py imports the OTel SDK for its own observability module: not toolq's doing)
        bad = [m for m in sys.modules if m.startswith(("prometheus_client", "opentelemetry.exporter"))]
        assert not bad, bad
        import threading; assert threading.active_count() == 1, threading.enumerate()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_orchestrator_metrics_over_http(served: int) -> None:
    metrics.turn_started()
    metrics.call_settled("exec_command", "completed", "hi", 0.05)
    metrics.call_settled("exec_command", "rejected", not_run("exec_command", "no worker"), 0.01)
    metrics.call_settled(None, "rejected", "unsupported call: nope", 0.0)
    metrics.model_request("completed")
    metrics.limit_wait("concurrency", "exec_command", 0.3)
    metrics.turn_ended("completed")
    s = scrape(served)
    assert value(s, "toolq_calls_total", tool="exec_command", state="completed", reason="") == 1
    assert value(s, "toolq_calls_total", tool="exec_command", state="rejected", reason=Known.NOT_RUN.value) == 1
    assert value(s, "toolq_calls_total", tool=declared.UNKNOWN_TOOL, state="rejected") == 1
    assert value(s, "gen_ai_execute_tool_duration_seconds_count", tool="exec_command") == 2
    assert value(s, "gen_ai_execute_tool_duration_seconds_bucket", tool="exec_command", state="completed",
                 le="0.08") == 1
    assert value(s, "toolq_turns_total", state="completed") == 1
    assert value(s, "toolq_turns_in_flight") == 0
    assert value(s, "toolq_model_requests_total", outcome="completed") == 1
    assert value(s, "toolq_limit_wait_seconds_count", limit="concurrency", tool="exec_command") == 1
    orchestrator = {n for m in declared.METRICS if m.side == "orchestrator" for n in declared.scraped_names(m)}
    assert orchestrator <= set(s)
    # every label name a sample carries is declared for its metric
    for name, samples in s.items():
        metric = next((m for m in declared.METRICS if name in declared.scraped_names(m)), None)
        if metric is None:
            continue
        for labels, _ in samples:
            assert set(labels) - {"le"} <= set(metric.labels), (name, labels)


def test_serving_twice_keeps_one_server(served: int) -> None:
    assert metrics.serve_orchestrator(0) == served


def test_a_port_in_use_is_one_line_and_no_crash(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        try:
            assert metrics.serve_orchestrator(taken, host="127.0.0.1") is None
            metrics.call_settled("exec_command", "completed", "", 0.1)  # records, serves nothing
        finally:
            metrics.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {taken}" in err[0] and "going on" in err[0], err


WORKER = textwrap.dedent("""
    import os, sys, time, json, urllib.request
    from toolq.telemetry import metrics
    port = metrics.serve_worker(0, host="127.0.0.1", queues={"q1": ["q1"]}, redis="redis://127.0.0.1:1/0")
    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    children = []
    for i in range(3):  # prefork children: each records, one keeps a live gauge and dies
        pid = os.fork()
        if pid == 0:
            metrics.worker_task("exec_command", "q1", {"sent_at": 1.0}, {"status": "completed",
                                "started_at": 2.0, "finished_at": 2.5})
            metrics.sessions_in_flight(5)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    metrics.sessions_in_flight(1)  # a live process's gauge stays
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    print(json.dumps({"text": text, "dir": directory}))
""")


def test_worker_counts_its_forked_children() -> None:

    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(out["text"]) for s in f.samples}
    assert samples[("toolq_worker_tasks_total", (("outcome", "completed"), ("tool", "exec_command")))] == 3
    assert samples[("toolq_queue_wait_seconds_count", (("queue", "q1"), ("tool", "exec_command")))] == 3
    assert samples[("toolq_queue_wait_seconds_sum", (("queue", "q1"), ("tool", "exec_command")))] == 3.0
    assert samples[("toolq_tool_run_seconds_count", (("queue", "q1"), ("tool", "exec_command")))] == 3
    assert samples[("toolq_sessions_in_flight", ())] == 1  # the dead children's 5s dropped
    assert not any(name == "toolq_queue_depth" for name, _ in samples)  # no Redis there: no sample
    assert "port" not in done.stderr or "metrics on" in done.stderr
    assert not os.path.exists(out["dir"])  # the private directory goes with the worker


def test_the_same_instruments_go_over_otlp_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolq.dev.otlp_sink import OtlpSink

    with OtlpSink() as sink:
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        port = metrics.serve_orchestrator(0, host="127.0.0.1")
        try:
            assert port
            metrics.call_settled("exec_command", "failed", "boom", 0.2)
            metrics.turn_started()
            metrics.limit_wait("rate", "exec_command", 0.5)
            metrics.flush()
        finally:
            metrics.stop()
        got = {(p.name, tuple(sorted(p.attributes.items()))): p.value for p in sink.points}
    assert got[("toolq_calls", (("reason", ""), ("state", "failed"), ("tool", "exec_command")))] == 1
    assert got[("gen_ai_execute_tool_duration_seconds", (("state", "failed"), ("tool", "exec_command")))] == 1
    assert got[("toolq_turns_in_flight", ())] == 1
    assert got[("toolq_limit_wait_seconds", (("limit", "rate"), ("tool", "exec_command")))] == 1
    assert {p.service for p in sink.points} == {"toolq-orchestrator"}


def test_otlp_metrics_asked_for_without_the_otel_extra_serve_prometheus_and_say_so_in_one_line():
    # The SDK is the `otel` extra: where it cannot be imported (None in sys.modules, as an install
    # without the extra), OTEL_METRICS_EXPORTER=otlp costs one line and /metrics is served anyway.
    code = textwrap.dedent("""
        import logging, sys, urllib.request
        sys.modules["opentelemetry.sdk"] = None
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from toolq.telemetry import metrics
        port = metrics.serve_orchestrator(0, host="127.0.0.1")
        metrics.turn_started()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
            print("toolq_turns_in_flight 1.0" in answer.read().decode())
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "OTEL_METRICS_EXPORTER": "otlp"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True"], done
    said = [line for line in done.stderr.splitlines() if "OTLP" in line]
    assert len(said) == 1 and "pip install 'toolq[otel]'" in said[0], done.stderr


def test_an_otlp_metric_exporter_sends_only_from_the_process_that_made_it():
    """A pool child inherits its worker's periodic reader (the SDK restarts its thread after a
    fork): that copy must send nothing, or each child pushes the worker's points as the worker."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult

    sent: list[int] = []

    class Inner(OTLPMetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(os.getpid())
            return MetricExportResult.SUCCESS

    own = metrics._own_process(Inner(endpoint="http://127.0.0.1:1"))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: export, then say how many reached the inner exporter
        try:
            own.export(None)
            os.write(write, str(len(sent)).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    assert os.read(read, 16) == b"0"
    os.close(read)
    assert own.export(None) == MetricExportResult.SUCCESS and sent == [os.getpid()]


CONCURRENT_SCRAPES = textwrap.dedent("""
    import os, json, threading, urllib.request
    from toolq.telemetry import metrics
    port = metrics.serve_worker(0, host="127.0.0.1", queues={"q1": ["q1"]}, redis="redis://127.0.0.1:1/0")
    children = []
    for i in range(12):  # recycled pool children: each leaves files the next scrape archives
        pid = os.fork()
        if pid == 0:
            metrics.worker_task("exec_command", "q1", {"sent_at": 1.0}, {"status": "completed",
                                "started_at": 2.0, "finished_at": 2.5})
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    answers = []

    def scrape():
        try:
            answers.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode())
        except Exception as e:
            answers.append(f"ERROR {e}")

    threads = [threading.Thread(target=scrape) for _ in range(8)]  # two Prometheus replicas, and more
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(answers))
""")


def test_scrapes_at_once_each_see_every_dead_childs_count_once() -> None:
    done = subprocess.run([sys.executable, "-c", CONCURRENT_SCRAPES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(answers) == 8 and not [a for a in answers if a.startswith("ERROR")], answers
    for text in answers:
        tasks = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "toolq_worker_tasks_total" and s.labels.get("outcome") == "completed"]
        assert tasks == [12], tasks
