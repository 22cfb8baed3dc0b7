"""Per-call resource limits: rlimits set in the command's first process, a pids cgroup where this
worker may create one, and the line that tells the model which limit a command hit.

RLIMIT_NPROC counts every process of the uid (and is never enforced for root), so the process
limit comes from a pids cgroup when the worker can create one (root on cgroup v1 here), else from
RLIMIT_NPROC raised by what the uid already runs, and never above the session host's one ceiling
for all its commands together (`bound_uid_processes`); as root without a pids cgroup there is
none, and the banner says so. The cgroup is one per pool child, entered once at its start: moving a
process into a v1 cgroup costs ~15 ms here (an RCU grace period), too much for every call, and a
pool child runs one call at a time, so its cgroup holds that call's processes and nothing else.

Memory likewise: RLIMIT_AS bounds each process, not the call (8 processes may hold 8 times it),
and tmpfs or memfd pages count in no address space. Where the worker may, each pool child is
also in a memory cgroup of the limit (plus its own slack), so the whole call is bounded and the
kernel's OOM killer acts inside it, never on other turns: on the call's biggest process, or on
the pool child itself when that is bigger (the call then fails as a worker lost; Celery starts
another pool child). Exempting the pool child would need CAP_SYS_RESOURCE, which not every
root has.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import threading
import time
from pathlib import Path

from toolq.workers.isolation.policy import Limits

MIB = 1024 * 1024
#: The CFS period of a CPU quota (the kernel's default): a quota of N CPUs is N periods per period.
CPU_PERIOD_US = 100_000
#: Slack between the CPU soft limit (SIGXCPU, which names the limit) and the hard one (SIGKILL).
CPU_HARD_SLACK = 2
_MEMORY_FAILURE = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_FORK_FAILURE = re.compile(r"fork: (retry: )?Resource temporarily unavailable|Cannot fork|"
                           r"BlockingIOError: \[Errno 11\]")


def _cgroup_base(controller: str) -> Path | None:
    """This process's cgroup in the v1 `controller` hierarchy, if it may create children there."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
            return base if (base / "cgroup.procs").exists() and os.access(base, os.W_OK) else None
    return None


_BASES: dict[str, Path | None] = {}
#: Slack over the process limit in the pool child's cgroup, for the pool child's own threads.
OWN_TASKS_SLACK = 16
#: Slack over the memory limit in the pool child's memory cgroup, for what the pool child itself
#: allocates during a call (its pages from before it entered stay charged where they were).
OWN_MEMORY_SLACK_MB = 32
_pool_cgroup: Path | None = None
_pool_memory_cgroup: Path | None = None
_uid_ceiling: int | None = None
"""Where no pids cgroup bounds this process's commands together (a worker not root): the count
of the uid's processes past which none of them may fork (`bound_uid_processes`)."""


def cgroup_base(controller: str) -> Path | None:
    if controller not in _BASES:
        _BASES[controller] = _cgroup_base(controller)
    return _BASES[controller]


def pids_cgroup_base() -> Path | None:
    return cgroup_base("pids")


def memory_limit_mode() -> str:
    """How the memory limit is enforced on this worker (for the banner)."""
    return "memory cgroup, per call" if cgroup_base("memory") is not None else "RLIMIT_AS, per process"


def process_limit_mode() -> str:
    """How the process limit is enforced on this worker (for the banner)."""
    if pids_cgroup_base() is not None:
        return "pids cgroup"
    return "not enforced (root without a pids cgroup)" if os.geteuid() == 0 else "RLIMIT_NPROC"


def remove_stale_pool_cgroups() -> None:
    """The cgroups of pool children and session hosts that are gone; what a killed one left running
    dies first."""
    for controller in ("pids", "memory", "cpu"):
        base = cgroup_base(controller)
        for stale in base.glob("toolq-pool-*") if base is not None else ():
            owner = stale.name.rpartition("-")[2]
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                remove_cgroup(stale)


def remove_cgroup(cg: Path) -> None:
    """`cg` and the cgroups below it, each emptied first (its processes killed)."""
    for child in [p for p in cg.iterdir() if p.is_dir()] if cg.is_dir() else []:
        remove_cgroup(child)
    _kill_members(cg)
    try:
        cg.rmdir()
    except OSError:
        pass


def enter_cgroup(controller: str, settings: dict[str, str], *, name: str, thread: bool | None = False,
                 parent: Path | None = None) -> Path | None:
    """Put this process (`thread`: only the calling thread; None: nobody) in a new cgroup `name` of
    `controller` (under `parent`, else this process's own) with `settings` (file -> value); None
    where it may not."""
    base = parent if parent is not None else cgroup_base(controller)
    if base is None:
        return None
    cg = base / name
    try:
        cg.mkdir(exist_ok=True)
        for file, value in settings.items():
            (cg / file).write_text(value)
        if thread is None:
            pass
        elif thread:
            (cg / "tasks").write_text(str(threading.get_native_id()))
        else:
            (cg / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return cg


def _enter(controller: str, settings: dict[str, str]) -> Path | None:
    return enter_cgroup(controller, settings, name=f"toolq-pool-{os.getpid()}")


def enter_pool_cgroup(limits: Limits) -> Path | None:
    """Put this pool child in a pids and a memory cgroup of its own (once); stale ones of dead
    children go. Returns the pids cgroup."""
    global _pool_cgroup, _pool_memory_cgroup
    if _pool_cgroup is not None or _pool_memory_cgroup is not None:
        return _pool_cgroup
    remove_stale_pool_cgroups()
    own = len(os.listdir("/proc/self/task"))
    _pool_cgroup = _enter("pids", {"pids.max": str(limits.processes + own + OWN_TASKS_SLACK)})
    _pool_memory_cgroup = _enter("memory", {
        "memory.limit_in_bytes": str((limits.memory_mb + OWN_MEMORY_SLACK_MB) * MIB)})
    return _pool_cgroup


def bound_uid_processes(worker_processes: int) -> int | None:
    """Where no pids cgroup can bound all of this process's commands together (a worker that is not
    root), cap each one's RLIMIT_NPROC at what the uid runs now plus `worker_processes`. The kernel
    counts every task of the uid against it, the worker's own threads and other commands
    included, so sessions cannot multiply the per-call limit (each got "what the uid runs + the
    limit"). Called once, by the session host at its start; returns the ceiling (None: none)."""
    global _uid_ceiling
    if worker_processes and os.geteuid() != 0 and pids_cgroup_base() is None:
        _uid_ceiling = _tasks_of_uid(os.getuid()) + worker_processes
    return _uid_ceiling


def uid_ceiling_prefix() -> list[str]:
    """`prlimit --nproc=<ceiling> --` before a program that makes a user namespace (bubblewrap as
    a worker that is not root): the kernel bounds all of a namespace's processes, counted as the
    uid's, by its creator's RLIMIT_NPROC at its creation, which a limit set later on the sandbox
    does not change. [] where there is no ceiling (or no prlimit)."""
    prlimit = _prlimit()
    return [prlimit, f"--nproc={_uid_ceiling}", "--"] if _uid_ceiling is not None and prlimit else []


def uid_ceiling_reached(slack: int = 0) -> bool:
    """The uid runs (nearly) as many processes as `bound_uid_processes` allows."""
    return _uid_ceiling is not None and _tasks_of_uid(os.getuid()) + slack >= _uid_ceiling


def _kill_members(cg: Path) -> None:
    """SIGKILL every process in `cg` but this one, until none is left."""
    me = os.getpid()
    for _ in range(1000):
        try:
            pids = [int(p) for p in (cg / "cgroup.procs").read_text().split() if int(p) != me]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def cgroup_number(cg: Path | None, file: str) -> int:
    """A cgroup file holding one number (`pids.current`, `memory.usage_in_bytes`); 0 where unreadable."""
    if cg is None:
        return 0
    try:
        return int((cg / file).read_text())
    except (OSError, ValueError):
        return 0


def _counter(cg: Path | None, file: str, name: str) -> int:
    """A `name value` line of a cgroup file (pids.events' `max`, memory.oom_control's `oom_kill`)."""
    if cg is None:
        return 0
    try:
        for line in (cg / file).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _limit_failures(cg: Path | None) -> int:
    return _counter(cg, "pids.events", "max")


def _oom_kills(cg: Path | None) -> int:
    return _counter(cg, "memory.oom_control", "oom_kill")


class CallLimits:
    """The limits of one call: made in the worker, `apply_in_child` before exec, `close` after."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.cgroup = _pool_cgroup if _pool_cgroup is not None and _pool_cgroup.exists() else None
        self._failures_before = _limit_failures(self.cgroup)
        self.memory_cgroup = _pool_memory_cgroup
        self._oom_kills_before = _oom_kills(self.memory_cgroup)
        self.memory_limit_hit = False
        self.nproc: int | None = None
        if self.cgroup is None and os.geteuid() != 0:
            self.nproc = _processes_of_uid(os.getuid()) + limits.processes
            if _uid_ceiling is not None:
                self.nproc = min(self.nproc, _uid_ceiling)

    def use_cgroups(self, cgroup: Path | None, memory_cgroup: Path | None) -> None:
        """Count and kill in these cgroups instead (a session host's spawn slot, toolq/workers/sessions)."""
        if cgroup is not None:
            self.cgroup = cgroup
            self._failures_before = _limit_failures(cgroup)
        if memory_cgroup is not None:
            self.memory_cgroup = memory_cgroup
            self._oom_kills_before = _oom_kills(memory_cgroup)

    def prlimit_prefix(self) -> list[str] | None:
        """The same limits as a `prlimit ... --` prefix (util-linux), so that the worker can spawn
        with vfork: a pre-exec function makes Python fork the whole pool child (~6 ms at 100 MB)."""
        prlimit = _prlimit()
        if prlimit is None:
            return None
        lim = self.limits
        args = [prlimit, f"--as={lim.memory_mb * MIB}", f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + CPU_HARD_SLACK}",
                f"--fsize={lim.file_mb * MIB}", "--core=0"]
        if self.nproc is not None:
            args.append(f"--nproc={self.nproc}")
        return [*args, "--"]

    def rlimits(self) -> list[tuple[int, tuple[int, int]]]:
        lim = self.limits
        found = [(resource.RLIMIT_AS, (lim.memory_mb * MIB,) * 2),
                 (resource.RLIMIT_CPU, (lim.cpu_seconds, lim.cpu_seconds + CPU_HARD_SLACK)),
                 (resource.RLIMIT_FSIZE, (lim.file_mb * MIB,) * 2),
                 (resource.RLIMIT_CORE, (0, 0))]
        if self.nproc is not None:
            found.append((resource.RLIMIT_NPROC, (self.nproc,) * 2))
        return found

    def apply_in_child(self) -> None:
        """Runs between fork and exec: syscalls only."""
        for which, value in self.rlimits():
            resource.setrlimit(which, value)

    def apply_to(self, pid: int) -> None:
        """Set the limits on another process before it runs the command (bwrap's held sandbox,
        whose processes inherit them)."""
        for which, value in self.rlimits():
            resource.prlimit(pid, which, value)

    def kill_all(self) -> None:
        """SIGKILL every process in the pool child's cgroup but the pool child, until none is left."""
        if self.cgroup is not None:
            _kill_members(self.cgroup)

    def close(self, kill: bool = True) -> bool:
        """True if a fork failed on the process limit during the call (`memory_limit_hit`: the
        OOM killer killed one of its processes). `kill`: what is left in the cgroup dies first."""
        self.memory_limit_hit = _oom_kills(self.memory_cgroup) > self._oom_kills_before
        if self.cgroup is None:
            return False
        if kill:
            self.kill_all()
        return _limit_failures(self.cgroup) > self._failures_before


_PRLIMIT: str | None | bool = False


def _prlimit() -> str | None:
    global _PRLIMIT
    if _PRLIMIT is False:
        _PRLIMIT = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    return _PRLIMIT  # type: ignore[return-value]


def _processes_of_uid(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _tasks_of_uid(uid: int) -> int:
    """Processes and their threads, as RLIMIT_NPROC counts them."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return count


def explain(limits: Limits, exit_code: int, output: str, process_limit_hit: bool,
            memory_limit_hit: bool = False) -> str | None:
    """The line that names the limit a command ran into, or None."""
    if exit_code == 128 + signal.SIGXCPU or "CPU time limit exceeded" in output:
        return f"the command exceeded the sandbox's CPU time limit of {limits.cpu_seconds} s"
    if exit_code == 128 + signal.SIGXFSZ or "File size limit exceeded" in output:
        return f"the command exceeded the sandbox's file size limit of {limits.file_mb} MiB"
    if process_limit_hit or (exit_code != 0 and _FORK_FAILURE.search(output)):
        return (f"the command reached the sandbox's limit of {limits.processes} processes"
                + _together(limits.worker_processes, "processes"))
    if memory_limit_hit:
        return (f"the command ran out of memory: the sandbox limits each call to {limits.memory_mb} MiB"
                + _together(limits.worker_memory_mb, "MiB"))
    if exit_code != 0 and _MEMORY_FAILURE.search(output):
        return f"the command ran out of memory: the sandbox limits each process to {limits.memory_mb} MiB"
    return None


def _together(bound: int, unit: str) -> str:
    return f" (and this worker's commands and sessions together to {bound} {unit})" if bound else ""
