"""Benchmark: what signed messages cost per call, against JSON-encoding the same messages.

Per call, what a call does: the orchestrator signs the invocation and the worker checks it; the
worker's backend seals two metas (STARTED, then SUCCESS) and the orchestrator checks both. The
baseline, in the same run, is one `json.dumps` of the same invocation and metas, which every
call pays already (kombu encodes each of them). Result sizes: a short output, and outputs near
the truncation policy's size.
Each figure is the median of `repeats` timings of `loops` calls, in microseconds per call.
"""

from __future__ import annotations

import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from toolq.core.contracts import TASK
from toolq.core.signing import Signer

TASK_ID = "turn-bench:0:0:0123456789ab"


def _invocation() -> dict[str, Any]:
    return {"turn_id": "turn-bench", "step": 0, "output_index": 0, "call_id": "call_" + "x" * 24,
            "tool_name": {"namespace": None, "name": "exec_command"},
            "payload": {"kind": "function",
                        "arguments": json.dumps({"cmd": "ls -la src && git status", "yield_time_ms": 10000})},
            "deadline": time.time() + 3600, "workspace": "/workspace/project", "spec_digest": "0123456789abcdef"}


STARTED: dict[str, Any] = {"status": "STARTED", "task_id": TASK_ID, "traceback": None, "children": [],
                           "date_done": None, "result": {"pid": 4242, "hostname": "worker@host"}}


def _meta(output_chars: int) -> dict[str, Any]:
    return {"status": "SUCCESS", "task_id": TASK_ID, "traceback": None, "children": [],
            "date_done": "2026-12-01T10:00:00.000000+00:00",
            "result": {"call_id": "call_" + "x" * 24, "output": "y" * output_chars, "status": "completed",
                       "success": True, "exit_code": 0, "started_at": 1764583200.123, "finished_at": 1764583200.456,
                       "worker": "worker@host", "tools": None}}


def _per_call_us(fn: Callable[[], Any], loops: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        times.append((time.perf_counter() - t0) / loops)
    return statistics.median(times) * 1e6


def run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (100, 16_000, 64_000), loops: int = 2000,
        repeats: int = 7) -> dict[int, dict[str, float]]:
    signer = Signer(secrets.token_hex(32))
    inv = _invocation()
    results: dict[int, dict[str, float]] = {}
    print(f"signing: HMAC-SHA256 per call (sign + check the invocation, seal + check 2 metas), "
          f"median of {repeats} x {loops} calls", file=out)
    print(f"  {'output':>10}  {'signed':>10}  {'json baseline':>14}  {'ratio':>6}", file=out)
    for size in sizes:
        metas = [STARTED, _meta(size)]

        def signed() -> None:
            sig = signer.sign_invocation(TASK, TASK_ID, inv)
            assert signer.invocation_refusal(TASK, TASK_ID, inv, sig) is None
            for meta in metas:  # noqa: B023 - called within this iteration
                assert signer.meta_refusal(TASK_ID, signer.seal_meta(meta)) is None

        def baseline() -> None:
            json.dumps(inv)
            for meta in metas:  # noqa: B023 - called within this iteration
                json.dumps(meta)

        n = max(loops * 100 // max(size, 100), 50)  # fewer loops for big outputs, same wall time
        res = {"signed_us": _per_call_us(signed, n, repeats), "json_us": _per_call_us(baseline, n, repeats)}
        res["ratio"] = res["signed_us"] / res["json_us"]
        results[size] = res
        print(f"  {size:>8} B  {res['signed_us']:>7.1f} µs  {res['json_us']:>11.1f} µs  {res['ratio']:>6.2f}", file=out)
    return results


if __name__ == "__main__":
    run()
