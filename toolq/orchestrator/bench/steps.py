"""Benchmark: time per model step (request k -> request k+1 at the fake server) with N parallel
`exec_command` calls of `true`, the figure the reference Codex CLI was measured on.

Steady state, as for Codex (codex-reference.md §4): a warm-up step first, then the median of
the following steps. Codex measured 59 / 111 / 322 ms for N = 1 / 8 / 32 on this kind of machine,
with its fake server in another process; ours runs in its own process too (`toolq fake-model`),
and reports each request's arrival on the system-wide monotonic clock.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from toolq.orchestrator.bench.harness import goal, median, ms, pct, stack
from toolq.orchestrator.fake_model import builders as b
from toolq.orchestrator.turn import Runtime, Session
from toolq.orchestrator.turn_events import Emit, ignore
from toolq.workers.loader import load_catalog

CODEX_MS = {1: 59, 8: 111, 32: 322}
GOAL = {1: 1.0, 8: 0.5, 32: 0.5}


def script(n: int, steps: int) -> list[Any]:
    def step(k: int) -> list[Any]:
        return [b.function_call("exec_command", {"cmd": "true"}, f"call_{k}_{i}") for i in range(n)]

    return [step(k) for k in range(steps + 1)] + [[b.message("done")]]


async def _turn(settings: Any, base_url: str, emit: Emit = ignore) -> None:
    rt = await Runtime.create(settings.model_copy(update={"openai_base_url": base_url, "openai_api_key": "bench"}),
                              catalog=load_catalog())
    try:
        outcome = await Session(rt).run_turn("bench", emit)
        assert outcome.status == "completed", outcome.error
    finally:
        await rt.aclose()


def _request_times(settings: Any, responses: list[Any], emit: Emit = ignore) -> list[float]:
    """Serve the script from a `toolq fake-model` process; its log says when each request came."""
    with tempfile.TemporaryDirectory() as tmp:
        path, log = Path(tmp) / "script.json", Path(tmp) / "fake.log"
        path.write_text(json.dumps(responses))
        with log.open("w") as err:
            server = subprocess.Popen([sys.executable, "-m", "toolq.orchestrator.cli", "fake-model", "--script", str(path)],
                                      stdout=subprocess.PIPE, stderr=err, text=True)
            try:
                assert server.stdout is not None
                asyncio.run(_turn(settings, server.stdout.readline().strip(), emit))
            finally:
                server.terminate()
                server.wait(timeout=10)
        return [float(m) for m in re.findall(r"^request \d+: .* at ([0-9.]+)$", log.read_text(), re.M)]


def step_times(settings: Any, n: int, steps: int, emit: Emit = ignore) -> dict[str, float]:
    """p50 and p90 of the time per step with `n` parallel `exec_command true`, after a warm-up step
    (`emit`: who watches the turn; nobody by default)."""
    t = _request_times(settings, script(n, steps), emit)
    per_step = [t[k + 1] - t[k] for k in range(1, len(t) - 1)]  # skip the warm-up step
    return {"p50": median(per_step), "p90": pct(per_step, 0.9), "samples": per_step}


def run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (1, 8, 32), steps: int = 10) -> dict[int, Any]:
    results: dict[int, Any] = {}
    with stack(workers=2, concurrency=8) as settings:
        for n in sizes:
            results[n] = step_times(settings, n, steps)
    print("\n".join(report(results, steps)), file=out)
    return results


def report(results: dict[int, Any], steps: int) -> list[str]:
    """The printout; sizes Codex was measured at get their ratio, and whether it met its goal."""
    lines = [f"time per model step, {steps} steps after a warm-up (2 workers x 8 pool processes):"]
    for n, r in results.items():
        line = f"  {n:>2} parallel exec_command: p50 {ms(r['p50'])}  p90 {ms(r['p90'])}"
        if n in CODEX_MS:
            r["ratio_vs_codex"] = r["p50"] * 1000 / CODEX_MS[n]
            r["goal_met"], note = goal(r["ratio_vs_codex"], GOAL[n])
            line += f"  = {r['ratio_vs_codex']:.2f}x Codex's {CODEX_MS[n]} ms ({note})"
        lines.append(line)
    return lines


if __name__ == "__main__":
    run()
