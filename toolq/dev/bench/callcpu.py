"""Benchmark: CPU per no-op `exec_command true` call, per process of the stack, over 32-call steps.

Wall time on a shared machine says little; CPU time per process says where a call's cost is:
the orchestrator (this process), each worker's main process and pool children, the session
host (and, apart, the sandboxed commands it reaps), its bubblewrap cells (their processes and
the commands they reap: `toolq/workers/isolation/cell.py`), the Redis server. Read from /proc before and
after the steps (Linux only), on the same embedded stack as `toolq bench steps`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import IO

from toolq.dev.bench.harness import stack
from toolq.dev.bench.steps import step_times

KINDS = ("orchestrator", "worker main", "pool child", "session host", "cells", "redis")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent pid, own CPU seconds, reaped children's CPU seconds)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    ticks = [int(x) for x in fields[11:15]]  # utime stime cutime cstime
    return int(fields[1]), (ticks[0] + ticks[1]) / _TICK, (ticks[2] + ticks[3]) / _TICK


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kind(pid: int, parent_cmd: str) -> str | None:
    cmd = _cmdline(pid)
    if "redis-server" in cmd or "valkey-server" in cmd:
        return "redis"
    if "sessions.host" in cmd:
        return "session host"
    if " worker " in cmd:
        return "pool child" if " worker " in parent_cmd else "worker main"
    return None


def snapshot() -> dict[int, tuple[str, float, float]]:
    """CPU of this process and of the stack's processes below it, by pid."""
    me = os.getpid()
    stats = {pid: s for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if (s := _stat(pid))}

    def ancestors(pid: int) -> list[int]:
        found = []
        while pid > 1 and pid in stats:
            pid = stats[pid][0]
            found.append(pid)
        return found

    out: dict[int, tuple[str, float, float]] = {}
    for pid, (ppid, own, reaped) in stats.items():
        above = ancestors(pid)
        kind = "orchestrator" if pid == me else (_kind(pid, _cmdline(ppid)) if me in above else None)
        if kind is None and me in above and any("sessions.host" in _cmdline(a) for a in above):
            kind = "cells"  # bwrap, its init, the cell's program: what they reaped is the commands'
        if kind:
            out[pid] = (kind, own, reaped)
    return out


def per_call(before: dict, after: dict, calls: int) -> dict[str, tuple[float, float]]:
    """Milliseconds of CPU per call by kind: (own, reaped children)."""
    totals = {k: [0.0, 0.0] for k in KINDS}
    for pid, (kind, own, reaped) in after.items():
        _, own0, reaped0 = before.get(pid, (kind, 0.0, 0.0))
        totals[kind][0] += own - own0
        totals[kind][1] += reaped - reaped0
    return {k: (v[0] / calls * 1000, v[1] / calls * 1000) for k, v in totals.items()}


def run(out: IO[str] = sys.stdout, n: int = 32, steps: int = 10, repeats: int = 3) -> list[dict]:
    results = []
    with stack(workers=2, concurrency=8) as settings:
        step_times(settings, n, 2)  # warm: pool children, slots, scripts
        for _ in range(repeats):
            before, t0 = snapshot(), time.process_time()
            step_times(settings, n, steps)
            after = snapshot()
            res = per_call(before, after, n * (steps + 1))  # the warm-up step's calls run too
            res["orchestrator"] = ((time.process_time() - t0) / (n * (steps + 1)) * 1000, 0.0)
            results.append(res)
    print("\n".join(report(results, n)), file=out)
    return results


def report(results: list[dict], n: int) -> list[str]:
    lines = [f"CPU per `exec_command true` call, {n} in parallel per step (ms; own + sandboxed commands reaped; "
             "a cell's commands are in its own figure):"]
    for kind in KINDS:
        own = " / ".join(f"{r[kind][0]:.2f}" for r in results)
        reaped = sum(r[kind][1] for r in results) / len(results)
        lines.append(f"  {kind:<13} {own}" + (f"   + {reaped:.2f} commands" if reaped else ""))
    totals = " / ".join(f"{sum(r[k][0] for k in KINDS):.2f}" for r in results)
    lines.append(f"  {'total own':<13} {totals}")
    return lines


if __name__ == "__main__":
    run()
