"""Benchmark: a `max_concurrency=2` tool called 16 times across 3 turns at once never has more
than 2 running (counted from the ledger's start and finish timestamps), and the fleet's throughput
for other tools is unchanged while it is busy: no-op calls/s alone and beside it, in the same run.

The limited tool sleeps, holding a worker slot while it runs, so at most 2 of the fleet's 8 slots
are its; the no-op steps use 6 calls each, what the other slots can run. The calls that wait for a
permit wait in the orchestrator (`throttled`), not on a worker, which is what keeps the ratio at 1.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from typing import IO, Any

from toolq.core.items import FunctionCallItem, FunctionCallOutputItem
from toolq.dev.bench.harness import BENCH_QUEUE, BENCH_TOOLS, goal, median, stack, workspace
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.turn import Runtime
from toolq.workers.loader import load_catalog

LIMIT = 2
TURN_SIZES = (6, 5, 5)
GOAL = 0.9
"""No-op calls/s beside the busy limited tool at least this many times the calls/s alone."""


def max_running(intervals: list[tuple[float, float]]) -> int:
    """The most (start, finish) intervals open at one instant; a finish at t comes before a start at t."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(f, -1) for _, f in intervals])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


async def _step(rt: Runtime, turn_id: str, step: int, name: str, n: int, arguments: str = "{}") -> None:
    s = rt.fleet.step(StepContext(turn_id, step, time.time() + 120, workspace()))
    for i in range(n):
        call = rt.fleet.bind(FunctionCallItem(call_id=f"call_{step}_{i}", name=name, arguments=arguments), s.ctx, i)
        assert call is not None
        s.add(call)
    outputs = await s.wait()
    assert all(isinstance(o, FunctionCallOutputItem) and o.output == "ok" for o in outputs), outputs


async def _noop_rate(rt: Runtime, duration: float, parallel: int) -> tuple[float, float]:
    """No-op calls/s over `duration`, in steps of `parallel` calls, and this process's CPU seconds
    per call meanwhile (the limited turns' waiting included, when they run beside)."""
    turn_id = f"turn-bench-noop-{uuid.uuid4().hex[:8]}"
    await rt.fleet.router.watch_turn(turn_id)
    try:
        calls, started, cpu, step = 0, time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - started < duration:
            await _step(rt, turn_id, step, "bench_noop", parallel)
            calls, step = calls + parallel, step + 1
        return calls / (time.perf_counter() - started), (time.process_time() - cpu) / calls
    finally:
        await rt.fleet.router.unwatch_turn(turn_id)


async def _limited_turns(rt: Runtime, ms: int) -> list[str]:
    turn_ids = [f"turn-bench-limited-{uuid.uuid4().hex[:8]}" for _ in TURN_SIZES]
    for t in turn_ids:  # one after another: several watch_turn at once on one runtime is another branch's fix
        await rt.fleet.router.watch_turn(t)
    try:
        await asyncio.gather(*(_step(rt, t, 0, "bench_limited", n, f'{{"ms": {ms}}}')
                               for t, n in zip(turn_ids, TURN_SIZES, strict=True)))
    finally:
        for t in turn_ids:
            await rt.fleet.router.unwatch_turn(t)
    return turn_ids


async def _measure(settings: Any, rounds: int, duration: float, ms: int) -> dict[str, Any]:
    rt = await Runtime.create(settings, catalog=load_catalog([BENCH_TOOLS]))
    alone: list[tuple[float, float]] = []
    beside: list[tuple[float, float]] = []
    peaks: list[int] = []
    try:
        await _noop_rate(rt, 0.3, 6)  # warm-up
        for _ in range(rounds):
            alone.append(await _noop_rate(rt, duration, 6))
            load = asyncio.create_task(_limited_turns(rt, ms))
            await asyncio.sleep(0.1)  # its first calls are running, the rest throttled
            beside.append(await _noop_rate(rt, duration, 6))
            busy_to_the_end = not load.done()
            turn_ids = await load
            calls = [c for t in turn_ids for c in await rt.fleet.ledger.calls(t)]
            intervals = [(float(c["started_at"]), float(c["finished_at"])) for c in calls
                         if c.get("started_at") and c.get("finished_at")]
            assert len(intervals) == sum(TURN_SIZES), calls
            peaks.append(max_running(intervals))
            if not busy_to_the_end:
                print("  (the limited tool finished before the no-op phase did: raise its ms)", file=sys.stderr)
    finally:
        await rt.aclose()
    rate_alone, rate_beside = median(r for r, _ in alone), median(r for r, _ in beside)
    return {"rounds": rounds, "peak": max(peaks), "alone": rate_alone, "beside": rate_beside,
            "ratio": rate_beside / rate_alone, "cpu_alone": median(c for _, c in alone),
            "cpu_beside": median(c for _, c in beside), "ms": ms}


def run(out: IO[str] = sys.stdout, rounds: int = 3, duration: float = 2.0, ms: int = 500) -> dict[str, Any]:
    with stack(workers=2, concurrency=4, queues=(BENCH_QUEUE,)) as settings:
        res = asyncio.run(_measure(settings, rounds, duration, ms))
    print("\n".join(report(res)), file=out)
    return res


def report(res: dict[str, Any]) -> list[str]:
    """The printout; records in `res` whether each goal was met."""
    peak_met = res["peak"] <= LIMIT
    res["goal_met"], note = goal(res["ratio"], GOAL, at_least=True)
    res["goal_met"] = res["goal_met"] and peak_met
    return [
        f"limits: bench_limited (max_concurrency={LIMIT}, {res['ms']} ms) called {sum(TURN_SIZES)} times across "
        f"{len(TURN_SIZES)} turns at once, {res['rounds']} round(s):",
        f"  most running at once (ledger timestamps) : {res['peak']}   (goal <= {LIMIT}: "
        f"{'met' if peak_met else 'MISSED'})",
        f"  no-op calls/s, alone                      : {res['alone']:.0f}",
        f"  no-op calls/s, beside the limited tool    : {res['beside']:.0f}",
        f"  ratio beside/alone                        : {res['ratio']:.2f}x   ({note})",
        f"  orchestrator CPU per no-op call           : {res['cpu_alone'] * 1e3:.2f} ms alone, "
        f"{res['cpu_beside'] * 1e3:.2f} ms beside (the waiting turns' share included)",
    ]


if __name__ == "__main__":
    run()
