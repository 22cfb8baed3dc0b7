"""Benchmark: what the sandbox costs a model step, with N = 1, 8, 32 parallel `exec_command true`.

Both sides in the same run, on the same embedded stack shape: workers with TOOLQ_SANDBOX=none
(the baseline: the command runs unconfined), then workers with each sandbox that works here;
bubblewrap twice, with its cells (the default) and with a bwrap start per command
(TOOLQ_SANDBOX_CELLS=0), which shows what the cells save. Goal (issue 12): at most 3 ms added per
call at 8 parallel calls.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import IO, Any

from toolq.core.settings import Settings
from toolq.dev.bench.harness import environment, median, ms, stack
from toolq.dev.bench.steps import step_times
from toolq.workers import isolation
from toolq.workers.isolation.policy import Policy

GOAL_MS_PER_CALL_AT_8 = 3.0


#: Each mode's settings, as the workers read them from the environment.
MODES = {"none": {"TOOLQ_SANDBOX": "none"},
         "bwrap": {"TOOLQ_SANDBOX": "bwrap", "TOOLQ_SANDBOX_CELLS": "1"},
         "bwrap, a start per command": {"TOOLQ_SANDBOX": "bwrap", "TOOLQ_SANDBOX_CELLS": "0"},
         "landlock": {"TOOLQ_SANDBOX": "landlock"}}


def run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (1, 8, 32), steps: int = 6,
        rounds: int = 6) -> dict[str, Any]:
    backends = [b for b in ("bwrap", "landlock")
                if not isolation.choose(Policy.from_settings(Settings(sandbox=b))).unavailable]
    if not backends:
        print(f"no sandbox to measure: {isolation.current().describe()}", file=out)
        return {}
    modes = ["none", *(m for m in MODES if MODES[m]["TOOLQ_SANDBOX"] in backends)]
    samples: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in sizes}
    with ExitStack() as stacks:
        fleets = {}
        for mode in modes:
            with environment(MODES[mode]):  # read by the workers when they start
                fleets[mode] = stacks.enter_context(stack(workers=2, concurrency=8))
        # Interleaved rounds: load from elsewhere on the machine falls on every mode alike.
        for _ in range(rounds):
            for n in sizes:
                for mode in modes:
                    samples[mode, n] += step_times(fleets[mode], n, steps)["samples"]
    results: dict[str, Any] = {}
    for backend in modes[1:]:
        print(f"time per model step, sandbox off (none) vs {backend}, p50 of {rounds}x{steps} interleaved steps:",
              file=out)
        for n in sizes:
            off, on = median(samples["none", n]), median(samples[backend, n])
            added = (on - off) / n
            results[f"{backend}/{n}"] = {"off": off, "on": on, "ratio": on / off, "added_per_call": added}
            line = (f"  {n:>2} parallel exec_command: off {ms(off)}  on {ms(on)}  = {on / off:.2f}x, "
                    f"{added * 1000:+.2f} ms per call")
            if n == 8:  # a miss is never silent
                met = added * 1000 <= GOAL_MS_PER_CALL_AT_8
                results[f"{backend}/{n}"]["goal_met"] = met
                line += f" (goal <= {GOAL_MS_PER_CALL_AT_8:.0f} ms per call: {'met' if met else 'MISSED'})"
            print(line, file=out)
    return results


if __name__ == "__main__":
    run()
