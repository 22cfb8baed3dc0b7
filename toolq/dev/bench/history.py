"""Benchmark: history growth. One session of 200 model steps, each with one no-op call
(`bench_noop`), so the history grows by two items a step; the step time at steps 1, 50, 100
and 200.

The request grows with the history (the whole history is sent every time, as in Codex), so its
encoding and its trip to the fake model grow too. What must not grow is the orchestrator's work
around it: recording, pairing, dispatch, the barrier. That is measured as this process's CPU
(`time.process_time`, every thread) from one request's start to the next, minus the CPU spent
inside `ModelClient.stream` (encoding and sending the request, parsing the response); the wall
step time at the fake model (a `toolq fake-model` process) is printed beside it. Each figure is
the median of a window of steps around the named one.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from toolq.core import import_path
from toolq.dev.bench.harness import BENCH_TOOLS, goal, median, stack
from toolq.dev.fake_model import builders as b
from toolq.orchestrator.turn import Runtime, Session
from toolq.workers.loader import load_catalog

STEPS = 200
CHECKPOINTS = (1, 50, 100, 200)
WINDOW = 10
GOAL = 1.2


def script(steps: int) -> list[Any]:
    return [[b.function_call("bench_noop", {}, f"call_{k}")] for k in range(steps)] + [[b.message("done")]]


class CpuAroundRequests:
    """Wraps the runtime's model client: this process's CPU at each request's start, and the CPU
    spent inside each request."""

    def __init__(self, rt: Runtime) -> None:
        self.starts: list[float] = []
        self.inside: list[float] = []
        stream = rt.client.stream

        async def timed(body: dict[str, Any]):  # an async generator, as `stream` is
            t = time.process_time()
            self.starts.append(t)
            inside = 0.0
            gen = stream(body)
            try:
                while True:
                    try:
                        event = await gen.__anext__()
                    except StopAsyncIteration:
                        break
                    inside += time.process_time() - t
                    yield event
                    t = time.process_time()
                inside += time.process_time() - t
            finally:
                self.inside.append(inside)

        rt.client.stream = timed  # type: ignore[method-assign]

    def per_step(self) -> tuple[list[float], list[float]]:
        """(CPU around the request, CPU inside it) for each step that has a next request."""
        around = [self.starts[k + 1] - self.starts[k] - self.inside[k] for k in range(len(self.starts) - 1)]
        return around, self.inside[: len(around)]


async def _session(settings: Any, base_url: str) -> tuple[list[float], list[float]]:
    rt = await Runtime.create(settings.model_copy(update={"openai_base_url": base_url, "openai_api_key": "bench",
                                                         "max_steps": STEPS + 10}),
                              catalog=load_catalog([BENCH_TOOLS]))
    cpu = CpuAroundRequests(rt)
    try:
        outcome = await Session(rt).run_turn("bench")
        assert outcome.status == "completed", outcome.error
    finally:
        await rt.aclose()
    return cpu.per_step()


def measure(settings: Any, steps: int) -> dict[str, list[float]]:
    """Serve the script from a `toolq fake-model` process; its log says when each request came."""
    with tempfile.TemporaryDirectory() as tmp:
        path, log = Path(tmp) / "script.json", Path(tmp) / "fake.log"
        path.write_text(json.dumps(script(steps)))
        with log.open("w") as err:
            server = subprocess.Popen([*import_path.python_argv("-m", "toolq.cli.main"), "fake-model",
                                       "--script", str(path)], stdout=subprocess.PIPE, stderr=err, text=True,
                                      cwd=import_path.NEUTRAL_CWD)
            try:
                assert server.stdout is not None
                around, inside = asyncio.run(_session(settings, server.stdout.readline().strip()))
            finally:
                server.terminate()
                server.wait(timeout=10)
        t = [float(m) for m in re.findall(r"^request \d+: .* at ([0-9.]+)$", log.read_text(), re.M)]
    return {"around": around, "inside": inside, "wall": [t[k + 1] - t[k] for k in range(len(t) - 1)]}


def at(values: list[float], step: int, window: int) -> float:
    """The median over `window` steps ending at `step` (1-based; step 1: steps 1..window, after
    the warm-up step 0, which loads Celery and the tool's first worker)."""
    lo = step - window if step > window else 1
    return median(values[lo: lo + window] or values[-1:])


def run(out: IO[str] = sys.stdout, steps: int = STEPS, window: int = WINDOW) -> dict[str, Any]:
    with stack(workers=1, concurrency=2, queues=("toolq-bench",)) as settings:
        samples = measure(settings, steps)
    checkpoints = sorted({*(c for c in CHECKPOINTS if c <= steps), steps})
    res: dict[str, Any] = {"steps": steps, "window": window, "samples": samples,
                           "at": {c: {k: at(v, c, window) for k, v in samples.items()} for c in checkpoints}}
    print("\n".join(report(res)), file=out)
    return res


def report(res: dict[str, Any]) -> list[str]:
    rows = res["at"]
    first, last = rows[min(rows)], rows[max(rows)]
    res["ratio"] = last["around"] / first["around"]
    res["goal_met"], note = goal(res["ratio"], GOAL)
    lines = [f"history growth: one session of {res['steps']} steps, one bench_noop call each (medians of "
             f"{res['window']} steps; CPU of this process, all threads):"]
    for step, r in rows.items():
        lines.append(f"  step {step:>3}: orchestrator CPU around the request {r['around'] * 1000:6.2f} ms   "
                     f"inside it {r['inside'] * 1000:6.2f} ms   wall step {r['wall'] * 1000:7.2f} ms")
    lines.append(f"  CPU around the request, step {max(rows)} / step {min(rows)}: {res['ratio']:.2f}x ({note})")
    return lines


if __name__ == "__main__":
    run()
