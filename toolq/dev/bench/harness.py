"""Shared set-up for the benchmarks: the real stack (embedded unless REDIS_URL is set)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from toolq.core.settings import Settings

BENCH_TOOLS = "toolq.dev.bench.tools"
#: The bench tools' own queue: only a worker that loaded them consumes it (see tools.py).
BENCH_QUEUE = "toolq-bench"
START_BENCH_WORKER = f"toolq worker --tools {BENCH_TOOLS}"


class FleetNotReady(Exception):
    """The user's fleet (REDIS_URL) cannot run this benchmark; the message says what to start."""


@functools.cache
def workspace() -> str:
    """The benches' calls' workspace: a folder of their own (workers refuse `/tmp` itself)."""
    path = tempfile.mkdtemp(prefix="toolq-bench-")
    atexit.register(shutil.rmtree, path, True)
    return path


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Settings for the embedded workers started inside the block: they inherit this process's environment."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def stack(workers: int = 2, concurrency: int = 4, *, queues: tuple[str, ...] = ("toolq",)) -> Iterator[Settings]:
    """Settings pointing at a Redis with workers that load the bench tools and serve `queues`."""
    settings = Settings.load(tools=[BENCH_TOOLS])
    if "TOOLQ_WORKSPACE" not in os.environ:  # not the current folder: a checkout holds toolq's import path
        settings = settings.model_copy(update={"workspace": Path(workspace())})
    if settings.redis_url:
        require_queues(settings, queues)
        yield settings
        return
    from toolq.local.embedded import EmbeddedStack

    with EmbeddedStack(workers=workers, concurrency=concurrency, tools=[BENCH_TOOLS]) as embedded:
        yield settings.model_copy(update={"redis_url": embedded.url, "signing_key": embedded.signing_key})


def require_queues(settings: Settings, queues: tuple[str, ...], timeout: float = 2.0) -> None:
    """Ask the fleet's workers which queues they consume; a benchmark's call never waits on none."""
    from toolq.workers.config import make_app

    app = make_app(settings)
    try:
        replies = app.control.inspect(timeout=timeout).active_queues() or {}
    finally:
        app.close()
    served = {q.get("name") for qs in replies.values() for q in qs or []}
    missing = [q for q in queues if q not in served]
    if missing:
        raise FleetNotReady(missing_queues_line(missing, len(replies)))


def missing_queues_line(missing: list[str], workers: int) -> str:
    found = f"{workers} worker(s) answered" if workers else "no worker answered"
    return (f"no worker on REDIS_URL consumes queue {', '.join(missing)} ({found}); "
            f"start one with `{START_BENCH_WORKER}` on that broker")


def goal(value: float, limit: float, *, at_least: bool = False) -> tuple[bool, str]:
    """Whether a ratio meets its goal, and the printout's note: a miss is never silent."""
    met = value >= limit if at_least else value <= limit
    return met, f"goal {'>=' if at_least else '<='} {limit:g}x: {'met' if met else 'MISSED'}"


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


median = statistics.median


def two_paths_report(res: dict[str, Any], limit: float, title: str, baseline: tuple[str, str],
                     candidate: tuple[str, str], ratio_label: str) -> list[str]:
    """The printout of a benchmark that times two paths in one run: `baseline` and `candidate`
    are (label, key prefix of `<prefix>_p50`/`<prefix>_p90` in `res`). Records in `res` whether
    the p50 ratio met its goal."""
    res["goal_met"], note = goal(res["ratio_p50"], limit)
    width = max(len(baseline[0]), len(candidate[0]), len(ratio_label))
    return [
        title,
        *(f"  {label:<{width}} : p50 {ms(res[key + '_p50'])}  p90 {ms(res[key + '_p90'])}"
          for label, key in (baseline, candidate)),
        f"  {ratio_label:<{width}} : {res['ratio_p50']:.2f}x   ({note})",
    ]


def measured(stack_cm: Any, measure: Callable[..., Coroutine[Any, Any, dict[str, Any]]],
             report: Callable[..., list[str]],
             out: IO[str], *args: Any) -> dict[str, Any]:
    """Measure on the stack the context manager gives, print the report, return the figures."""
    with stack_cm as settings:
        res = asyncio.run(measure(settings, *args))
    print("\n".join(report(res)), file=out)
    return res
