"""Benchmark: cancel latency, from `cancel()` to every process of the turn gone and every
output recorded (the turn's `run_turn` returned). p50 and p95 over `runs` turns.

`cancel()` is what `toolq cancel` runs after its interpreter starts; the reference Codex CLI
stopped about 32 ms after SIGINT (docs/reference/codex-behaviour.md#cancel).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from toolq.cli.cancel import cancel
from toolq.dev.bench.harness import FleetNotReady, median, ms, pct, stack
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.turn import Runtime, Session
from toolq.workers.loader import load_catalog


def _pids(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    if (entry / "stat").read_text().split(") ", 1)[-1][:1] != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


#: How long the call's processes may take to appear before the bench concludes they run elsewhere.
APPEAR_TIMEOUT = 30.0


async def _one(rt: Runtime, fake: FakeModel, marker: str) -> float:
    session = Session(rt)
    turn = asyncio.create_task(session.run_turn("bench"))
    deadline = time.monotonic() + APPEAR_TIMEOUT
    while not _pids(marker):
        if time.monotonic() > deadline:
            session.cancel()
            await turn
            # The processes are watched in /proc: a fleet on other hosts cannot be measured from here.
            raise FleetNotReady(f"the call's processes did not appear on this host within {APPEAR_TIMEOUT:g} s; "
                                "run `toolq bench cancel` on a host whose worker consumes queue toolq")
        await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    await cancel(rt.settings, session.turn_id or "")
    outcome = await turn
    while _pids(marker):
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    assert outcome.status == "cancelled", outcome
    return elapsed


async def _measure(settings: Any, runs: int) -> list[float]:
    times = []
    tag = os.getpid()
    for i in range(runs):
        marker = f"sleep 30.{tag}{i:03d}"
        cmd = f"bash -c '{marker} & {marker}; wait'"
        with FakeModel([[b.function_call("exec_command", {"cmd": cmd}, "call_sleep")], [b.message("x")]]) as fake:
            rt = await Runtime.create(settings.model_copy(update={"openai_base_url": fake.base_url,
                                                                  "openai_api_key": "bench"}), catalog=load_catalog())
            try:
                times.append(await _one(rt, fake, marker))
            finally:
                await rt.aclose()
    return times


def run(out: IO[str] = sys.stdout, runs: int = 20) -> dict[str, Any]:
    with stack(workers=2, concurrency=2) as settings:
        times = asyncio.run(_measure(settings, runs))
    res = {"runs": runs, "p50": median(times), "p95": pct(times, 0.95), "max": max(times)}
    print(f"cancel latency over {runs} turns (cancel() -> processes gone and outputs recorded):", file=out)
    print(f"  p50 {ms(res['p50'])}  p95 {ms(res['p95'])}  max {ms(res['max'])}   (Codex: ~32 ms after SIGINT)",
          file=out)
    return res


if __name__ == "__main__":
    run()
