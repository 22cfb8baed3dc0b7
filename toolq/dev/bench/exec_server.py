"""`toolq bench exec-server [--quick] [--json]`: a real `codex exec` turn whose commands run on an
exec-server (issue 29): through `toolq exec-server` (the fleet: a Redis and worker processes of
this bench's own, toolq's sandbox cell, the ledger) against the same turn through `codex
exec-server` (Codex's own executor, local and unsandboxed), in the same run, round after round
(the order alternates).

The turn: the fake model answers the prompt with 8 parallel `exec_command true` calls, then a
message. The step time is what the model waits between them: from the first request's arrival at
the fake model to the second's (Codex ran the 8 commands through the exec-server and sent their
outputs). Codex runs each command as `bash -lc true`; Codex's executor gets an empty HOME, so that
login shell reads no user profile, as in toolq's cell (this machine's profile runs pyenv's init,
0.8 s a shell). Goal: toolq's p50 at most 1.5x Codex's. Needs Codex 0.171.0 (installed with npm
into ~/.cache/toolq-tests the first time, bench/codex.py) and npm to reach its registry once.

`listening()`, `toolq_argv()` and `codex_argv()` start either exec-server and read the URL it
listens on: the integration tests use them too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from toolq.core import import_path
from toolq.dev.bench import codex as reference
from toolq.dev.bench.harness import goal, median
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel

#: Goal of issue 29: toolq's step at most this many times Codex's own executor's.
GOAL = 1.5
PARALLEL = 8
WORKERS, CONCURRENCY = 2, 8
_URL = re.compile(r"wss?://\S+")


@dataclass(frozen=True)
class Sizes:
    rounds: int = 9
    """Measured rounds, each one turn through each exec-server (after one warm-up turn each)."""


FULL = Sizes()
QUICK = Sizes(rounds=2)


# --- the exec-servers ----------------------------------------------------------------------------------

@dataclass
class Listening:
    """An exec-server this process started, and the URL it said it listens on."""
    url: str
    proc: subprocess.Popen[str]
    log: Path
    lines: list[str]
    """Every stdout line it printed (the first names the URL)."""

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def toolq_argv(*args: str) -> list[str]:
    """`toolq exec-server` on a free loopback port, with `args` (`--workspace DIR`, `--upload DIR`)."""
    return [*import_path.python_argv("-m", "toolq.cli.main"), "exec-server", "--listen", "ws://127.0.0.1:0", *args]


def codex_argv(codex: str) -> list[str]:
    """Codex's own `codex exec-server` on a free loopback port (give it a CODEX_HOME outside /tmp)."""
    return [codex, "exec-server", "--listen", "ws://127.0.0.1:0"]


@contextmanager
def listening(argv: list[str], env: dict[str, str], log: Path, timeout: float = 60) -> Iterator[Listening]:
    """Start an exec-server (in a process group of its own) and wait for the line naming its
    `ws://` URL; stop it (SIGTERM, then SIGKILL, the group it leads) when the block ends. Raises
    RuntimeError, with its log's tail, if it exits or stays silent first."""
    with log.open("w") as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True, cwd=import_path.NEUTRAL_CWD)
    lines: list[str] = []
    said = threading.Event()

    def read() -> None:  # every line, so a chatty server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            said.set()
        said.set()

    threading.Thread(target=read, name="exec-server-stdout", daemon=True).start()
    server = Listening("", proc, log, lines)
    try:
        said.wait(timeout)
        found = _URL.search(lines[0]) if lines else None
        if found is None:
            state = f"exited {proc.poll()}" if proc.poll() is not None else f"said nothing in {timeout:g} s"
            raise RuntimeError(f"{argv[0]} exec-server {state}: {(lines or [''])[0]!r} {server.log_tail()}")
        server.url = found.group(0)
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str], grace: float = 10) -> None:
    """End a process this process started in a group of its own, and that group."""
    if proc.poll() is None:
        with _gone_ok():
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with _gone_ok():
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def _gone_ok() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:
        pass


# --- the fleet -----------------------------------------------------------------------------------------

@contextmanager
def fleet() -> Iterator[tuple[dict[str, str], dict[str, list[int]]]]:
    """A Redis and worker processes of our own (the embedded stack `toolq run` starts): the
    environment a `toolq exec-server` needs to use them, and their pids."""
    from toolq.local.embedded import EmbeddedStack

    with EmbeddedStack(workers=WORKERS, concurrency=CONCURRENCY) as stack:
        redis = [stack.redis.pid] if stack.redis and stack.redis.pid else []
        yield {"REDIS_URL": stack.url, "TOOLQ_SIGNING_KEY": stack.signing_key}, {
            "redis": redis, "workers": [w.pid for w in stack.workers if w.pid]}


def cpu_seconds(roots: list[int]) -> float:
    """CPU time so far of the processes `roots` and all their descendants (the reaped ones' too,
    through their parents' counts)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo += children.get(pid, [])
    return total


# --- the turn ------------------------------------------------------------------------------------------

def script(n: int = PARALLEL) -> list[Any]:
    calls = [b.function_call("exec_command", {"cmd": "true"}, f"call_true{i}") for i in range(n)]
    return [calls, [b.message("done")]]


def outputs(body: dict[str, Any]) -> dict[str, str]:
    """call id -> the tool output text a request carried (what the model saw)."""
    got = {}
    for item in body.get("input") or []:
        if isinstance(item, dict) and str(item.get("type", "")).endswith("_call_output"):
            out = item.get("output")
            got[item["call_id"]] = out if isinstance(out, str) else json.dumps(out)
    return got


def one_turn(cx: reference.Codex, fake: FakeModel, workspace: str) -> float:
    """Run the turn once: the step's seconds. Raises CodexFailed when it went wrong."""
    seen = len(fake.request_times)
    cx.exec(workspace, "go", timeout=120)
    times, bodies = fake.request_times[seen:], fake.requests[seen:]
    if len(times) < 2:
        raise reference.CodexFailed(f"codex exec made {len(times)} model request(s), not 2")
    said = outputs(bodies[1])
    wrong = {k: v for k, v in said.items() if "Process exited with code 0" not in v}
    if len(said) != PARALLEL or wrong:
        raise reference.CodexFailed(f"the {PARALLEL} commands did not all exit 0: {wrong or said}")
    return times[1] - times[0]


def measure(codex: str, work: Path, sizes: Sizes) -> dict[str, Any]:
    workspace = work / "workspace"
    workspace.mkdir()
    samples: dict[str, list[float]] = {"toolq": [], "codex": []}
    cpu = {"toolq": 0.0, "codex": 0.0, "toolq exec-server": 0.0, "redis": 0.0, "workers": 0.0}
    with ExitStack() as stack:
        fleet_env, fleet_pids = stack.enter_context(fleet())
        fake = stack.enter_context(FakeModel(script(), loop=True))
        home = work / "codex-exec-server-home"  # not in the tests' temp dir: Codex makes helpers there
        home.mkdir()
        # Its commands' HOME, empty: `bash -lc` would otherwise run the user's login profile, which
        # toolq's cell does not; like with like.
        bare = work / "bare-home"
        bare.mkdir()
        base = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
        servers = {
            "toolq": stack.enter_context(listening(toolq_argv("--workspace", str(workspace)),
                                                   {**base, **fleet_env}, work / "toolq-exec-server.log")),
            "codex": stack.enter_context(listening(codex_argv(codex), {**base, "CODEX_HOME": str(home),
                                                                       "HOME": str(bare)},
                                                   work / "codex-exec-server.log")),
        }
        clients = {name: stack.enter_context(reference.codex(codex, fake.base_url, sandboxed=False,
                                                             env={"CODEX_EXEC_SERVER_URL": s.url}))
                   for name, s in servers.items()}
        for name in samples:  # warm-up: the first turn on each server pays its start-up
            one_turn(clients[name], fake, str(workspace))
        # The CPU each side spends on a turn: its exec-server and what it started (toolq: the
        # embedded Redis and workers too, their session hosts and the commands); Codex's CLI is the
        # same on both sides and not counted.
        parts = {"toolq exec-server": [servers["toolq"].proc.pid], **fleet_pids}
        roots = {"toolq": parts, "codex": {"codex": [servers["codex"].proc.pid]}}
        for k in range(sizes.rounds):
            for name in (("toolq", "codex") if k % 2 == 0 else ("codex", "toolq")):
                before = {part: cpu_seconds(pids) for part, pids in roots[name].items()}
                samples[name].append(one_turn(clients[name], fake, str(workspace)))
                for part, pids in roots[name].items():
                    cpu[part] += cpu_seconds(pids) - before[part]
        cpu["toolq"] = sum(cpu[part] for part in parts)
    p50 = {name: median(xs) for name, xs in samples.items()}
    return {**{name: {"p50": p50[name], "samples": samples[name], "cpu_per_turn": cpu[name] / sizes.rounds}
               for name in samples},
            "toolq_cpu_per_turn": {part: cpu[part] / sizes.rounds for part in parts},
            "ratio": p50["toolq"] / p50["codex"], "goal_met": goal(p50["toolq"] / p50["codex"], GOAL)[0]}


def run(out: IO[str] = sys.stdout, quick: bool = False, as_json: bool = False) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    res: dict[str, Any] = {"quick": quick, "sizes": asdict(sizes), "parallel": PARALLEL, "cpus": os.cpu_count(),
                           "load": os.getloadavg()[0], "failed": []}
    try:
        res["codex_path"] = codex = reference.binary() or reference.install()
        parent = Path.home() / ".cache" / "toolq-bench"  # Codex refuses helper binaries under the temp dir
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="exec-server-", dir=parent) as tmp:
            started = time.monotonic()
            res.update(measure(codex, Path(tmp), sizes))
            res["wall_s"] = time.monotonic() - started
    except (reference.CodexFailed, RuntimeError, OSError, subprocess.SubprocessError) as e:
        res["failed"].append(" ".join(f"{type(e).__name__}: {e}".split())[:800])
    if as_json:
        print(json.dumps(res, indent=2), file=out)
    else:
        print("\n".join(report(res)), file=out)
    return res


def report(res: dict[str, Any]) -> list[str]:
    head = (f"a codex exec turn of {res['parallel']} parallel `exec_command true`, step time (the model's "
            f"wait for the {res['parallel']} outputs), {res['cpus']} CPUs, load {res['load']:.1f}"
            + (" (--quick)" if res["quick"] else ""))
    if res["failed"]:
        return [head, *(f"  FAILED: {why}" for why in res["failed"])]
    t, c = res["toolq"], res["codex"]
    n = res["sizes"]["rounds"]
    return [head,
            f"  codex exec-server (Codex's own, local) : p50 {c['p50'] * 1000:.0f} ms  (n={n}); CPU "
            f"{c['cpu_per_turn'] * 1000:.0f} ms a turn (the server and its commands)",
            f"  toolq exec-server (fleet, {WORKERS} workers x {CONCURRENCY}) : p50 {t['p50'] * 1000:.0f} ms  (n={n}); "
            f"CPU {t['cpu_per_turn'] * 1000:.0f} ms a turn ("
            + ", ".join(f"{part} {v * 1000:.0f}" for part, v in res["toolq_cpu_per_turn"].items())
            + "; the workers' count holds their session hosts and the commands)",
            f"  ratio {res['ratio']:.2f}x  ({goal(res['ratio'], GOAL)[1]})"]
