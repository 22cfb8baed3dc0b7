"""A loopback OTLP/HTTP receiver for the tests and the bench: `POST /v1/traces` and `/v1/metrics`
(protobuf, gzip or not), decoded with opentelemetry-proto's `ExportTraceServiceRequest` and
`ExportMetricsServiceRequest`; the spans kept in a list, the metrics' names and data points too.

    with OtlpSink() as sink:
        env = {"OTEL_TRACES_EXPORTER": "otlp", **sink.env()}
        ...
        spans = sink.wait_for(lambda spans: any(s.name == "invoke_agent toolq" for s in spans))

Listens on 127.0.0.1 only, on a free port. Not a collector: no retries asked, no partial success.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from toolq.core.import_path import NEUTRAL_CWD, python_argv

#: The largest request body taken (an exporter's batch is far below it).
MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class SinkSpan:
    trace_id: str
    span_id: str
    parent_id: str
    """"" for a root span."""
    name: str
    kind: int
    attributes: dict[str, Any]
    service: str
    """Its resource's `service.name`."""
    start_ns: int
    end_ns: int
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""

    @property
    def duration(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True)
class SinkPoint:
    """One metric data point: its metric's name, its attributes, and its value (a number for a
    sum or gauge; the count for a histogram)."""

    name: str
    attributes: dict[str, Any]
    value: float
    service: str


def _value(v: Any) -> Any:
    """An OTLP `AnyValue` as Python."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_traces(body: bytes) -> list[SinkSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(SinkSpan(trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                                    parent_id=s.parent_span_id.hex(), name=s.name, kind=s.kind,
                                    attributes=_attributes(s.attributes), service=service,
                                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                                    status_code=s.status.code, resource=resource, scope=ss.scope.name))
    return out


def decode_metrics(body: bytes) -> list[SinkPoint]:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    out = []
    for rm in request.resource_metrics:
        service = str(_attributes(rm.resource.attributes).get("service.name", ""))
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind is None:
                    continue
                for p in getattr(m, kind).data_points:
                    if kind in ("histogram", "exponential_histogram", "summary"):
                        value = float(p.count)
                    else:
                        value = float(p.as_double if p.WhichOneof("value") == "as_double" else p.as_int)
                    out.append(SinkPoint(name=m.name, attributes=_attributes(p.attributes), value=value,
                                         service=service))
    return out


def sink_env(endpoint: str) -> dict[str, str]:
    """The variables that send a process's traces to a sink at `endpoint`, exported promptly."""
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}


class OtlpSink:
    """A threaded HTTP server on 127.0.0.1 taking OTLP/HTTP protobuf exports."""

    def __init__(self, *, lazy: bool = False) -> None:
        self.lazy = lazy
        """Keep the bodies and decode them only when counted (`/count`): the bench's receiver, which
        must cost the machine no more than a collector elsewhere would."""
        self._raw: list[tuple[str, bytes]] = []
        self.spans: list[SinkSpan] = []
        self.points: list[SinkPoint] = []
        self.requests = 0
        self.errors: list[str] = []
        self._cond = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if length < 0 or length > MAX_BODY:
                        raise ValueError(f"a body of {length} bytes")
                    body = self.rfile.read(length)
                    encoding = (self.headers.get("Content-Encoding") or "").lower()
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    path = self.path.split("?")[0]
                    if sink.lazy and path.endswith(("/v1/traces", "/v1/metrics")):
                        with sink._cond:
                            sink._raw.append((path, body))
                    elif path.endswith("/v1/traces"):
                        sink._add(spans=decode_traces(body))
                    elif path.endswith("/v1/metrics"):
                        sink._add(points=decode_metrics(body))
                    else:
                        self._answer(404)
                        return
                except Exception as e:  # a test reads `errors`
                    sink._error(f"{self.path}: {type(e).__name__}: {e}")
                    self._answer(400)
                    return
                self._answer(200)

            def do_GET(self) -> None:
                """`/count`: how many spans, points and errors came (what a sink in another process tells)."""
                if self.path.split("?")[0] != "/count":
                    self._answer(404)
                    return
                sink.decode_kept()
                with sink._cond:
                    body = json.dumps({"spans": len(sink.spans), "points": len(sink.points),
                                       "errors": len(sink.errors)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _answer(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # --- the server --------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT takes (the exporters add `/v1/traces`, `/v1/metrics`)."""
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables that send a process's traces here (metrics too, with OTEL_METRICS_EXPORTER=otlp)."""
        return sink_env(self.endpoint)

    def start(self) -> OtlpSink:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="otlp-sink", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> OtlpSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what came -----------------------------------------------------------------------------

    def _add(self, spans: list[SinkSpan] | None = None, points: list[SinkPoint] | None = None) -> None:
        with self._cond:
            self.requests += 1
            self.spans.extend(spans or [])
            self.points.extend(points or [])
            self._cond.notify_all()

    def decode_kept(self) -> None:
        """Decode what a lazy sink kept."""
        with self._cond:
            kept, self._raw = self._raw, []
        for path, body in kept:
            try:
                if path.endswith("/v1/traces"):
                    self._add(spans=decode_traces(body))
                else:
                    self._add(points=decode_metrics(body))
            except Exception as e:
                self._error(f"{path}: {type(e).__name__}: {e}")

    def _error(self, message: str) -> None:
        with self._cond:
            self.errors.append(message)
            self._cond.notify_all()

    def snapshot(self) -> list[SinkSpan]:
        with self._cond:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[SinkSpan]], bool], timeout: float = 30.0) -> list[SinkSpan]:
        """The spans so far, once `done(spans)` holds; AssertionError with what came after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"the sink did not get the spans waited for in {timeout:g}s; "
                                         f"it has {len(self.spans)}: {names}; errors: {self.errors}")
                self._cond.wait(min(left, 0.5))
            return list(self.spans)

    def trace(self, trace_id: str) -> list[SinkSpan]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def clear(self) -> None:
        with self._cond:
            self.spans.clear()
            self.points.clear()


class SinkProcess:
    """A lazy `OtlpSink` in a process of its own (`python -m toolq.dev.otlp_sink`): what it takes is
    decoded only when counted, after the measured rounds, so the bench's machine pays for sending
    spans as it would to a collector elsewhere, not for receiving them."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return sink_env(self.endpoint)

    def counts(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.endpoint}/count", timeout=30) as answer:
            return dict(json.loads(answer.read()))

    def __enter__(self) -> SinkProcess:
        # As every toolq process starts: never importing from the current directory (a workspace).
        self._proc = subprocess.Popen(python_argv("-m", "toolq.dev.otlp_sink"), cwd=NEUTRAL_CWD,
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self.__exit__()
            raise RuntimeError(f"the OTLP sink did not start (it said {line!r})")
        self.port = int(line)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None


if __name__ == "__main__":  # SinkProcess: the port on the first line, then serve until terminated
    import signal

    with OtlpSink(lazy=True) as server:
        print(server.port, flush=True)
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
