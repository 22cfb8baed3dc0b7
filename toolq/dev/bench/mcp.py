"""Benchmark: a no-op MCP tool's round trip through the fleet against a no-op built-in tool's.

Same worker, same run, both through toolq's pipeline (one `Step` per call, as in `pipeline`):
- baseline: `bench_noop`, a plain catalog tool;
- MCP: `bench.noop` on the worker's MCP server (`mcp_server.py`, stdio): the call also crosses
  the pool child → host socket and one JSON-RPC request on a warm session.
Calls are sequential, the two interleaved in rounds so both see the same machine.
"""

from __future__ import annotations

import secrets
import shlex
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from toolq.core.catalog import Catalog
from toolq.core.mcp_specs import mcp_queue
from toolq.core.settings import Settings
from toolq.dev.bench.harness import (
    BENCH_QUEUE,
    BENCH_TOOLS,
    START_BENCH_WORKER,
    FleetNotReady,
    measured,
    median,
    pct,
    require_queues,
    two_paths_report,
)
from toolq.dev.bench.pipeline import _toolq_calls
from toolq.local.embedded import RedisServer, WorkerProcess
from toolq.orchestrator.turn import Runtime
from toolq.workers.loader import load_catalog

SERVER = "bench"
SERVE_IT = f"{SERVER}={sys.executable} -P -m toolq.dev.bench.mcp_server"
START_MCP_BENCH_WORKER = f"{START_BENCH_WORKER} --mcp {shlex.quote(SERVE_IT)}"


class McpWorkerProcess(WorkerProcess):
    """`toolq worker --mcp ...` as a child process (the bench's and the tests')."""

    def __init__(self, *args: Any, mcp: list[str], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.mcp = mcp

    def argv(self) -> list[str]:
        return super().argv() + [a for m in self.mcp for a in ("--mcp", m)]


@contextmanager
def mcp_stack() -> Iterator[Settings]:
    settings = Settings.load(tools=[BENCH_TOOLS])
    if settings.redis_url:
        try:
            require_queues(settings, (BENCH_QUEUE, mcp_queue(SERVER)))
        except FleetNotReady as e:
            raise FleetNotReady(str(e).replace(START_BENCH_WORKER, START_MCP_BENCH_WORKER)) from None
        yield settings
        return
    key = secrets.token_hex(32)
    with RedisServer() as redis:
        worker = McpWorkerProcess(redis.url, queues=[BENCH_QUEUE], concurrency=2, tools=[BENCH_TOOLS],
                                  env={"TOOLQ_SIGNING_KEY": key}, mcp=[SERVE_IT])
        worker.start()
        try:
            yield settings.model_copy(update={"redis_url": redis.url, "signing_key": key})
        finally:
            worker.stop()


async def _measure(settings: Settings, rounds: int, per_round: int) -> dict[str, Any]:
    rt = await Runtime.create(settings, catalog=Catalog(list(load_catalog([BENCH_TOOLS]))))
    await rt.fleet.follow_fleet_tools()  # the bench server's tools, from the fleet catalog
    turn_id = f"turn-bench{uuid.uuid4().hex[:8]}"
    await rt.fleet.router.watch_turn(turn_id)
    try:
        async def mcp_calls(n: int, step0: int) -> list[float]:
            return await _toolq_calls(rt, turn_id, n, step0, name="noop", namespace=SERVER)

        await _toolq_calls(rt, turn_id, 20, 10_000)  # warm-up both paths
        await mcp_calls(20, 20_000)
        base: list[float] = []
        mcp: list[float] = []
        for r in range(rounds):
            base += await _toolq_calls(rt, turn_id, per_round, 2 * r * per_round)
            mcp += await mcp_calls(per_round, (2 * r + 1) * per_round)
    finally:
        await rt.fleet.router.unwatch_turn(turn_id)
        await rt.aclose()
    return {"calls": len(mcp), "builtin_p50": median(base), "builtin_p90": pct(base, 0.9),
            "mcp_p50": median(mcp), "mcp_p90": pct(mcp, 0.9), "ratio_p50": median(mcp) / median(base)}


GOAL = 1.5
"""An MCP tool's p50 per call at most this many times a built-in's (one stdio hop on a warm session)."""


def run(out: IO[str] = sys.stdout, rounds: int = 3, per_round: int = 100) -> dict[str, Any]:
    return measured(mcp_stack(), _measure, report, out, rounds, per_round)


def report(res: dict[str, Any]) -> list[str]:
    return two_paths_report(
        res, GOAL,
        f"per-call round trip over {res['calls']} sequential no-op calls each (same worker, one Step per call):",
        ("built-in tool bench_noop", "builtin"), ("MCP tool bench.noop (stdio)", "mcp"), "ratio MCP/built-in (p50)")


if __name__ == "__main__":
    run()
