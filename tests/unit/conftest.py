"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from toolq.local.embedded import RedisServer


@pytest.fixture(scope="module")
def r() -> Iterator[redis.Redis]:
    """A Redis server of the test module's own (a module that defines `r` itself uses its own)."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        yield client
        client.close()


#: The variables that turn traces on or put content in them: cleared for a test that sets its own.
OTEL_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT")


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Tracing on in this process, into memory (an InMemorySpanExporter). The SDK is imported here,
    not at the top: other unit tests check that tracing off imports nothing of it."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from toolq.telemetry import tracing

    for var in OTEL_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.reset_for_tests()


@pytest.fixture
def served() -> Iterator[int]:
    """This process's orchestrator metrics served on a free loopback port: the port."""
    from toolq.telemetry import metrics

    port = metrics.serve_orchestrator(0, host="127.0.0.1")
    assert port
    try:
        yield port
    finally:
        metrics.stop()
