"""Benchmark: time per model step (request k -> request k+1 at the fake server) with N parallel
`exec_command` calls of `true`, the figure the reference Codex CLI was measured on.

Steady state, as for Codex (docs/reference/codex-behaviour.md#timing): a warm-up step first, then the median of
the following steps. Our fake server runs in its own process (`toolq fake-model`) and reports each
request's arrival on the system-wide monotonic clock. With Codex installed (`bench/codex.py`) it
runs the same steps in the same run, twice: in its own sandbox, against toolq's default sandbox,
and unsandboxed (`--dangerously-bypass-approvals-and-sandbox`, as the reference measured it),
against toolq's workers with TOOLQ_SANDBOX=none. Without it, the reference's fixed figures (59 /
111 / 322 ms for N = 1 / 8 / 32, unsandboxed, on this kind of machine) stand in.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

from toolq.core import import_path
from toolq.core.settings import Settings
from toolq.dev.bench import codex as reference
from toolq.dev.bench.harness import environment, goal, median, ms, pct, stack
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.turn import Runtime, Session
from toolq.orchestrator.turn_events import Emit, ignore
from toolq.workers import isolation
from toolq.workers.loader import load_catalog

CODEX_MS = {1: 59, 8: 111, 32: 322}
#: 32: issue 14's fan-out goal (the original design asked 0.5x).
GOAL = {1: 1.0, 8: 0.5, 32: 0.35}


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
            server = subprocess.Popen([*import_path.python_argv("-m", "toolq.cli.main"), "fake-model",
                                       "--script", str(path)],
                                      stdout=subprocess.PIPE, stderr=err, text=True,
                                      cwd=import_path.NEUTRAL_CWD)
            try:
                assert server.stdout is not None
                asyncio.run(_turn(settings, server.stdout.readline().strip(), emit))
            finally:
                server.terminate()
                server.wait(timeout=10)
        return [float(m) for m in re.findall(r"^request \d+: .* at ([0-9.]+)$", log.read_text(), re.M)]


def step_times(settings: Any, n: int, steps: int, emit: Emit = ignore) -> dict[str, Any]:
    """p50 and p90 of the time per step with `n` parallel `exec_command true`, after a warm-up step
    (`emit`: who watches the turn; nobody by default)."""
    return _per_step(_request_times(settings, script(n, steps), emit))


def _per_step(t: list[float]) -> dict[str, Any]:
    per_step = [t[k + 1] - t[k] for k in range(1, len(t) - 1)]  # skip the warm-up step
    return {"p50": median(per_step), "p90": pct(per_step, 0.9), "samples": per_step}


def codex_step_times(path: str, n: int, steps: int, *, sandboxed: bool) -> dict[str, Any]:
    """The same steps through `codex exec`, after the reference's warm-up step, or why it could
    not run them here: every call must have run, and every step been one request (a sandbox that
    cannot start, or a retried request, would make the baseline meaningless). Its fake model runs
    in this process, idle while Codex runs; ours in a process of its own, as toolq's turn runs here."""
    warm_up = [b.function_call("exec_command", {"cmd": reference.WARM_UP_CMD}, "warm_up")]
    try:
        with FakeModel([warm_up, *script(n, steps)[1:]]) as fake, tempfile.TemporaryDirectory() as ws, \
                reference.codex(path, fake.base_url, sandboxed=sandboxed) as cx:
            cx.exec(ws, "bench")
    except reference.CodexFailed as e:
        return {"failed": str(e)}
    outputs = [i.get("output", "") for i in fake.requests[-1]["input"] if i.get("type") == "function_call_output"]
    ran = sum("Process exited with code 0" in o for o in outputs)
    if ran != 1 + n * steps or len(fake.request_times) != steps + 2:
        bad = next((o for o in outputs if "Process exited with code 0" not in o), "")
        return {"failed": f"{ran} of {1 + n * steps} calls ran in {len(fake.request_times)} requests "
                          f"({steps + 2} expected) {bad[:200]!r}"}
    return _per_step(fake.request_times)


def run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (1, 8, 32), steps: int = 10, *,
        telemetry_rounds: int = 4) -> dict[Any, Any]:
    """With Codex: toolq as configured against Codex sandboxed as toolq is, and, when toolq's own
    workers are sandboxed and ours to start (embedded), both unsandboxed too. Then the telemetry
    comparison (`telemetry_run`; `telemetry_rounds=0` skips it), under results["telemetry"]."""
    results: dict[Any, Any] = {}
    path = reference.binary()
    external = bool(Settings.load().redis_url)
    sandbox = "the fleet's" if external else isolation.current().backend
    with ExitStack() as stacks:
        settings = stacks.enter_context(stack(workers=2, concurrency=8))
        unsandboxed = None
        if path and not external and sandbox != "none":
            with environment({"TOOLQ_SANDBOX": "none"}):  # read by the workers when they start
                unsandboxed = stacks.enter_context(stack(workers=2, concurrency=8))
        for n in sizes:
            results[n] = step_times(settings, n, steps)
            if path:
                results[n]["codex"] = codex_step_times(path, n, steps, sandboxed=sandbox != "none")
            if unsandboxed is not None and path:
                results[n]["unsandboxed"] = {"toolq": step_times(unsandboxed, n, steps),
                                             "codex": codex_step_times(path, n, steps, sandboxed=False)}
    print("\n".join(report(results, steps, path, sandbox)), file=out)
    if telemetry_rounds and telemetry_installed(out):
        results["telemetry"] = telemetry_run(out, sizes, steps, telemetry_rounds)
    return results


def telemetry_installed(out: IO[str]) -> bool:
    """Whether the `otel` extra is here (the comparison traces over OTLP); if not, one line says so."""
    try:
        found = all(importlib.util.find_spec(m) for m in ("opentelemetry.sdk", "opentelemetry.proto"))
    except ImportError:  # no `opentelemetry` package at all
        found = False
    if not found:
        print("telemetry comparison skipped: it needs the OpenTelemetry SDK (pip install 'toolq[otel]')", file=out)
    return found


# --- telemetry on against off (issue 30) ---------------------------------------------------------

#: The stacks' shape (`stack`'s arguments), as the other step figures are measured.
STACK: dict[str, Any] = {"workers": 2, "concurrency": 8}
#: Tracing (to a loopback OTLP receiver) and metrics (served, scraped by nobody) on: at most this
#: times the step time with both off.
TELEMETRY_GOAL = 1.05


def telemetry_env(sink: Any) -> dict[str, str]:
    """What turns traces and metrics on in a process started with it (workers) or in this one."""
    # The SDK's default export delay (5 s), as a deployment has it, not the sink's short one for tests.
    return {"OTEL_TRACES_EXPORTER": "otlp", **sink.env(), "OTEL_BSP_SCHEDULE_DELAY": "5000", "TOOLQ_METRICS_PORT": "0"}


@contextmanager
def telemetry_stacks(**shape: Any) -> Iterator[tuple[Settings, Settings, Any]]:
    """Two embedded stacks of the same shape, one started with tracing (to a loopback OTLP sink) and
    metrics on in its workers, one with both off, and the sink. With REDIS_URL set both are that
    fleet, and only this process's telemetry changes."""
    from toolq.dev.otlp_sink import SinkProcess

    with ExitStack() as stacks:
        sink = stacks.enter_context(SinkProcess())  # a process of its own, as a collector is
        with environment({"OTEL_TRACES_EXPORTER": "none"}):
            off = stacks.enter_context(stack(**(shape or STACK)))
        with environment(telemetry_env(sink)):
            on = stacks.enter_context(stack(**(shape or STACK)))
        yield off.model_copy(update={"metrics_port": None}), on.model_copy(update={"metrics_port": 0}), sink


@contextmanager
def orchestrator_telemetry(on: bool, sink: Any) -> Iterator[None]:
    """This process's tracing and metrics on (to `sink`, on a free port) or off for the block."""
    from toolq.telemetry import metrics, tracing

    with environment(telemetry_env(sink) if on else {"OTEL_TRACES_EXPORTER": "none"}):
        tracing.reset_for_tests()  # set up again from the variables at the next step
        metrics.stop()
        if on:
            metrics.serve_orchestrator(0, host="127.0.0.1")
        try:
            yield
        finally:
            tracing.flush()
            tracing.reset_for_tests()
            metrics.stop()


def telemetry_run(out: IO[str] = sys.stdout, sizes: tuple[int, ...] = (1, 8, 32), steps: int = 10,
                  rounds: int = 4) -> dict[str, Any]:
    """The step time with tracing and metrics on (orchestrator and workers; spans exported over
    OTLP/HTTP to a loopback receiver, /metrics served) against both off, in interleaved rounds, each
    mode first in every other one."""
    samples: dict[tuple[bool, int], list[float]] = {(m, n): [] for m in (True, False) for n in sizes}
    with telemetry_stacks() as (off, on, sink):
        for k in range(rounds):
            for n in sizes:
                for mode in ((True, False) if k % 2 == 0 else (False, True)):
                    with orchestrator_telemetry(mode, sink):
                        samples[mode, n] += step_times(on if mode else off, n, steps)["samples"]
        spans = sink.counts()["spans"]
    results: dict[str, Any] = {"spans": spans}
    print(f"time per model step, telemetry on (traces over OTLP to a loopback receiver, {spans} spans; metrics "
          f"served) vs off, p50 of {rounds}x{steps} interleaved steps:", file=out)
    for n in sizes:
        with_, without = median(samples[True, n]), median(samples[False, n])
        met, note = goal(with_ / without, TELEMETRY_GOAL)
        results[str(n)] = {"on": with_, "off": without, "ratio": with_ / without, "goal_met": met}
        print(f"  {n:>2} parallel exec_command: on {ms(with_)}  off {ms(without)}  = {with_ / without:.3f}x ({note})",
              file=out)
    results["goal_met"] = all(r["goal_met"] for k, r in results.items() if k not in ("spans", "goal_met"))
    return results


def report(results: dict[int, Any], steps: int, codex_path: str | None = None, sandbox: str = "") -> list[str]:
    """The printout: each size's ratio to Codex (measured in the same run if installed, else its
    fixed figures at the sizes the reference measured), and whether it met its goal."""
    lines = [f"time per model step, {steps} steps after a warm-up (2 workers x 8 pool processes, "
             f"sandbox {sandbox or '?'}), against {reference.describe(codex_path)}:"]
    for n, r in results.items():
        line = f"  {n:>2} parallel exec_command: p50 {ms(r['p50'])}  p90 {ms(r['p90'])}"
        if "codex" in r:
            codex = "Codex unsandboxed" if sandbox == "none" else "Codex in its sandbox"
            line += _versus(r, r["codex"], GOAL.get(n), codex)
            if "unsandboxed" in r:
                pair = r["unsandboxed"]
                line += (f"; unsandboxed {ms(pair['toolq']['p50'])}"
                         + _versus(pair, pair["codex"], GOAL.get(n), "Codex unsandboxed", toolq=pair["toolq"]))
        elif n in CODEX_MS:
            line += _versus(r, {"p50": CODEX_MS[n] / 1000}, GOAL[n], "Codex's fixed")
        lines.append(line)
    return lines


def _versus(r: dict[str, Any], codex: dict[str, Any], limit: float | None, label: str,
            toolq: dict[str, Any] | None = None) -> str:
    """The ratio to Codex's p50 (kept in `r`, with whether it met `limit`), as the line says it."""
    if "failed" in codex:
        return f"  ({label}: could not run here: {codex['failed']})"
    r["ratio_vs_codex"] = (toolq or r)["p50"] / codex["p50"]
    text = f"  = {r['ratio_vs_codex']:.2f}x {label} {codex['p50'] * 1000:.0f} ms"
    if limit is None:
        return text
    r["goal_met"], note = goal(r["ratio_vs_codex"], limit)
    return f"{text} ({note})"


if __name__ == "__main__":
    run()
