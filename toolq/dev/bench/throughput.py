"""Benchmark: calls per second with K turns at once from one process, against bare Celery.

K = 1, 8, 32, 128 turns, each a loop of steps of 4 parallel no-op calls (`bench_noop`), on a fixed
fleet (2 workers x 4 pool processes), in one process:
- toolq: K concurrent turns on one `Fleet`, each step one `run_calls` of 4 function calls (the
  library path: turn record, routing, binding, ledger claim, signed dispatch, the barrier on the
  runtime's one result subscription, the cancel listener);
- bare Celery: K threads, each step `send_task` x 4 then `AsyncResult.get()` of each, with the
  stock subscribing result backend; each call signed as it is sent (the fleet's workers run
  signed calls only, so any client of it signs; toolq also checks the signatures of results).
For each: calls/s, p50/p99 call latency (toolq: the call's round trip; bare: send to get) and
this process's CPU time per call (`time.process_time`, all threads). toolq's RSS growth per
concurrent turn is the slope of its peak RSS from K=1 to each K. The two paths alternate in
rounds at each K, so both see the same machine.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

from toolq.core.calls import FunctionPayload, ToolCall, ToolName
from toolq.core.contracts import TASK
from toolq.core.items import FunctionCallItem
from toolq.core.settings import Settings
from toolq.dev.bench.harness import BENCH_QUEUE, BENCH_TOOLS, goal, median, ms, pct, stack, workspace
from toolq.dev.bench.pipeline import baseline_client
from toolq.dev.bench.steps import orchestrator_telemetry, telemetry_installed, telemetry_stacks
from toolq.orchestrator.fleet import Fleet, new_turn_id
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.turn_events import ItemCompleted, ToolCallView
from toolq.workers.loader import load_catalog

KS = (1, 8, 32, 128)
CALLS_PER_STEP = 4
#: Calls per path per round at each K (steps per turn follow from it, at least 2).
CALLS_PER_ROUND = 512
GOAL_RATE = 0.9
"""toolq's calls/s at least this fraction of bare Celery's, at every K."""
GOAL_CPU = 1.0
"""toolq's CPU per call at most bare Celery's client CPU per call."""
GOAL_RSS_MB = 1.0
"""toolq's RSS growth per concurrent turn below this."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@dataclass
class Phase:
    """One path's figures at one K, summed over rounds."""

    calls: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    rss_peak: int = 0
    latencies: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        return {"calls": self.calls, "calls_per_s": self.calls / self.wall, "p50": median(self.latencies),
                "p99": pct(self.latencies, 0.99), "cpu_per_call": self.cpu / self.calls,
                "rss_peak_mb": self.rss_peak / 2**20}


class Meter:
    """Wall and CPU time of a block, and the peak RSS seen while it ran (sampled every 10 ms)."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.phase.rss_peak = max(self.phase.rss_peak, _rss())

    def __enter__(self) -> Meter:
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.phase.wall += time.perf_counter() - self.wall
        self.phase.cpu += time.process_time() - self.cpu
        self._stop.set()
        self._sampler.join()
        self.phase.rss_peak = max(self.phase.rss_peak, _rss())


async def _toolq_round(fleet: Fleet, k: int, steps: int, phase: Phase) -> None:
    def heard(event: Any) -> None:
        if isinstance(event, ItemCompleted) and isinstance(event.item, ToolCallView) and event.item.round_trip:
            phase.latencies.append(event.item.round_trip)

    async def turn() -> None:
        turn_id = new_turn_id()
        for s in range(steps):
            items = [FunctionCallItem(call_id=f"call_{s}_{i}", name="bench_noop", arguments="{}")
                     for i in range(CALLS_PER_STEP)]
            outputs = await fleet.run_calls(items, turn_id, emit=heard)
            assert [o.get("output") for o in outputs] == ["ok"] * CALLS_PER_STEP, outputs

    with Meter(phase):
        await asyncio.gather(*(turn() for _ in range(k)))
    phase.calls += k * steps * CALLS_PER_STEP


def _bare_calls(fleet: Fleet, n: int) -> list[tuple[str, dict[str, Any]]]:
    """(task id, invocation) for n bare calls, made before the clock starts."""
    call = ToolCall(tool_name=ToolName.plain("bench_noop"), call_id="call_b", payload=FunctionPayload(arguments="{}"))
    out = []
    for _ in range(n):
        context = StepContext(f"base-{uuid.uuid4().hex[:10]}", 0, time.time() + 300, workspace())
        inv = fleet.registry.bind(call, context, 0)
        out.append((inv.task_id, inv.model_dump(mode="json")))
    return out


def _bare_round(client: Any, signer: Any, calls: list[tuple[str, dict[str, Any]]], k: int, steps: int,
                phase: Phase, pool: ThreadPoolExecutor) -> None:
    def turn(mine: list[tuple[str, dict[str, Any]]]) -> list[float]:
        latencies = []
        for s in range(steps):
            sent = []
            for task_id, invocation in mine[s * CALLS_PER_STEP:(s + 1) * CALLS_PER_STEP]:
                t0 = time.perf_counter()
                signature = signer.sign_invocation(TASK, task_id, invocation)
                sent.append((t0, client.send_task(TASK, args=[invocation], kwargs={"signature": signature},
                                                  task_id=task_id, queue=BENCH_QUEUE)))
            for t0, result in sent:
                assert result.get(timeout=60)["output"] == "ok"
                latencies.append(time.perf_counter() - t0)
        return latencies

    per_turn = steps * CALLS_PER_STEP
    with Meter(phase):
        futures = [pool.submit(turn, calls[j * per_turn:(j + 1) * per_turn]) for j in range(k)]
        for f in futures:
            phase.latencies += f.result()
    phase.calls += k * per_turn


async def _measure(settings: Any, ks: tuple[int, ...], rounds: int, calls_per_round: int) -> dict[str, Any]:
    fleet = await Fleet.open(settings, catalog=load_catalog([BENCH_TOOLS]))
    client, signer = baseline_client(settings), fleet.dispatcher.signer
    pool = ThreadPoolExecutor(max_workers=max(ks), thread_name_prefix="bench-bare")
    res: dict[str, Any] = {"ks": {}}
    try:
        warm = Phase()  # both paths once; every bare thread up (and its result backend) before RSS counts
        await _toolq_round(fleet, 8, 2, warm)
        top = max(ks)
        await asyncio.to_thread(_bare_round, client, signer, _bare_calls(fleet, top * CALLS_PER_STEP), top, 1, warm,
                                pool)
        for k in ks:
            steps = max(2, calls_per_round // (k * CALLS_PER_STEP))
            toolq, bare = Phase(), Phase()
            for _ in range(rounds):
                calls = _bare_calls(fleet, k * steps * CALLS_PER_STEP)
                await asyncio.to_thread(_bare_round, client, signer, calls, k, steps, bare, pool)
                await _toolq_round(fleet, k, steps, toolq)
            res["ks"][k] = {"steps": steps, "toolq": toolq.figures(), "bare": bare.figures()}
    finally:
        pool.shutdown(wait=False)
        client.close()
        await fleet.aclose()
    res["load"] = os.getloadavg()
    return res


def run(out: IO[str] = sys.stdout, ks: tuple[int, ...] = KS, rounds: int = 2,
        calls_per_round: int = CALLS_PER_ROUND, *, telemetry_rounds: int = 4) -> dict[str, Any]:
    """Then the telemetry comparison (`telemetry_run`; `telemetry_rounds=0` skips it), under
    res["telemetry"]."""
    with stack(workers=2, concurrency=4, queues=(BENCH_QUEUE,)) as settings:
        res = asyncio.run(_measure(settings, ks, rounds, calls_per_round))
    print("\n".join(report(res)), file=out)
    if telemetry_rounds and telemetry_installed(out):
        res["telemetry"] = telemetry_run(out, tuple(k for k in ks if k <= 32), telemetry_rounds, calls_per_round)
    return res


# --- telemetry on against off (issue 30) ---------------------------------------------------------

#: calls/s with tracing (to a loopback OTLP receiver) and metrics on: at least this times with both off.
TELEMETRY_GOAL = 0.95


async def _telemetry_rounds(off: Settings, on: Settings, sink: Any, ks: tuple[int, ...], rounds: int,
                            calls_per_round: int) -> dict[int, dict[bool, Phase]]:
    phases: dict[int, dict[bool, Phase]] = {k: {True: Phase(), False: Phase()} for k in ks}
    fleets = {False: await Fleet.open(off, catalog=load_catalog([BENCH_TOOLS])),
              True: await Fleet.open(on, catalog=load_catalog([BENCH_TOOLS]))}
    try:
        for mode in (False, True):  # warm: each fleet's connections and workers once
            with orchestrator_telemetry(mode, sink):
                await _toolq_round(fleets[mode], 8, 2, Phase())
        for r in range(rounds):
            for k in ks:
                steps = max(2, calls_per_round // (k * CALLS_PER_STEP))
                for mode in ((True, False) if r % 2 == 0 else (False, True)):
                    with orchestrator_telemetry(mode, sink):
                        await _toolq_round(fleets[mode], k, steps, phases[k][mode])
    finally:
        for fleet in fleets.values():
            await fleet.aclose()
    return phases


def telemetry_run(out: IO[str] = sys.stdout, ks: tuple[int, ...] = (1, 8, 32), rounds: int = 4,
                  calls_per_round: int = CALLS_PER_ROUND) -> dict[str, Any]:
    """toolq's calls/s with tracing and metrics on (this process and the workers; spans exported
    over OTLP/HTTP to a loopback receiver, /metrics served) against both off, on two stacks of the
    same shape, in interleaved rounds."""
    with telemetry_stacks(workers=2, concurrency=4, queues=(BENCH_QUEUE,)) as (off, on, sink):
        phases = asyncio.run(_telemetry_rounds(off, on, sink, ks, rounds, calls_per_round))
        spans = sink.counts()["spans"]
    res: dict[str, Any] = {"spans": spans, "ks": {}}
    print(f"throughput, telemetry on (traces over OTLP to a loopback receiver, {spans} spans; metrics served) vs "
          f"off, {rounds} interleaved rounds:", file=out)
    for k in ks:
        with_, without = phases[k][True].figures(), phases[k][False].figures()
        ratio = with_["calls_per_s"] / without["calls_per_s"]
        met, note = goal(ratio, TELEMETRY_GOAL, at_least=True)
        res["ks"][k] = {"on": with_, "off": without, "ratio": ratio, "goal_met": met}
        print(f"  K={k:<3} on {with_['calls_per_s']:7.0f} calls/s (p50 {ms(with_['p50'])})  off "
              f"{without['calls_per_s']:7.0f} calls/s (p50 {ms(without['p50'])})  = {ratio:.3f}x ({note})", file=out)
    res["goal_met"] = all(r["goal_met"] for r in res["ks"].values())
    return res


def report(res: dict[str, Any]) -> list[str]:
    """The printout; records in each K's figures whether each goal was met."""
    load = ", ".join(f"{x:.1f}" for x in res.get("load", ()))
    lines = [f"throughput: K turns at once from one process, {CALLS_PER_STEP} parallel no-op calls per step, "
             f"2 workers x 4 pool processes (load average {load}):"]
    first = min(res["ks"])
    all_met = True
    for k, r in res["ks"].items():
        t, b = r["toolq"], r["bare"]
        r["rate_ratio"], r["cpu_ratio"] = t["calls_per_s"] / b["calls_per_s"], t["cpu_per_call"] / b["cpu_per_call"]
        rate_met, rate_note = goal(r["rate_ratio"], GOAL_RATE, at_least=True)
        cpu_met, cpu_note = goal(r["cpu_ratio"], GOAL_CPU)
        r["goal_met"] = rate_met and cpu_met
        lines += [
            f"  K={k:<3} ({t['calls']} calls each, {r['steps']} steps per turn)",
            *(f"    {label:<12}: {p['calls_per_s']:7.0f} calls/s  p50 {ms(p['p50'])}  p99 {ms(p['p99'])}  "
              f"cpu {p['cpu_per_call'] * 1e6:5.0f} µs/call" for label, p in (("bare Celery", b), ("toolq", t))),
            f"    toolq/bare  : calls/s {r['rate_ratio']:.2f}x ({rate_note}); "
            f"cpu/call {r['cpu_ratio']:.2f}x ({cpu_note})",
        ]
        if k > first:  # memory per concurrent turn: the slope of toolq's peak RSS from the smallest K
            r["rss_per_turn_mb"] = (t["rss_peak_mb"] - res["ks"][first]["toolq"]["rss_peak_mb"]) / (k - first)
            rss_met = r["rss_per_turn_mb"] < GOAL_RSS_MB
            r["goal_met"] &= rss_met
            lines.append(f"    toolq RSS   : peak {t['rss_peak_mb']:.1f} MB, {r['rss_per_turn_mb'] * 1024:+.0f} KB per "
                         f"turn over K={first} (goal < {GOAL_RSS_MB:g} MB: {'met' if rss_met else 'MISSED'})")
        all_met &= r["goal_met"]
    res["goal_met"] = all_met
    return lines


if __name__ == "__main__":
    run()
