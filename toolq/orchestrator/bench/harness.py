"""Shared set-up for the benchmarks: the real stack (embedded unless REDIS_URL is set)."""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from typing import Iterator

from toolq.orchestrator.settings import Settings

BENCH_TOOLS = "toolq.orchestrator.bench.tools"


@contextmanager
def stack(workers: int = 2, concurrency: int = 4) -> Iterator[Settings]:
    """Settings pointing at a Redis with workers that load the bench tools."""
    settings = Settings.load(tools=[BENCH_TOOLS])
    if settings.redis_url:
        yield settings  # the user's fleet: its workers must load toolq.orchestrator.bench.tools too
        return
    from toolq.orchestrator.embedded import EmbeddedStack

    with EmbeddedStack(workers=workers, concurrency=concurrency, tools=[BENCH_TOOLS]) as embedded:
        yield settings.model_copy(update={"redis_url": embedded.url, "signing_key": embedded.signing_key})


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


median = statistics.median
