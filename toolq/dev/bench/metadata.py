"""Benchmark: what a metadata call costs a Landlock command (`toolq/workers/isolation/metadata.py`).

Landlock confines neither `chmod` nor `utime`, so the worker makes each for the command, one round
trip per call. The same loop of `os.chmod` and `os.utime` on a workspace file runs in a command
spawned by this process with no sandbox (the baseline) and under Landlock, interleaved; printed is
the median time per call of each and their ratio. No goal: bubblewrap confines metadata by its
mounts and pays nothing; this says what the fallback backend costs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import IO, Any

from toolq.core.settings import Settings
from toolq.dev.bench.harness import median
from toolq.workers import isolation
from toolq.workers.isolation.policy import Policy

#: Prints the microseconds per chmod and per utime of `n` calls each.
_LOOP = ("import os, sys, time; n = int(sys.argv[1]); open('f', 'w').close(); t = time.perf_counter()\n"
         "for i in range(n): os.chmod('f', 0o644 | (i & 1) << 6)\n"
         "a = time.perf_counter() - t; t = time.perf_counter()\n"
         "for i in range(n): os.utime('f', (i, i))\n"
         "print(a / n * 1e6, (time.perf_counter() - t) / n * 1e6)")


def _per_call(sandbox: isolation.Sandbox, calls: int) -> tuple[float, float]:
    workspace = tempfile.mkdtemp(prefix="toolq-bench-metadata-")
    try:
        launch = sandbox.launch([sys.executable, "-I", "-c", _LOOP, str(calls)], workspace=workspace, cwd=workspace,
                                env=dict(os.environ))
        try:
            proc = launch.spawn(cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out = proc.communicate(timeout=300)[0].decode()
        finally:
            launch.close()
        if proc.returncode != 0:
            raise RuntimeError(f"the loop failed under {sandbox.backend}: {out.strip()[-300:]}")
        chmod_us, utime_us = (float(v) for v in out.split())
        return chmod_us, utime_us
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def run(out: IO[str] = sys.stdout, calls: int = 5000, rounds: int = 5) -> dict[str, Any]:
    landlock = isolation.choose(Policy.from_settings(Settings(sandbox="landlock", sandbox_network="host")))
    if landlock.unavailable:
        print(f"no Landlock here: {landlock.unavailable}", file=out)
        return {}
    none = isolation.choose(Policy.from_settings(Settings(sandbox="none")))
    samples: dict[str, list[tuple[float, float]]] = {"none": [], "landlock": []}
    for _ in range(rounds):  # interleaved: load from elsewhere falls on both alike
        samples["none"].append(_per_call(none, calls))
        samples["landlock"].append(_per_call(landlock, calls))
    results: dict[str, Any] = {}
    print(f"a metadata call in a command, none vs landlock, median of {rounds} rounds of {calls} calls:", file=out)
    for i, call in enumerate(("chmod", "utime")):
        off, on = median([s[i] for s in samples["none"]]), median([s[i] for s in samples["landlock"]])
        results[call] = {"none_us": off, "landlock_us": on, "ratio": on / off}
        print(f"  {call}: none {off:.1f} us  landlock {on:.1f} us  = {on / off:.0f}x", file=out)
    return results
