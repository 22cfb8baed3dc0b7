"""Prometheus metrics (and their OTLP mirror) for both ends of a queue, from the declarations in
`toolq/core/metrics.py`.

Off unless a process asks: `serve_orchestrator` (`toolq run`, `toolq batch`, a `Fleet`, when
TOOLQ_METRICS_PORT is set) or `serve_worker` (`toolq worker --metrics-port` or the variable, in the
main process before its pool forks). Off, every `record` function returns at its first test:
prometheus_client is not imported, no thread, no socket.

The worker counts its prefork pool children through prometheus_client's multiprocess mode: the
main process makes a private directory, names it in PROMETHEUS_MULTIPROC_DIR before anything
imports prometheus_client (its value class is chosen at import), and its pool children, forked
from it, write their samples there (one file per pid, kept after a child exits, so a recycled
child's counts stay). A scrape (in the main process) merges them, first dropping the live gauges
of children that are gone (`mark_process_dead`). Sources read at scrape time (the broker's queue
lengths, the environment host's states and bytes) are sampled by the main process only, and a
source that fails (Redis away) gives no sample, never a failed scrape.

With OTEL_METRICS_EXPORTER=otlp the same instruments also go to an OTLP endpoint (the standard
OTEL_EXPORTER_OTLP_* variables) from the process that records them: the orchestrator, and each
worker process (a pool child sets its own provider after the fork, `after_fork`, and flushes it
before it exits, `flush`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from toolq.core import metrics as declared
from toolq.core.honest import known_form
from toolq.core.libc import pid_exists

log = logging.getLogger("toolq.metrics")

#: Set by the worker to the directory its processes share (PROMETHEUS_MULTIPROC_DIR too): a process
#: started by the worker (the session host) joins the worker's metrics through it.
DIR_ENV = "TOOLQ_METRICS_DIR"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
OTLP_ENV = "OTEL_METRICS_EXPORTER"

#: A source read at scrape time: label values -> value; None, or raising, gives no sample.
Source = Callable[[], Mapping[tuple[str, ...], float] | None]

_tool: str = declared.UNKNOWN_TOOL
"""The tool of the call this process runs now (`calling`): a pool child runs one at a time, and
its handler may run on an executor's thread, which a context variable would not reach."""

#: At most this many distinct `tool` label values per process. The catalog does not bound them by
#: itself: an MCP server lists what tools it likes (thousands, or new names at each list_changed),
#: and each becomes a declared tool. Past the cap a tool counts as "unknown".
TOOL_LABELS = 500


class _Metrics:
    """One process's metrics: the prometheus_client instruments of its side, and the OTLP mirror."""

    def __init__(self, side: declared.Side, *, multiprocess: bool) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.side = side
        self.registry = CollectorRegistry(auto_describe=True)
        self.known: set[str] = set()
        self.labelled: set[str] = set()
        """The `tool` label values used so far (at most TOOL_LABELS)."""
        self.sources: dict[str, Source] = {}
        self.server: Any = None
        self.port: int | None = None
        self.otel: _Otel | None = None
        self.prom: dict[str, Any] = {}
        for m in declared.METRICS:
            if m.side != side or m.name in _SCRAPED:
                continue
            registry = None if multiprocess else self.registry  # multiprocess: merged from the files
            if m.kind == "counter":
                self.prom[m.name] = Counter(m.base_name, m.help, m.labels, registry=registry)
            elif m.kind == "histogram":
                self.prom[m.name] = Histogram(m.name, m.help, m.labels, registry=registry, buckets=m.buckets)
            else:
                # multiprocess: a live gauge summed over the processes alive (a dead one's dropped)
                self.prom[m.name] = Gauge(m.name, m.help, m.labels, registry=registry, multiprocess_mode="livesum")

    def tool(self, name: str) -> str:
        return self.bounded(name) if name in self.known else declared.UNKNOWN_TOOL

    def bounded(self, name: str | None) -> str:
        """A declared tool's name as a label value, while fewer than TOOL_LABELS are in use."""
        if name is None:
            return declared.UNKNOWN_TOOL
        if name not in self.labelled:
            if len(self.labelled) >= TOOL_LABELS:
                return declared.UNKNOWN_TOOL
            self.labelled.add(name)
        return name


_m: _Metrics | None = None
_lock = threading.Lock()
_owned_dir: str | None = None
#: Gauges a source fills at scrape time, in the main process (never from the files).
_SCRAPED = frozenset({declared.QUEUE_DEPTH.name, declared.ENVIRONMENTS.name, declared.WORKSPACE_BYTES.name})


def on() -> bool:
    return _m is not None


def port() -> int | None:
    return _m.port if _m is not None else None


# --- turning it on --------------------------------------------------------------------------------


def serve_orchestrator(port: int | None, *, host: str = "0.0.0.0", tools: Iterable[str] = ()) -> int | None:
    """The orchestrator's `/metrics` on `port` (0: a free one), once per process: the port served,
    or None (off: no port; or the port could not be bound, said in one line)."""
    global _m
    if port is None:
        return None
    with _lock:
        if _m is None:
            _m = _Metrics("orchestrator", multiprocess=False)
            _m.otel = _Otel.start("toolq-orchestrator")
            _serve(_m, port, host, "toolq")
        m = _m
    know_tools(tools)
    return m.port


def serve_worker(port: int | None, *, queues: Mapping[str, Iterable[str]] | None = None,
                 redis: Callable[[], Any] | str | None = None,
                 host: str = "0.0.0.0", tools: Iterable[str] = ()) -> int | None:
    """The worker's `/metrics`, from its main process before the pool forks (the children inherit
    the instruments and write to the shared directory). None: off, or the port could not be bound
    (the worker goes on; its children record nothing then)."""
    global _m, _owned_dir
    if port is None:
        return None
    with _lock:
        if _m is not None:
            return _m.port
        directory = tempfile.mkdtemp(prefix="toolq-metrics-")
        os.environ[MULTIPROC_ENV] = os.environ[DIR_ENV] = directory
        _owned_dir = directory
        atexit.register(_remove_dir, directory, os.getpid())
        _check_value_class()
        m = _Metrics("worker", multiprocess=True)
        m.registry.register(_Reaper(directory))
        m.registry.register(_SourceCollector(m))
        _serve(m, port, host, "toolq worker")
        if m.port is None:
            _unset_dir()
            return None
        _m = m
        m.otel = _Otel.start("toolq-worker")
    know_tools(tools)
    if redis is not None and queues:
        add_source(declared.QUEUE_DEPTH.name, queue_depth_source(redis, queues))
    return m.port


def join_worker(tools: Iterable[str] = ()) -> bool:
    """A process the worker started (the session host): record into the worker's directory, if
    the worker serves metrics. Nothing served from here."""
    global _m
    directory = os.environ.get(DIR_ENV)
    if _m is not None or not directory or not os.path.isdir(directory):
        return _m is not None
    os.environ[MULTIPROC_ENV] = directory
    _check_value_class()
    _m = _Metrics("worker", multiprocess=True)
    _m.otel = _Otel.start("toolq-worker")
    know_tools(tools)
    return True


def after_fork() -> None:
    """In a worker's pool child (`worker_process_init`): the OTLP mirror's own provider (the
    parent's export thread did not survive the fork). The Prometheus side needs nothing."""
    if _m is not None and _m.otel is not None:
        _m.otel = _Otel.start("toolq-worker")


def flush() -> None:
    """Before a pool child exits: its OTLP points sent (the Prometheus files are written already)."""
    if _m is not None and _m.otel is not None:
        _m.otel.flush()


def know_tools(names: Iterable[str]) -> None:
    """Tool names from the catalog: the only values of a `tool` label (anything else is "unknown")."""
    if _m is not None:
        _m.known.update(str(n) for n in names)


def add_source(name: str, source: Source) -> None:
    """A gauge read at scrape time in this (the serving) process (queue depth, environments)."""
    if _m is not None:
        _m.sources[name] = source


def stop() -> None:
    """Stop serving and forget the instruments (tests; a process's last Fleet does not call it)."""
    global _m
    with _lock:
        m, _m = _m, None
    if m is None:
        return
    if m.server is not None:
        m.server.shutdown()
        m.server.server_close()
    if m.otel is not None:
        m.otel.shutdown()
    if _owned_dir is not None:
        _unset_dir()


def _serve(m: _Metrics, port: int, host: str, who: str) -> None:
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=host, registry=m.registry)
    except OSError as e:
        _say(f"{who}: metrics not served: port {port} cannot be bound ({e.strerror or e}); going on without them")
        return
    m.server, m.port = server, server.server_address[1]
    _say(f"{who}: metrics on http://{host}:{m.port}/metrics")


def _say(line: str) -> None:
    """One line on stderr (a worker's log is not set up yet; `toolq run` shows its stderr) and in the log."""
    log.info("%s", line)
    print(line, file=sys.stderr, flush=True)


def _check_value_class() -> None:
    """prometheus_client chose its value class when first imported: multiprocess only if the
    directory was named by then."""
    from prometheus_client import values

    if not getattr(values.ValueClass, "__name__", "") == "MmapedValue":
        values.ValueClass = values.get_value_class()


def _unset_dir() -> None:
    global _owned_dir
    directory, _owned_dir = _owned_dir, None
    for name in (MULTIPROC_ENV, DIR_ENV):
        if os.environ.get(name) == directory:
            del os.environ[name]
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def _remove_dir(directory: str, pid: int) -> None:
    if os.getpid() == pid:  # the main process's exit, not a forked child's
        shutil.rmtree(directory, ignore_errors=True)


# --- scrape-time collectors -------------------------------------------------------------------------

_LIVE_FILE = re.compile(r"gauge_live\w*?_(\d+)\.db")


_DEAD_FILE = re.compile(r"(counter|histogram)_(\d+)\.db")


class _Reaper:
    """The directory's merge, each scrape: first a dead process's live gauges are dropped, and its
    counters and histograms added into one archive file per kind (`counter_archive.db`), its own
    files removed (children replaced after each call, --max-tasks-per-child 1, would otherwise
    leave two files a call, which the directory and each scrape's work kept forever); then the
    files are merged. Both under one lock: two scrapes at once (a pair of Prometheus replicas)
    would otherwise merge a file the other had just archived and removed (a failed scrape), or
    count it twice."""

    def __init__(self, directory: str) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.directory = directory
        self.lock = threading.Lock()
        self.merged = MultiProcessCollector(None, path=directory)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.multiprocess import mark_process_dead

        with self.lock:
            with contextlib.suppress(OSError):
                dead: dict[str, list[str]] = {}
                for name in os.listdir(self.directory):
                    found = _LIVE_FILE.fullmatch(name)
                    if found and not pid_exists(int(found.group(1))):
                        mark_process_dead(int(found.group(1)), self.directory)
                    found = _DEAD_FILE.fullmatch(name)
                    if found and not pid_exists(int(found.group(2))):
                        dead.setdefault(found.group(1), []).append(os.path.join(self.directory, name))
                for kind, files in dead.items():
                    _archive(os.path.join(self.directory, f"{kind}_archive.db"), files)
            return iter(list(self.merged.collect()))


def _archive(archive_path: str, files: list[str]) -> None:
    """Add the values of dead processes' files into the archive, then remove them (a counter's and a
    histogram's bucket counts add up; the merge at scrape time reads the archive as one more file)."""
    from prometheus_client.mmap_dict import MmapedDict

    archive = MmapedDict(archive_path)
    try:
        for f in files:
            for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(f):
                archive.write_value(key, archive.read_value(key)[0] + value, timestamp)
            os.remove(f)
    finally:
        archive.close()



class _SourceCollector:
    """The gauges read when scraped, each from its source; a failing source gives no sample."""

    def __init__(self, m: _Metrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        for name, source in list(self.m.sources.items()):
            metric = declared.BY_NAME[name]
            try:
                samples = source()
            except Exception as e:  # a scrape never fails for a source
                log.debug("metrics: %s not sampled: %s", name, e)
                continue
            if samples is None:
                continue
            family = GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)
            for labels, value in samples.items():
                family.add_metric(list(labels), value)
            if self.m.otel is not None:
                self.m.otel.observed[name] = dict(samples)
            yield family


def queue_depth_source(redis: Callable[[], Any] | str, queues: Mapping[str, Iterable[str]]) -> Source:
    """Calls waiting, by declared queue: the LLEN of every broker list behind it, as Celery's Redis
    transport keeps them, summed. `queues`: each declared queue the worker consumes and its lists
    (itself, its tools' own queues `toolq.t.<tool>.<digest>` where calls are sent, and those on this
    host `toolq.h.<host>.…`: `broker_lists`); each list counts with one list per priority step
    (`<list>\\x06\\x16<n>`). `redis`: a URL, or what makes the client (the worker's own, which follows
    a Sentinel-managed primary)."""
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    sep = Channel.sep
    client: list[Any] = []
    behind = {q: list(dict.fromkeys(lists)) for q, lists in queues.items()}

    def read() -> Mapping[tuple[str, ...], float] | None:
        if not client:
            if isinstance(redis, str):
                import redis as redis_py

                client.append(redis_py.Redis.from_url(redis, socket_timeout=1.0, socket_connect_timeout=1.0))
            else:
                client.append(redis())
        pipe = client[0].pipeline(transaction=False)
        for lists in behind.values():
            for name in lists:
                pipe.llen(name)
                for step in PRIORITY_STEPS[1:]:
                    pipe.llen(f"{name}{sep}{step}")
        lengths = iter(pipe.execute())
        per = len(PRIORITY_STEPS)
        return {(q,): float(sum(next(lengths) for _ in range(per * len(lists)))) for q, lists in behind.items()}

    return read


# --- recording (each a no-op while off) ------------------------------------------------------------


def call_settled(tool: str | None, state: str, output: object, seconds: float) -> None:
    """Orchestrator: a call's one outcome (`CallEntry.settle`), from its commit to its output.
    `tool`: the declaration's name (None: the call named no declared tool)."""
    m = _m
    if m is None:
        return
    label = m.bounded(tool)
    form = known_form(output) if isinstance(output, str) else None
    reason = form.value if form is not None else ""
    _inc(m, declared.CALLS, (label, state, reason))
    _observe(m, declared.EXECUTE_TOOL_DURATION, (label, state), seconds)


def turn_started() -> None:
    m = _m
    if m is not None:
        _add(m, declared.TURNS_IN_FLIGHT, (), 1)


def turn_ended(state: str) -> None:
    m = _m
    if m is not None:
        _add(m, declared.TURNS_IN_FLIGHT, (), -1)
        _inc(m, declared.TURNS, (state,))


def model_request(outcome: str) -> None:
    m = _m
    if m is not None:
        _inc(m, declared.MODEL_REQUESTS, (outcome,))


def limit_wait(limit: str, tool: str, seconds: float) -> None:
    """Orchestrator: a call held back by a limit, and for how long (a call let go at once: none)."""
    m = _m
    if m is not None:
        _observe(m, declared.LIMIT_WAIT, (limit, m.bounded(tool)), seconds)  # a declared tool (its spec held it)


def calling(tool: str | None) -> None:
    """Worker: the call this pool child runs now is of `tool` (the catalog's name, None: not
    declared), for what records without knowing it (cancel-to-dead). A pool child runs one call
    at a time; the session host's calls say their tool themselves."""
    global _tool
    if _m is not None:
        _tool = _m.bounded(tool)


def worker_task(tool: str | None, queue: str, invocation: Mapping[str, Any], result: Mapping[str, Any]) -> None:
    """Worker: a task's end (its result's state), its handler's time and its wait in the queue.
    `tool` and `queue` are the catalog's declaration's (None: the tool is not declared here)."""
    m = _m
    if m is None:
        return
    label = m.bounded(tool)
    _inc(m, declared.WORKER_TASKS, (label, str(result.get("status", ""))))
    started, finished = result.get("started_at"), result.get("finished_at")
    if isinstance(started, (int, float)) and isinstance(finished, (int, float)):
        _observe(m, declared.TOOL_RUN, (label, queue), max(0.0, finished - started))
    sent = invocation.get("sent_at")
    if isinstance(sent, (int, float)) and isinstance(started, (int, float)):
        _observe(m, declared.QUEUE_WAIT, (queue, label), max(0.0, started - sent))


def sandbox_started(backend: str, seconds: float) -> None:
    m = _m
    if m is not None:
        _observe(m, declared.SANDBOX_START, (backend,), seconds)


def cancel_to_dead(seconds: float, tool: str | None = None) -> None:
    """Worker: from the cancel seen to the call's process reaped."""
    m = _m
    if m is not None:
        _observe(m, declared.CANCEL_TO_DEAD, (m.tool(tool) if tool is not None else _tool,), seconds)


def sessions_in_flight(n: int) -> None:
    m = _m
    if m is not None:
        _set(m, declared.SESSIONS_IN_FLIGHT, (), float(n))


def _inc(m: _Metrics, metric: declared.Metric, labels: tuple[str, ...]) -> None:
    prom = m.prom.get(metric.name)
    if prom is not None:
        (prom.labels(*labels) if labels else prom).inc()
    if m.otel is not None:
        m.otel.add(metric, labels, 1)


def _add(m: _Metrics, metric: declared.Metric, labels: tuple[str, ...], value: float) -> None:
    prom = m.prom.get(metric.name)
    if prom is not None:
        (prom.labels(*labels) if labels else prom).inc(value)
    if m.otel is not None:
        m.otel.add(metric, labels, value)


def _set(m: _Metrics, metric: declared.Metric, labels: tuple[str, ...], value: float) -> None:
    prom = m.prom.get(metric.name)
    if prom is not None:
        (prom.labels(*labels) if labels else prom).set(value)
    if m.otel is not None:
        m.otel.set(metric, labels, value)


def _observe(m: _Metrics, metric: declared.Metric, labels: tuple[str, ...], value: float) -> None:
    prom = m.prom.get(metric.name)
    if prom is not None:
        (prom.labels(*labels) if labels else prom).observe(value)
    if m.otel is not None:
        m.otel.record(metric, labels, value)


# --- the OTLP mirror -------------------------------------------------------------------------------


class _Otel:
    """The same instruments through the OpenTelemetry metrics SDK, exported over OTLP: a counter
    by its name without `_total` (the OTLP-to-Prometheus conversion adds it back), a histogram with
    the declared buckets, a gauge (up and down) as an up-down counter or, set absolutely, a gauge."""

    def __init__(self, provider: Any, meter: Any) -> None:
        self.provider = provider
        self.meter = meter
        self.instruments: dict[str, Any] = {}
        self.observed: dict[str, dict[tuple[str, ...], float]] = {}
        self.pid = os.getpid()

    @classmethod
    def start(cls, service: str) -> _Otel | None:
        if os.environ.get(OTLP_ENV, "none").strip().lower() != "otlp" or _sdk_disabled():
            return None
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
            from opentelemetry.sdk.resources import Resource

            exporter = _otlp_exporter()
            views = [View(instrument_name=m.base_name,
                          aggregation=ExplicitBucketHistogramAggregation(list(m.buckets)))
                     for m in declared.METRICS if m.kind == "histogram"]
            resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service,
                                        "service.instance.id": f"{os.uname().nodename}-{os.getpid()}"})
            provider = MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(exporter)],
                                     views=views)
        except ImportError as e:
            log.warning("metrics: OTLP export not started: the OpenTelemetry SDK is not installed "
                        "(pip install 'toolq[otel]'): %s", e)
            return None
        except Exception as e:  # OTLP is extra: one line, Prometheus goes on
            log.warning("metrics: OTLP export not started: %s", e)
            return None
        otel = cls(provider, provider.get_meter("toolq"))
        otel._instruments()
        return otel

    def _instruments(self) -> None:
        from opentelemetry.metrics import CallbackOptions, Observation

        for m in declared.METRICS:
            unit = "s" if m.name.endswith("_seconds") else ("By" if m.name.endswith("_bytes") else "1")
            if m.kind == "counter":
                self.instruments[m.name] = self.meter.create_counter(m.base_name, unit=unit, description=m.help)
            elif m.kind == "histogram":
                self.instruments[m.name] = self.meter.create_histogram(m.base_name, unit=unit, description=m.help)
            elif m.name in _SCRAPED:
                def observe(_: CallbackOptions, name: str = m.name, labels: tuple[str, ...] = m.labels
                            ) -> Iterable[Observation]:
                    return [Observation(v, dict(zip(labels, k, strict=True)))
                            for k, v in self.observed.get(name, {}).items()]

                self.instruments[m.name] = self.meter.create_observable_gauge(
                    m.base_name, callbacks=[observe], unit=unit, description=m.help)
            elif m is declared.SESSIONS_IN_FLIGHT:
                self.instruments[m.name] = self.meter.create_gauge(m.base_name, unit=unit, description=m.help)
            else:
                self.instruments[m.name] = self.meter.create_up_down_counter(m.base_name, unit=unit,
                                                                              description=m.help)

    def add(self, metric: declared.Metric, labels: tuple[str, ...], value: float) -> None:
        self.instruments[metric.name].add(value, dict(zip(metric.labels, labels, strict=True)))

    def set(self, metric: declared.Metric, labels: tuple[str, ...], value: float) -> None:
        self.instruments[metric.name].set(value, dict(zip(metric.labels, labels, strict=True)))

    def record(self, metric: declared.Metric, labels: tuple[str, ...], value: float) -> None:
        self.instruments[metric.name].record(value, dict(zip(metric.labels, labels, strict=True)))

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.provider.force_flush(timeout_millis=5000)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.provider.shutdown(timeout_millis=5000)


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _otlp_exporter() -> Any:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        return _own_process(Grpc())
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return _own_process(Http())


def _own_process(inner: Any) -> Any:
    """`inner`, exporting only in the process that made it. The SDK restarts a periodic reader's
    thread in a forked child (its at-fork hook), so each pool child of a worker would otherwise push
    the main process's copied points every interval under the main's instance id, beside its own
    provider's (`after_fork`): N+1 writers of one series."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class OwnProcess(MetricExporter):
        def __init__(self) -> None:
            super().__init__(preferred_temporality=inner._preferred_temporality,
                             preferred_aggregation=inner._preferred_aggregation)
            self.pid = os.getpid()

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            if os.getpid() != self.pid:
                return MetricExportResult.SUCCESS  # the parent's points: its own process sends them
            return inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return os.getpid() != self.pid or bool(inner.force_flush(timeout_millis=timeout_millis))

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            if os.getpid() == self.pid:
                inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return OwnProcess()


def elapsed_since(start: float) -> float:
    """Seconds since a `time.monotonic()` start (for call sites that time with it)."""
    return time.monotonic() - start
