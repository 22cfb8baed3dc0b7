"""`toolq bench envs [--quick] [--json]`: environments on a worker host (issue 28), on a Redis and
worker processes of its own.

One host (2 `toolq worker` processes x 4 pool children sharing `TOOLQ_HOST_ID` and
`TOOLQ_ENV_ROOT`), driven from this process through `Fleet.environments` and `Fleet.run_calls`:
- create an environment from a base the host has cached: p50 and p99 (goal p50 <= 50 ms);
- a cold base, a generated git repository (100 MB, 10,000 files): upload (pack and put in the
  store) + create (fetch, unpack, mount) + one `exec_command`, the time to the first command;
- checkpoint after a one-file change in that repository (goal p50 <= 100 ms);
- fork 16 from that checkpoint, all made (goal <= 0.5 s);
- 32 conversations at once, each in its own environment, each step 4 `read_file` calls, against the
  same load on the shared workspace: calls/s ratio (goal >= 0.9x);
- 256 environments alive on the host: made, each checked on disk, then destroyed.
The host mounts overlays (as root in the machine's namespace; as another user in the host's own,
`toolq/workers/environments/namespace.py`); the same figures are then taken again on a host whose
root has a `:` in its path, where overlayfs cannot take the options (the host's own check), so it
copies the base: copy mode, as a worker that cannot mount runs. Floors beside them: a Redis round
trip, and as root a bare `mount -t overlay` with its mkdirs, and its `umount`.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

from toolq.core.items import FunctionCallItem
from toolq.core.settings import Settings
from toolq.dev.bench.harness import median, pct

#: Goals of issue 28.
CREATE_GOAL_S = 0.050
CHECKPOINT_GOAL_S = 0.100
FORK_GOAL_S = 0.5
RATE_GOAL = 0.9
CALLS_PER_STEP = 4
WORKERS, CONCURRENCY = 2, 4


@dataclass(frozen=True)
class Sizes:
    repo_files: int = 10_000
    repo_mb: int = 100
    creates: int = 40
    """Samples of a create from a cached base."""
    checkpoints: int = 7
    fork: int = 16
    conversations: int = 32
    steps: int = 6
    rounds: int = 3
    """Rounds of the conversations' load, shared workspace then environments: the ratio is the median
    of each round's (the machine's load changes between rounds more than within one)."""
    alive: int = 256
    small_files: int = 50
    """The small project the conversations and the alive environments are made from."""


FULL = Sizes()
QUICK = Sizes(repo_files=200, repo_mb=2, creates=5, checkpoints=2, fork=4, conversations=4, steps=2, rounds=1, alive=8)


# --- the repository ----------------------------------------------------------------------------------

def make_repo(top: Path, files: int, total_mb: int) -> Path:
    """A git checkout of `files` text files (100 per folder) of `total_mb` MB in all, committed."""
    repo = top / "repo"
    repo.mkdir()
    per = max(1, total_mb * 1024 * 1024 // files)
    for i in range(files):
        d = repo / f"pkg{i // 100:03d}"
        if i % 100 == 0:
            d.mkdir()
        raw = os.urandom(per // 2 + 1).hex()[:per]
        (d / f"mod{i:05d}.py").write_text("\n".join(raw[k:k + 79] for k in range(0, len(raw), 80)) + "\n")
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@toolq", "-c", "core.hooksPath=/dev/null"]
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-q", "-m", "generated"], check=True)
    return repo


def make_small(top: Path, files: int) -> Path:
    small = top / "small"
    small.mkdir()
    for i in range(files):
        (small / f"f{i:03d}.txt").write_text(f"line {i}\n" * 40)
    return small


# --- the host ------------------------------------------------------------------------------------------

@dataclass
class Host:
    settings: Settings
    root: Path
    workers: list[Any]


@contextmanager
def host(work: Path, mode: str) -> Iterator[Host]:
    """A Redis and one host's workers. `copy`: a root overlayfs cannot name (a `:` in its path)."""
    from toolq.local.embedded import RedisServer, WorkerProcess

    root = work / ("root-overlay" if mode == "overlay" else "root:copy")
    key = secrets.token_hex(32)
    shared = work / f"shared-{mode}"
    shared.mkdir()
    with RedisServer() as redis_server:
        env = {"TOOLQ_SIGNING_KEY": key, "TOOLQ_HOST_ID": f"bench-{mode}", "TOOLQ_ENV_ROOT": str(root)}
        workers = [WorkerProcess(redis_server.url, queues=["toolq"], concurrency=CONCURRENCY, env=env,
                                 logdir=work, name=f"envs-{mode}{i}@bench") for i in range(WORKERS)]
        try:
            for w in workers:
                w.start(wait=False)
            for w in workers:
                w.wait_ready(timeout=120)
            settings = Settings(redis_url=redis_server.url, signing_key=key, workspace=shared, tools=[],
                                openai_api_key="bench")
            yield Host(settings, root, workers)
        finally:
            for w in workers:
                w.stop(grace=5)
            unmount_under(root)


def unmount_under(top: Path) -> None:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(f"{top}/")), reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


# --- the figures ---------------------------------------------------------------------------------------

def _call(name: str, args: dict[str, Any], call_id: str) -> FunctionCallItem:
    return FunctionCallItem(call_id=call_id, name=name, arguments=json.dumps(args))


async def _wait_host(fleet: Any, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while not (hosts := await fleet.environments.hosts()):
        if time.monotonic() > end:
            raise RuntimeError(f"no host advertised environments within {timeout:g} s")
        await asyncio.sleep(0.2)
    return str(hosts[0].mode)


def _on_disk(h: Host, ids: list[str], mode: str) -> int:
    """How many of `ids` are whole on the host: mounted (overlay) or a tree (copy), env.json written.
    The mounts as the workers see them: an unprivileged host's are in its namespace only."""
    root = h.root
    with open(f"/proc/{h.workers[0].pid}/mountinfo") as f:
        points = {line.split()[4] for line in f}
    whole = 0
    for i in ids:
        d = root / "envs" / i
        there = str(d / "merged") in points if mode == "overlay" else (d / "tree").is_dir()
        whole += there and (d / "env.json").exists()
    return whole


async def measure(h: Host, repo: Path, small: Path, sizes: Sizes) -> dict[str, Any]:
    from toolq.orchestrator.environments import Environments
    from toolq.orchestrator.fleet import Fleet, new_turn_id
    from toolq.workers.loader import load_catalog

    res: dict[str, Any] = {}
    fleet = await Fleet.open(h.settings, catalog=load_catalog([]), read_fleet_tools=False)
    envs: Environments = fleet.environments
    r = fleet.ledger.r
    owner = "toolq:bench-envs:owner"
    await r.set(owner, "1")
    try:
        res["mode"] = await _wait_host(fleet)

        async def first_output(env: Any, cmd: str) -> str:
            out = await fleet.run_calls([_call("exec_command", {"cmd": cmd, "yield_time_ms": 10000}, "c1")],
                                        new_turn_id(), environment=env)
            return str(out[0].get("output"))

        # Cold base: upload, create (fetch, unpack, mount), one command.
        t0 = time.perf_counter()
        up = await envs.upload(repo)
        t1 = time.perf_counter()
        env = await envs.create(up.source, owner=owner)
        t2 = time.perf_counter()
        out = await first_output(env, "ls pkg000 | wc -l")
        t3 = time.perf_counter()
        if "100" not in out and str(min(100, sizes.repo_files)) not in out:
            raise RuntimeError(f"the first command did not see the repository: {out[:200]}")
        res["cold"] = {"upload": t1 - t0, "create": t2 - t1, "exec": t3 - t2, "total": t3 - t0}

        # Creates from the cached base (each destroyed before the next: the host's count stays put).
        samples = []
        for _ in range(sizes.creates):
            t = time.perf_counter()
            made = await envs.create(up.source, owner=owner)
            samples.append(time.perf_counter() - t)
            await envs.destroy(made.id)
        res["create"] = {"p50": median(samples), "p99": pct(samples, 0.99), "n": len(samples)}

        # Checkpoint after a one-file change in the repository.
        samples = []
        for k in range(sizes.checkpoints):
            await first_output(env, f"echo change {k} >> pkg001/mod00100.py")
            t = time.perf_counter()
            diff = await envs.checkpoint(env)
            samples.append(time.perf_counter() - t)
            if "pkg001/mod00100.py" not in diff.patch:
                raise RuntimeError("the checkpoint's diff does not name the changed file")
        res["checkpoint"] = {"p50": median(samples), "p99": pct(samples, 0.99), "n": len(samples)}
        checkpoint = env.checkpoint
        assert checkpoint is not None

        # Fork N from that checkpoint.
        t = time.perf_counter()
        forks = await envs.fork(checkpoint, sizes.fork, owner=owner)
        res["fork"] = {"n": sizes.fork, "total": time.perf_counter() - t}
        if _on_disk(h, [f.id for f in forks], res["mode"]) != sizes.fork:
            raise RuntimeError("a forked environment is not whole on the host")
        await asyncio.gather(*(envs.destroy(f.id) for f in forks))
        await envs.destroy(env.id)

        # Conversations: each in its own environment, against the shared workspace.
        small_up = await envs.upload(small)
        shutil.copytree(small, h.settings.workspace, dirs_exist_ok=True)
        convs = await asyncio.gather(*(envs.create(small_up.source, owner=owner)
                                       for _ in range(sizes.conversations)))

        async def load(env_of: list[Any]) -> float:
            async def conversation(env: Any) -> None:
                turn = new_turn_id()
                for s in range(sizes.steps):
                    items = [_call("read_file", {"file_path": f"f{(s * CALLS_PER_STEP + i) % sizes.small_files:03d}"
                                                              ".txt", "limit": 5}, f"c{s}_{i}")
                             for i in range(CALLS_PER_STEP)]
                    outs = await fleet.run_calls(items, turn, environment=env)
                    bad = [o for o in outs if "line" not in str(o.get("output"))]
                    if bad:
                        raise RuntimeError(f"a read_file call failed: {str(bad[0])[:300]}")
                await fleet.end_turn(turn)

            t = time.perf_counter()
            await asyncio.gather(*(conversation(e) for e in env_of))
            return len(env_of) * sizes.steps * CALLS_PER_STEP / (time.perf_counter() - t)

        shared_rates, env_rates = [], []
        for _ in range(sizes.rounds):  # alternated, so both see the same machine; each round's pair a ratio
            shared_rates.append(await load([None] * sizes.conversations))
            env_rates.append(await load(list(convs)))
        res["conversations"] = {"n": sizes.conversations, "steps": sizes.steps, "rounds": sizes.rounds,
                                "shared_calls_per_s": median(shared_rates), "env_calls_per_s": median(env_rates),
                                "ratio": median([e / s for e, s in zip(env_rates, shared_rates, strict=True)]),
                                "ratios": [e / s for e, s in zip(env_rates, shared_rates, strict=True)]}
        await asyncio.gather(*(envs.destroy(c.id) for c in convs))

        # N alive on one host.
        gate = asyncio.Semaphore(64)  # a connection per request waiting on its reply

        async def one(op: Any) -> Any:
            async with gate:
                return await op

        t = time.perf_counter()
        alive = await asyncio.gather(*(one(envs.create(small_up.source, owner=owner)) for _ in range(sizes.alive)))
        made_s = time.perf_counter() - t
        records = {e.id: e for e in await envs.records()}
        ready = sum(records.get(e.id) is not None and records[e.id].state == "ready" for e in alive)
        whole = _on_disk(h, [e.id for e in alive], res["mode"])
        probe = await first_output(alive[-1], "cat f000.txt | head -1")
        t = time.perf_counter()
        await asyncio.gather(*(one(envs.destroy(e.id)) for e in alive))
        res["alive"] = {"n": sizes.alive, "create": made_s, "ready": ready, "on_disk": whole,
                        "call_ok": "line 0" in probe, "destroy": time.perf_counter() - t,
                        "left_on_disk": _on_disk(h, [e.id for e in alive], res["mode"])}

        await floors(res, r, h, up.source.blob)
    finally:
        await r.delete(owner)
        await fleet.aclose()
    return res


async def floors(res: dict[str, Any], r: Any, h: Host, repo_base: str | None) -> None:
    """A Redis round trip from here; in copy mode, what copying the repository's base costs."""
    samples = []
    for _ in range(50):
        t = time.perf_counter()
        await r.ping()
        samples.append(time.perf_counter() - t)
    res["floor_redis_rtt"] = median(samples)
    if res["mode"] == "copy" and repo_base:
        res["floor_copy"] = await asyncio.to_thread(copy_floor, h.root / "bases" / repo_base / "tree", h.root / "tmp")


def copy_floor(tree: Path, scratch: Path) -> dict[str, float]:
    """What copy mode cannot go under for this base: `cp -a` of its tree (a create), and a walk
    that lstats every file without reading one (the least a checkpoint of a copy must do)."""
    dest = scratch / "floor-copy"
    t = time.perf_counter()
    subprocess.run(["cp", "-a", str(tree), str(dest)], check=True)
    copied = time.perf_counter() - t
    t = time.perf_counter()
    for here, _dirs, files in os.walk(dest):
        for name in files:
            os.lstat(os.path.join(here, name))
    walked = time.perf_counter() - t
    shutil.rmtree(dest)
    return {"cp_a": copied, "walk_lstat": walked}


def mount_floor(work: Path, n: int = 15) -> dict[str, float] | None:
    """A bare overlay as the host makes one: mkdir upper/work/merged, `mount -t overlay` (the
    command), and its umount; median seconds. None where this process may not mount."""
    lower = work / "floor-lower"
    lower.mkdir(exist_ok=True)
    mk, mount, umount = [], [], []
    for i in range(n):
        d = work / f"floor-{i}"
        t = time.perf_counter()
        d.mkdir()
        for sub in ("upper", "work", "merged"):
            (d / sub).mkdir()
        t1 = time.perf_counter()
        done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                               f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'}", str(d / "merged")],
                              capture_output=True)
        t2 = time.perf_counter()
        if done.returncode != 0:
            shutil.rmtree(d, ignore_errors=True)
            return None
        subprocess.run(["umount", str(d / "merged")], check=True)
        t3 = time.perf_counter()
        shutil.rmtree(d)
        mk.append(t1 - t)
        mount.append(t2 - t1)
        umount.append(t3 - t2)
    return {"mkdirs": median(mk), "mount": median(mount), "umount": median(umount)}


# --- the bench -----------------------------------------------------------------------------------------

def run(out: IO[str] = sys.stdout, quick: bool = False, as_json: bool = False) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    res: dict[str, Any] = {"quick": quick, "sizes": asdict(sizes), "runs": {}, "cpus": os.cpu_count(),
                           "load": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="toolq-bench-envs-") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        repo = make_repo(work, sizes.repo_files, sizes.repo_mb)
        small = make_small(work, sizes.small_files)
        res["repo_generated_s"] = time.perf_counter() - t
        modes = ["overlay", "copy"]
        for mode in modes:
            # Copy mode copies the repository at each create: fewer creates, the same other figures.
            mode_sizes = sizes if mode == "overlay" else replace(sizes, creates=max(3, sizes.creates // 4))
            try:
                with host(work, mode) as h:
                    got = asyncio.run(measure(h, repo, small, mode_sizes))
                if got["mode"] != mode:
                    got["note"] = f"asked for {mode}, the host chose {got['mode']}"
                res["runs"][mode] = got
            except Exception as e:  # the other mode still runs; the report names what broke
                res["runs"][mode] = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:500]}
        if os.geteuid() == 0:
            res["floor_mount"] = mount_floor(work)
    verdicts(res)
    if as_json:
        print(json.dumps(res, indent=2), file=out)
    else:
        print("\n".join(report(res)), file=out)
    return res


def verdicts(res: dict[str, Any]) -> None:
    """Each goal's verdict, in each mode's figures (the JSON carries them as the printout does)."""
    res["failed"] = sorted(mode for mode, got in res["runs"].items() if "error" in got)
    for got in res["runs"].values():
        if "error" in got:
            continue
        got["create"]["goal_met"] = got["create"]["p50"] <= CREATE_GOAL_S
        got["checkpoint"]["goal_met"] = got["checkpoint"]["p50"] <= CHECKPOINT_GOAL_S
        got["fork"]["goal_met"] = got["fork"]["total"] <= FORK_GOAL_S
        got["conversations"]["goal_met"] = got["conversations"]["ratio"] >= RATE_GOAL
        a = got["alive"]
        a["goal_met"] = a["ready"] == a["n"] and a["on_disk"] == a["n"] and a["call_ok"] and not a["left_on_disk"]


def _v(met: bool) -> str:
    return "met" if met else "MISSED"


def report(res: dict[str, Any]) -> list[str]:
    s = res["sizes"]
    lines = [f"environments on one host ({WORKERS} workers x {CONCURRENCY}), {res['cpus']} CPUs, load "
             f"{res['load']:.1f}; repository {s['repo_mb']} MB, {s['repo_files']} files"
             + (" (--quick)" if res["quick"] else "")]
    for mode, got in res["runs"].items():
        if "error" in got:
            lines.append(f"  [{mode}] FAILED: {got['error']}")
            continue
        c, cold, cp, fk, cv, a = (got[k] for k in ("create", "cold", "checkpoint", "fork", "conversations", "alive"))
        lines += [
            f"  [{mode}]" + (f" ({got['note']})" if "note" in got else ""),
            f"    create from a cached base : p50 {c['p50'] * 1000:.1f} ms  p99 {c['p99'] * 1000:.1f} ms "
            f"(n={c['n']})  (goal p50 <= {CREATE_GOAL_S * 1000:g} ms: {_v(c['goal_met'])})",
            f"    cold base, first command  : {cold['total']:.2f} s  (upload {cold['upload']:.2f} s + create "
            f"{cold['create']:.2f} s + exec_command {cold['exec']:.2f} s)",
            f"    checkpoint, 1 file changed: p50 {cp['p50'] * 1000:.1f} ms  p99 {cp['p99'] * 1000:.1f} ms "
            f"(n={cp['n']})  (goal p50 <= {CHECKPOINT_GOAL_S * 1000:g} ms: {_v(cp['goal_met'])})",
            f"    fork {fk['n']} from a checkpoint  : {fk['total']:.3f} s  "
            f"(goal <= {FORK_GOAL_S:g} s: {_v(fk['goal_met'])})",
            f"    {cv['n']} conversations x {CALLS_PER_STEP} calls/step: own environments {cv['env_calls_per_s']:.0f} "
            f"calls/s, shared workspace {cv['shared_calls_per_s']:.0f} calls/s = {cv['ratio']:.2f}x (median of "
            f"{', '.join(f'{x:.2f}' for x in cv['ratios'])})  "
            f"(goal >= {RATE_GOAL:g}x: {_v(cv['goal_met'])})",
            f"    {a['n']} alive on one host  : made in {a['create']:.2f} s, {a['ready']} ready, {a['on_disk']} whole "
            f"on disk, a call in the last {'ran' if a['call_ok'] else 'FAILED'}; destroyed in {a['destroy']:.2f} s, "
            f"{a['left_on_disk']} left  ({_v(a['goal_met'])})",
            f"    floor: a Redis round trip {got['floor_redis_rtt'] * 1000:.2f} ms",
        ]
        if "floor_copy" in got:
            lines.append(f"    floor: `cp -a` of the repository's base {got['floor_copy']['cp_a']:.2f} s; an lstat of "
                         f"each of its files {got['floor_copy']['walk_lstat'] * 1000:.0f} ms")
    if res.get("floor_mount"):
        f = res["floor_mount"]
        lines.append(f"  floor: a bare overlay: mkdir x4 {f['mkdirs'] * 1000:.2f} ms + `mount -t overlay` "
                     f"{f['mount'] * 1000:.1f} ms; its umount {f['umount'] * 1000:.1f} ms")
    return lines


if __name__ == "__main__":
    run(quick="--quick" in sys.argv, as_json="--json" in sys.argv)
