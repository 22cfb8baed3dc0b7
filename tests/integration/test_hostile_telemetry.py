"""Issue 30's red team on real workers: traces (OTLP/HTTP to the loopback sink) and metrics (served
over HTTP, prefork children in the multiprocess directory) on, and the attacker is the model's
command, its arguments, the workspace, or the fleet's faults. Each test is an attack and asserts
that it fails. The pure parts are tests/unit/test_hostile_telemetry.py.

Real parts: a Redis of this module's own, `toolq worker` processes (as root, and as `nobody` where
the suite's other hostile tests run one, tests/integration/unprivileged.py), the sandbox this host
has. No timing is asserted: the fault tests bound a whole series of calls far above what it takes,
and far below what the fault would cost if each call waited for the collector.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.integration import unprivileged
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.integration.signed import bound, run_signed
from tests.integration.test_traces_worker import by_name, dump, exec_spec, parent_context, wait_for
from toolq.core.advert import tool_queue
from toolq.core.catalog import ToolSpec
from toolq.core.session_records import conversation_key
from toolq.core.settings import Settings
from toolq.core.tracing import TraceContext
from toolq.dev.otlp_sink import OtlpSink
from toolq.local.embedded import RedisServer, WorkerProcess, free_port
from toolq.workers import isolation
from toolq.workers.isolation import choose
from toolq.workers.isolation.policy import Policy
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration

LEAK = "sk-vendor-" + secrets.token_hex(8)
"""The tracing vendor's API key, in the worker's OTEL_EXPORTER_OTLP_HEADERS."""
MARKER = "zq-hostile-" + secrets.token_hex(4)


def sandboxed() -> bool:
    sandbox = isolation.current()
    return sandbox.backend != "none" and not sandbox.unavailable


def send(redis_url: str, spec: ToolSpec, arguments: dict[str, Any], workspace: Path, trace: TraceContext | None,
         *, conversation: str | None = None, queue: str | None = None, timeout: float = 90) -> dict[str, Any]:
    """One call signed and sent as the orchestrator sends it (to `queue`, else its declaration's); its result."""
    inv = bound(spec, arguments, timeout=timeout, workspace=str(workspace), turn_prefix="turn-ht",
                trace=trace, sent_at=time.time(), conversation=conversation)
    return run_signed(redis_url, inv, queue or tool_queue(spec), timeout=timeout)


def scrape(port: int, timeout: float = 10) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()


def label_values(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {v for f in text_string_to_metric_families(text) for s in f.samples for k, v in s.labels.items()
            if k != "le"}


# --- the module's worker: traces and metrics on, a vendor key in its exporter's headers ----------------

@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpSink]:
    with OtlpSink() as sink:
        yield sink


def telemetry_env(receiver: OtlpSink, port: int, **more: str) -> dict[str, str]:
    return {**WORKER_ENV, **receiver.env(), "OTEL_EXPORTER_OTLP_HEADERS": f"x-api-key={LEAK}",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"authorization=Bearer%20{LEAK}",
            "TOOLQ_METRICS_PORT": str(port), **more}


class Fleet:
    def __init__(self, url: str, w: WorkerProcess, port: int, workspace: Path) -> None:
        self.url, self.w, self.port, self.workspace = url, w, port, workspace


@pytest.fixture(scope="module", params=[("auto", False), ("auto", True), ("landlock", False)],
                ids=["root", "unprivileged", "landlock"])
def worker(request, receiver, tmp_path_factory) -> Iterator[Fleet]:
    """A worker with traces and metrics on, on a Redis of its own (no other worker takes its calls):
    as root and as `nobody` with this host's sandbox, and as root under Landlock."""
    backend, user = request.param
    if backend != "auto" and (why := choose(Policy.from_settings(Settings(sandbox=backend))).unavailable):
        pytest.skip(f"the {backend} sandbox cannot run on this machine: {why}")
    folder = unprivileged.worker_folder(user, tmp_path_factory, "telemetry")
    cls = unprivileged.UserWorkerProcess if user else WorkerProcess
    port = free_port()
    with RedisServer() as server:
        w = cls(server.url, name=f"telemetry-{backend}-{'user' if user else 'root'}@test",
                queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
                env={**telemetry_env(receiver, port), "TOOLQ_SANDBOX": backend}, logdir=folder)
        w.start()
        workspace = unprivileged.owned_dir("toolq-telemetry-ws-") if user else tmp_path_factory.mktemp("ws")
        try:
            yield Fleet(server.url, w, port, workspace)
        finally:
            w.stop(grace=5)


def alive_conversation(url: str) -> str:
    r = redis.Redis.from_url(url)
    try:
        conversation = "conv-" + secrets.token_hex(4)
        r.set(conversation_key(conversation), "1", ex=600)  # alive, as its orchestrator keeps it
    finally:
        r.close()
    return conversation


def metrics_dir(w: WorkerProcess) -> str | None:
    """The worker's private multiprocess directory: the one holding its pool children's files."""
    pid = w.pid
    if pid is None:
        return None
    children: set[str] = set()
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            children |= set(Path(task).read_text().split())
        except OSError:
            pass
    for d in glob.glob("/tmp/toolq-metrics-*"):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        if any(n.rsplit("_", 1)[-1].removesuffix(".db") in children for n in names):
            return d
    return None


# --- 1. secrets ------------------------------------------------------------------------------------------

PROBE = ("env; echo ---; for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done 2>/dev/null; echo ---; "
         "ls -d /tmp/toolq-metrics-*/ 2>/dev/null || echo none-found; echo ---; printenv PROMETHEUS_MULTIPROC_DIR TOOLQ_METRICS_DIR")


@pytest.mark.parametrize("route", ["pool child", "session host"])
def test_a_command_sees_no_exporter_key_and_no_metrics_directory(worker, route):
    """The command reads its environment, every /proc/*/environ it can, and looks for the metrics
    directory: no OTEL_* variable, no vendor key, no directory."""
    f = worker
    workspace = f.workspace
    conversation = alive_conversation(f.url) if route == "session host" else None
    result = send(f.url, exec_spec(), {"cmd": PROBE}, workspace, parent_context(), conversation=conversation)
    out = str(result["output"])
    assert "---" in out, out  # the probe ran
    assert LEAK not in out
    env_part = out.split("---")[0]
    assert "OTEL_" not in env_part and "PROMETHEUS_MULTIPROC_DIR" not in env_part and "TOOLQ_" not in env_part
    if sandboxed():
        assert out.split("---")[2].strip() == "none-found", out


def test_a_command_cannot_forge_metrics_or_fill_the_metrics_directory(worker):
    """The attacker knows the directory's name (it guessed it): it writes a forged counter file and a
    big file there, and removes what it finds. The worker's samples are its own after."""
    if not sandboxed():
        pytest.skip("no sandbox here: a command runs as the worker's user with its files")
    f = worker
    w, port, workspace = f.w, f.port, f.workspace
    spec = exec_spec()
    send(f.url, spec, {"cmd": "true"}, workspace, None)  # a child has written its files
    directory = metrics_dir(w)
    assert directory is not None, "the worker's metrics directory"
    before = set(os.listdir(directory))
    attack = (f"D={directory}; ls $D; cp $D/counter_*.db /tmp/x 2>&1; echo forged > $D/counter_1.db 2>&1; "
              f"head -c 5000000 /dev/zero > $D/fill 2>&1; rm -f $D/*.db 2>&1; echo done")
    result = send(f.url, spec, {"cmd": attack}, workspace, None)
    assert "done" in str(result["output"])
    after = set(os.listdir(directory))
    assert "fill" not in after and "counter_1.db" not in after
    assert before <= after  # nothing removed
    text = scrape(port)
    assert "toolq_worker_tasks_total" in text


def test_a_command_cannot_reach_the_metrics_port_or_the_collector(worker, receiver):
    """Network is off in the cell: no connection to the worker's /metrics, nor to the collector, where
    a command would post forged spans (a trace of another turn's id) or read the fleet's counters."""
    if not sandboxed():
        pytest.skip("no sandbox here: a command shares the worker's network")
    f = worker
    port, workspace = f.port, f.workspace
    collector = int(receiver.endpoint.rsplit(":", 1)[1].split("/")[0])
    probe = "; ".join(f"(echo > /dev/tcp/127.0.0.1/{p}) 2>/dev/null && echo CONNECTED-{p} || echo refused-{p}"
                      for p in (port, collector))
    result = send(f.url, exec_spec(), {"cmd": f"bash -c '{probe}'"}, workspace, None)
    out = str(result["output"])
    assert f"refused-{port}" in out and f"refused-{collector}" in out, out
    assert "CONNECTED" not in out


# --- 2. content with capture off ---------------------------------------------------------------------

def test_no_span_and_no_metric_carries_the_commands_text_output_or_file_names(worker, receiver):
    f = worker
    port, workspace = f.port, f.workspace
    parent = parent_context()
    cmd = f"mkdir -p {MARKER}-dir && touch {MARKER}-file && echo {MARKER}-out && ls"
    conversation = alive_conversation(f.url)
    for conv in (None, conversation):
        result = send(f.url, exec_spec(), {"cmd": cmd, "workdir": str(workspace)}, workspace, parent,
                      conversation=conv)
        assert f"{MARKER}-out" in str(result["output"])
    spans = wait_for(receiver, parent.trace_id, {"toolq.tool exec_command", "toolq.command", "toolq.result.store"})
    assert MARKER not in dump(spans) and str(workspace) not in dump(spans)
    text = scrape(port)
    assert MARKER not in text and str(workspace) not in text


# --- 3. parent forging -------------------------------------------------------------------------------

def test_nothing_a_command_writes_sets_a_parent(worker, receiver):
    """A command prints W3C headers, exports TRACEPARENT, writes a traceparent file and an OTEL
    environment file: the call's spans are children of its signed invocation's context only."""
    f = worker
    workspace = f.workspace
    forged = parent_context()
    (workspace / ".traceparent").write_text(forged.traceparent)
    parent = parent_context()
    cmd = (f"export TRACEPARENT={forged.traceparent} OTEL_TRACES_EXPORTER=otlp; "
           f"echo 'traceparent: {forged.traceparent}'; echo '{{\"_meta\": {{\"traceparent\": \"{forged.traceparent}\"}}}}'")
    for conv in (None, alive_conversation(f.url)):
        send(f.url, exec_spec(), {"cmd": cmd}, workspace, parent, conversation=conv)
    spans = wait_for(receiver, parent.trace_id, {"toolq.tool exec_command", "toolq.command"})
    assert receiver.trace(forged.trace_id) == []
    assert forged.traceparent[36:52] not in {s.parent_id for s in receiver.snapshot()}
    tool_ids = {s.span_id for s in spans if s.name.startswith("toolq.tool")}
    assert all(s.parent_id in tool_ids | {parent.traceparent[36:52]} for s in spans)


# --- 4. cardinality at the worker ----------------------------------------------------------------------

def test_tools_the_worker_does_not_serve_are_unknown_in_its_labels_and_span_names(worker, receiver):
    """Invocations naming tools this worker does not declare (another fleet's, a made-up name),
    sent on its queue: each is refused, counted under 'unknown', and its span is `toolq.tool unknown`."""
    f = worker
    port, workspace = f.port, f.workspace
    made_up = [f"evil_{secrets.token_hex(3)}" for _ in range(3)]
    parents = []
    for name in made_up:
        spec = ToolSpec(name=name, description="x", parameters={"type": "object", "properties": {}})
        parent = parent_context()
        parents.append(parent)
        result = send(f.url, spec, {}, workspace, parent, queue="toolq")
        assert result["status"] != "completed"
    text = scrape(port)
    assert not {v for v in label_values(text) if v.startswith("evil_")}
    for parent in parents:
        spans = wait_for(receiver, parent.trace_id, {"toolq.tool"})
        assert by_name(spans, "toolq.tool").name == "toolq.tool unknown"


# --- 5. faults ---------------------------------------------------------------------------------------

class BlackHole:
    """A collector that accepts TCP connections and never answers (nor closes)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


CALLS = 20
#: The whole series' bound: far above what 20 calls take on a loaded machine (a few seconds each at
#: worst), far below 20 waits of the exporter's 10 s timeout.
SERIES_BOUND = 150.0


class RecyclingWorker(WorkerProcess):
    """`toolq worker --max-tasks-per-child 1`: each call's pool child exits after it, flushing first."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--max-tasks-per-child", "1"]


@pytest.mark.parametrize("collector", ["black hole", "refusing", "black hole, recycled children"])
def test_a_collector_that_is_down_or_never_answers_costs_no_call_its_output(collector, tmp_path):
    """Traces and OTLP metrics both go to a collector that never answers (or refuses): every call
    gets its own output, and a series of calls is not held by the exporter (nor, recycled, by each
    child's exit: its flushes are waited for at most 5 s each)."""
    hole = BlackHole()
    endpoint = f"http://127.0.0.1:{free_port() if collector == 'refusing' else hole.port}"
    server = RedisServer().__enter__()
    recycled = "recycled" in collector
    calls, bound = (4, 240.0) if recycled else (CALLS, SERIES_BOUND)
    port = free_port()
    w = (RecyclingWorker if recycled else WorkerProcess)(
        server.url, name="faults@test", queues=["toolq"], concurrency=1, tools=[TEST_TOOLS],
        env={**WORKER_ENV, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
             "OTEL_METRICS_EXPORTER": "otlp", "OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_BSP_SCHEDULE_DELAY": "100",
             "TOOLQ_METRICS_PORT": str(port)}, logdir=tmp_path)
    spec = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "sleep_echo")
    try:
        w.start()
        began = time.monotonic()
        for i in range(calls):  # one pool child: each call's end is the next call's wait
            result = send(server.url, spec, {"ms": 1, "text": f"n{i}"}, tmp_path, parent_context(), timeout=120)
            assert result["status"] == "completed" and json.loads(result["output"])["text"] == f"n{i}"
            assert time.monotonic() - began < bound, f"{i + 1} calls took too long: the collector stalls them"
        assert "toolq_worker_tasks_total" in scrape(port, timeout=30)  # Prometheus goes on
        if recycled and collector.startswith("black hole"):
            # What bounds the series (not a time): an exit's export not done in its 5 s is given up,
            # and said, and the children after it do not wait for theirs.
            end = time.monotonic() + 60
            while "children exiting in the next" not in w.log.read_text(errors="replace"):
                assert time.monotonic() < end, "no pool child's exit gave up on the collector"
                time.sleep(0.2)
    finally:
        w.stop(grace=30)
        server.__exit__(None, None, None)
        hole.close()


def test_a_metrics_port_already_taken_costs_the_worker_nothing_but_its_metrics(receiver, tmp_path):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen(1)
    server = RedisServer().__enter__()
    w = WorkerProcess(server.url, name="taken@test", queues=["toolq"], concurrency=1, tools=[TEST_TOOLS],
                      env={**WORKER_ENV, **receiver.env(), "TOOLQ_METRICS_PORT": str(taken.getsockname()[1])},
                      logdir=tmp_path)
    spec = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "sleep_echo")
    try:
        w.start()
        for i in range(3):
            result = send(server.url, spec, {"ms": 1, "text": f"still{i}"}, tmp_path, parent_context())
            assert json.loads(result["output"])["text"] == f"still{i}"
        assert w.proc is not None and w.proc.poll() is None  # the worker goes on
    finally:
        w.stop(grace=10)
        server.__exit__(None, None, None)
        taken.close()


def test_recycled_pool_children_do_not_grow_the_metrics_directory_without_bound(tmp_path):
    """prometheus_client's multiprocess mode keeps a dead child's counter and histogram files (its
    counts): under --max-tasks-per-child 1 the directory, and each scrape's work, grew by two files
    a call. A scrape archives them: the counts stay, the files go."""
    server = RedisServer().__enter__()
    port = free_port()
    w = RecyclingWorker(server.url, name="recycled@test", queues=["toolq"], concurrency=1, tools=[TEST_TOOLS],
                        env={**WORKER_ENV, "TOOLQ_METRICS_PORT": str(port)}, logdir=tmp_path)
    spec = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "sleep_echo")
    try:
        w.start()
        for i in range(10):
            send(server.url, spec, {"ms": 1, "text": f"n{i}"}, tmp_path, None)
        directory = metrics_dir(w)
        assert directory is not None
        text = scrape(port)  # where dead children's files are archived
        assert 'toolq_worker_tasks_total{outcome="completed",tool="sleep_echo"} 10.0' in text  # counts kept
        send(server.url, spec, {"ms": 1, "text": "more"}, tmp_path, None)
        text = scrape(port)  # the archive is added to, its counts read once
        assert 'toolq_worker_tasks_total{outcome="completed",tool="sleep_echo"} 11.0' in text
        assert 'toolq_queue_wait_seconds_count{queue="toolq",tool="sleep_echo"} 11.0' in text
        dead = [n for n in os.listdir(directory)
                if not Path(f"/proc/{n.rsplit('_', 1)[-1].removesuffix('.db')}").exists()]
        assert len(dead) <= 4, f"{len(dead)} files of dead children: {sorted(dead)}"
    finally:
        w.stop(grace=10)
        server.__exit__(None, None, None)


# --- 6. off ------------------------------------------------------------------------------------------

def _mapped(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found += [int(c) for c in Path(task).read_text().split()]
        except OSError:
            pass
    return found


def test_with_telemetry_off_a_pool_child_loads_no_exporter_and_opens_no_socket_to_a_collector(tmp_path):
    """No OTEL_* and no metrics port: after a call, the worker and its pool children have not loaded
    the OTLP exporter's protobuf runtime (what turning traces on loads), and hold no connection but
    to Redis."""
    server = RedisServer().__enter__()
    w = WorkerProcess(server.url, name="off@test", queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
                      env=dict(WORKER_ENV), logdir=tmp_path)
    spec = next(s for s in load_catalog([TEST_TOOLS]) if s.name == "sleep_echo")
    try:
        w.start()
        send(server.url, spec, {"ms": 1, "text": "off"}, tmp_path, None)
        assert w.pid is not None
        pids = [w.pid, *_children(w.pid)]
        assert len(pids) >= 3
        for pid in pids:
            maps = _mapped(pid)
            assert maps, pid
            assert "_upb" not in maps and "grpc" not in maps, pid
        assert not [d for d in glob.glob("/tmp/toolq-metrics-*") if str(w.pid) in d]
    finally:
        w.stop(grace=10)
        server.__exit__(None, None, None)


def test_a_scrape_while_redis_does_not_answer_answers_without_the_queue_depth(receiver, tmp_path):
    """Redis stops answering (SIGSTOP): a scrape still answers, without the gauges read from it
    (queue depth, and environments by state, which this host has one of on disk)."""
    server = RedisServer().__enter__()
    port = free_port()
    root = tmp_path / "envroot"
    w = WorkerProcess(server.url, name="stalled@test", queues=["toolq"], concurrency=1, tools=[TEST_TOOLS],
                      env={**WORKER_ENV, "TOOLQ_METRICS_PORT": str(port), "TOOLQ_ENV_ROOT": str(root)},
                      logdir=tmp_path)
    try:
        w.start()
        assert "toolq_queue_depth" in scrape(port)
        assert server.proc is not None
        (root / "envs" / "env-stalled").mkdir(parents=True, exist_ok=True)  # read by MGET at scrape
        assert 'toolq_environments{state="unknown"} 1.0' in scrape(port)  # Redis answers: the gauge is there
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            text = scrape(port, timeout=30)  # the source's socket times out; the scrape answers
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert "toolq_worker_tasks_total" in text or "# HELP" in text
        assert 'toolq_queue_depth{' not in text and 'toolq_environments{' not in text
    finally:
        w.stop(grace=5)
        server.__exit__(None, None, None)
