"""Benchmark: what streaming a running command's output costs a model step (issue 15 item 3).

`toolq bench steps`' workload (N = 1, 8, 32 parallel `exec_command true`), with the turn watched as
`toolq run --json` watches it (every event encoded as JSON, written to a null sink), once with
`TOOLQ_STREAM_OUTPUT` on and once off, in interleaved rounds on the same embedded stack (the
orchestrator decides per call whether its output streams, so one fleet serves both).
Goal: the step time with streaming within 5% of the one without. Wall time on a shared machine is
noisy, so each run's CPU time (this process and every descendant: Redis, workers, session hosts,
pool processes, the commands they reaped, the fake model) is reported per step too.
"""

from __future__ import annotations

import io
import os
import sys
from typing import IO, Any

from toolq.cli.view import JsonView
from toolq.dev.bench.harness import goal, median, ms, stack
from toolq.dev.bench.steps import step_times

GOAL_RATIO = 1.05


class _Null(io.StringIO):
    def write(self, s: str) -> int:
        return len(s)


def run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (1, 8, 32), steps: int = 6,
        rounds: int = 6) -> dict[str, Any]:
    modes = (True, False)
    samples: dict[tuple[bool, int], list[float]] = {(m, n): [] for m in modes for n in sizes}
    cpu: dict[tuple[bool, int], float] = {(m, n): 0.0 for m in modes for n in sizes}
    with stack(workers=2, concurrency=8) as settings:
        # Interleaved rounds, each mode first in every other one: load from elsewhere on the machine,
        # and whatever the run before leaves behind, fall on both modes alike.
        for k in range(rounds):
            for n in sizes:
                for mode in (modes if k % 2 == 0 else modes[::-1]):
                    watched = settings.model_copy(update={"stream_output": mode})
                    before = tree_cpu()
                    samples[mode, n] += step_times(watched, n, steps, emit=JsonView(_Null()))["samples"]
                    cpu[mode, n] += tree_cpu() - before
    results: dict[str, Any] = {}
    print(f"time per model step, watched (--json), streaming on vs off, p50 of {rounds}x{steps} interleaved steps:",
          file=out)
    for n in sizes:
        on, off = median(samples[True, n]), median(samples[False, n])
        met, note = goal(on / off, GOAL_RATIO)
        per_step = {m: cpu[m, n] / (rounds * (steps + 2)) for m in modes}  # + the warm-up and final steps
        results[str(n)] = {"on": on, "off": off, "ratio": on / off, "goal_met": met, "cpu_on": per_step[True],
                           "cpu_off": per_step[False], "cpu_ratio": per_step[True] / per_step[False]}
        print(f"  {n:>2} parallel exec_command: on {ms(on)}  off {ms(off)}  = {on / off:.3f}x ({note}); "
              f"CPU per step on {ms(per_step[True])}  off {ms(per_step[False])}  = "
              f"{per_step[True] / per_step[False]:.3f}x", file=out)
    return results


def tree_cpu() -> float:
    """CPU seconds of this process and its live descendants, with what each has reaped (Linux /proc)."""
    parents: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parents[int(entry)], used[int(entry)] = int(fields[1]), sum(int(x) for x in fields[11:15])
    me = os.getpid()

    def mine(pid: int) -> bool:
        while pid > 1:
            if pid == me:
                return True
            pid = parents.get(pid, 0)
        return False

    return sum(ticks for pid, ticks in used.items() if mine(pid)) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    run()
