"""Benchmark: what the sandbox costs a model step, with N = 1, 8, 32 parallel `exec_command true`.

Both sides in the same run, on the same embedded stack shape: workers with TOOLQ_SANDBOX=none
(the baseline: the command runs unconfined) and workers with the sandbox this machine chooses.
Goal (issue 12): at most 3 ms added per call at 8 parallel calls.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import IO, Any, Iterator

from toolq.orchestrator.bench.harness import ms, stack
from toolq.orchestrator.bench.steps import step_times
from toolq.workers import isolation

GOAL_MS_PER_CALL_AT_8 = 3.0


@contextmanager
def _sandbox_setting(value: str) -> Iterator[None]:
    """The embedded workers inherit this process's environment."""
    before = os.environ.get("TOOLQ_SANDBOX")
    os.environ["TOOLQ_SANDBOX"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOOLQ_SANDBOX", None)
        else:
            os.environ["TOOLQ_SANDBOX"] = before


def run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (1, 8, 32), steps: int = 10) -> dict[int, Any]:
    chosen = isolation.current()
    if chosen.unavailable or chosen.backend == "none":
        print(f"no sandbox to measure: {chosen.describe()}", file=out)
        return {}
    times: dict[str, dict[int, dict[str, float]]] = {}
    for mode in ("none", chosen.backend):
        with _sandbox_setting(mode), stack(workers=2, concurrency=8) as settings:
            times[mode] = {n: step_times(settings, n, steps) for n in sizes}
    off, on = times["none"], times[chosen.backend]
    print(f"time per model step, sandbox off (none) vs on ({chosen.detail}), p50 of {steps} steps:", file=out)
    results: dict[int, Any] = {}
    for n in sizes:
        added = (on[n]["p50"] - off[n]["p50"]) / n
        results[n] = {"off": off[n], "on": on[n], "ratio": on[n]["p50"] / off[n]["p50"], "added_per_call": added}
        line = (f"  {n:>2} parallel exec_command: off {ms(off[n]['p50'])}  on {ms(on[n]['p50'])}  "
                f"= {results[n]['ratio']:.2f}x, {added * 1000:+.2f} ms per call")
        if n == 8:
            line += f" (goal <= {GOAL_MS_PER_CALL_AT_8:.0f} ms)"
        print(line, file=out)
    return results


if __name__ == "__main__":
    run()
