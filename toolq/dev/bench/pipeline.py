"""Benchmark: per-call overhead of toolq's pipeline vs a bare Celery round trip.

Same workers, same run, same task (`toolq.run` executing the no-op `bench_noop` tool):
- baseline: `send_task` + `AsyncResult.get()` with a stock Celery client (pub/sub result);
- toolq: a one-call `Step`: route, bind (schema check), ledger claim, send, the barrier's
  per-turn pattern subscription, the output item.
Calls are sequential, baseline and toolq interleaved in rounds so both see the same machine.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import IO, Any

from celery import Celery

from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.contracts import TASK
from toolq.core.items import FunctionCallItem, FunctionCallOutputItem
from toolq.dev.bench.harness import (
    BENCH_QUEUE,
    BENCH_TOOLS,
    measured,
    median,
    pct,
    stack,
    two_paths_report,
    workspace,
)
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.turn import Runtime
from toolq.workers.config import celery_config
from toolq.workers.loader import load_catalog


async def _toolq_calls(rt: Runtime, turn_id: str, n: int, step0: int, *, name: str = "bench_noop",
                       namespace: str | None = None) -> list[float]:
    times = []
    for i in range(n):
        item = FunctionCallItem(call_id=f"call_{i}", name=name, namespace=namespace, arguments="{}")
        t0 = time.perf_counter()
        step = rt.fleet.step(StepContext(turn_id, step0 + i, time.time() + 60, workspace()))
        call = rt.fleet.bind(item, step.ctx, 0)
        assert call is not None
        step.add(call)
        (out,) = await step.wait()
        times.append(time.perf_counter() - t0)
        assert isinstance(out, FunctionCallOutputItem) and out.output == "ok", out
    return times


def _baseline_calls(client: Celery, rt: Runtime, n: int) -> list[float]:
    call = ToolCall(tool_name=ToolName.plain("bench_noop"), call_id="call_b", payload=FunctionPayload(arguments="{}"))
    times = []
    for _ in range(n):
        ctx = StepContext(f"base-{uuid.uuid4().hex[:8]}", 0, time.time() + 60, workspace())
        inv = rt.fleet.registry.bind(call, ctx, 0)
        invocation = inv.model_dump(mode="json")
        signer = rt.fleet.dispatcher.signer
        assert signer is not None  # a fleet's dispatcher signs
        signature = signer.sign_invocation(TASK, inv.task_id, invocation)  # workers run signed calls only
        t0 = time.perf_counter()
        result = client.send_task(TASK, args=[invocation], kwargs={"signature": signature}, task_id=inv.task_id,
                                  queue=BENCH_QUEUE)
        value = result.get(timeout=30)
        times.append(time.perf_counter() - t0)
        assert value["output"] == "ok", value
    return times


def baseline_client(settings: Any) -> Celery:
    """A stock Celery client of the fleet's broker, with the stock, subscribing result backend:
    the bare round trip the benchmarks compare toolq with (throughput.py too)."""
    client = Celery("bench-baseline", set_as_current=False)
    conf = celery_config(settings, longest=60.0)
    conf["result_backend"] = conf["result_backend"].split("+", 1)[1]
    client.conf.update(conf)
    return client


async def _measure(settings: Any, rounds: int, per_round: int) -> dict[str, Any]:
    rt = await Runtime.create(settings, catalog=load_catalog([BENCH_TOOLS]))
    client = baseline_client(settings)
    turn_id = f"turn-bench{uuid.uuid4().hex[:8]}"
    await rt.fleet.router.watch_turn(turn_id)
    try:
        await _toolq_calls(rt, turn_id, 20, 10_000)  # warm-up both paths
        await asyncio.to_thread(_baseline_calls, client, rt, 20)
        toolq: list[float] = []
        base: list[float] = []
        for r in range(rounds):
            base += await asyncio.to_thread(_baseline_calls, client, rt, per_round)
            toolq += await _toolq_calls(rt, turn_id, per_round, r * per_round)
    finally:
        await rt.fleet.router.unwatch_turn(turn_id)
        client.close()
        await rt.aclose()
    return {"calls": len(toolq), "baseline_p50": median(base), "baseline_p90": pct(base, 0.9),
            "toolq_p50": median(toolq), "toolq_p90": pct(toolq, 0.9), "ratio_p50": median(toolq) / median(base)}


GOAL = 1.2
"""toolq's p50 per call at most this many times the bare round trip."""


def run(out: IO[str] = sys.stdout, rounds: int = 3, per_round: int = 100) -> dict[str, Any]:
    return measured(stack(workers=1, concurrency=2, queues=(BENCH_QUEUE,)), _measure, report, out, rounds, per_round)


def report(res: dict[str, Any]) -> list[str]:
    """The printout; records in `res` whether the ratio met its goal."""
    return two_paths_report(
        res, GOAL, f"per-call round trip over {res['calls']} sequential no-op calls (same task, same workers):",
        ("bare Celery send_task + get", "baseline"), ("toolq pipeline (one Step)", "toolq"), "ratio toolq/bare (p50)")


if __name__ == "__main__":
    run()
