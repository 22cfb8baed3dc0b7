"""Benchmark: a `write_stdin` round trip to a live session against a plain `exec_command` round
trip, in the same run and the same conversation (time per model step, as `bench steps` measures).

A write to a session waits `yield_time_ms` for output, as Codex's does (at least 250 ms), so the
raw figure is that wait plus toolq's cost. The goal compares toolq's cost: the write's round trip
minus its 250 ms wait, against the plain call's round trip (goal <= 1.2x).
"""

from __future__ import annotations

import sys
from typing import IO, Any

from toolq.dev.bench.harness import goal, median, ms, pct, stack
from toolq.dev.bench.steps import _request_times
from toolq.dev.fake_model import builders as b

WRITE_YIELD_S = 0.25
GOAL = 1.2


def script(steps: int) -> list[Any]:
    start = [b.function_call("exec_command", {"cmd": "cat", "tty": True, "yield_time_ms": 250}, "start")]
    plain = [[b.function_call("exec_command", {"cmd": "true"}, f"plain_{k}")] for k in range(steps + 1)]
    writes = [[b.function_call("write_stdin", {"session_id": 1, "chars": "x\n"}, f"write_{k}")]
              for k in range(steps + 1)]
    return [start, *plain, *writes, [b.message("done")]]


def run(out: IO[str] = sys.stdout, steps: int = 20) -> dict[str, Any]:
    with stack(workers=2, concurrency=4) as settings:
        t = _request_times(settings, script(steps))
    per_step = [t[k + 1] - t[k] for k in range(len(t) - 1)]
    # per_step[0] is the session's start; then steps+1 plain ones and steps+1 writes, each with a warm-up
    plain = per_step[2:steps + 2]
    writes = per_step[steps + 3:2 * steps + 3]
    result = {"plain_p50": median(plain), "plain_p99": pct(plain, 0.99),
              "write_p50": median(writes), "write_p99": pct(writes, 0.99)}
    result["ratio"] = (result["write_p50"] - WRITE_YIELD_S) / result["plain_p50"]
    result["goal_met"], note = goal(result["ratio"], GOAL)
    print(f"round trip per model step, {steps} steps after a warm-up (2 workers x 4 pool processes):\n"
          f"  exec_command true:        p50 {ms(result['plain_p50'])}  p99 {ms(result['plain_p99'])}\n"
          f"  write_stdin to a session: p50 {ms(result['write_p50'])}  p99 {ms(result['write_p99'])}"
          f" (includes Codex's 250 ms yield)\n"
          f"  toolq's cost of a write (minus the yield) = {result['ratio']:.2f}x a plain call ({note})", file=out)
    return result


if __name__ == "__main__":
    run()
