"""Per-call resource limits: rlimits set in the command's first process, a pids cgroup where this
worker may create one, and the line that tells the model which limit a command hit.

RLIMIT_NPROC counts every process of the uid (and is never enforced for root), so the process
limit comes from a pids cgroup when the worker can create one (root on cgroup v1 here), else from
RLIMIT_NPROC raised by what the uid already runs; as root without a pids cgroup there is none,
and the banner says so. The cgroup is one per pool child, entered once at its start: moving a
process into a v1 cgroup costs ~15 ms here (an RCU grace period), too much for every call, and a
pool child runs one call at a time, so its cgroup holds that call's processes and nothing else.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import time
from pathlib import Path

from toolq.workers.isolation.policy import Limits

MIB = 1024 * 1024
#: Slack between the CPU soft limit (SIGXCPU, which names the limit) and the hard one (SIGKILL).
CPU_HARD_SLACK = 2
_MEMORY_FAILURE = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_FORK_FAILURE = re.compile(r"fork: (retry: )?Resource temporarily unavailable|Cannot fork|"
                           r"BlockingIOError: \[Errno 11\]")


def _pids_cgroup_base() -> Path | None:
    """This process's cgroup in the v1 pids hierarchy, if it may create children there."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
            return base if (base / "cgroup.procs").exists() and os.access(base, os.W_OK) else None
    return None


_BASE: Path | None | bool = False
#: Slack over the process limit in the pool child's cgroup, for the pool child's own threads.
OWN_TASKS_SLACK = 16
_pool_cgroup: Path | None = None


def pids_cgroup_base() -> Path | None:
    global _BASE
    if _BASE is False:
        _BASE = _pids_cgroup_base()
    return _BASE  # type: ignore[return-value]


def process_limit_mode() -> str:
    """How the process limit is enforced on this worker (for the banner)."""
    if pids_cgroup_base() is not None:
        return "pids cgroup"
    return "not enforced (root without a pids cgroup)" if os.geteuid() == 0 else "RLIMIT_NPROC"


def remove_stale_pool_cgroups() -> None:
    """The cgroups of pool children that are gone; what a killed one left running dies first."""
    base = pids_cgroup_base()
    for stale in base.glob("toolq-pool-*") if base is not None else ():
        owner = stale.name.rpartition("-")[2]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            _kill_members(stale)
            try:
                stale.rmdir()
            except OSError:
                pass


def enter_pool_cgroup(limits: Limits) -> Path | None:
    """Put this pool child in a pids cgroup of its own (once); stale ones of dead children go."""
    global _pool_cgroup
    base = pids_cgroup_base()
    if base is None or _pool_cgroup is not None:
        return _pool_cgroup
    remove_stale_pool_cgroups()
    cg = base / f"toolq-pool-{os.getpid()}"
    try:
        cg.mkdir(exist_ok=True)
        own = len(os.listdir("/proc/self/task"))
        (cg / "pids.max").write_text(str(limits.processes + own + OWN_TASKS_SLACK))
        (cg / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    _pool_cgroup = cg
    return cg


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


def _limit_failures(cg: Path) -> int:
    try:
        for line in (cg / "pids.events").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "max":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class CallLimits:
    """The limits of one call: made in the worker, `apply_in_child` before exec, `close` after."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.cgroup = _pool_cgroup if _pool_cgroup is not None and _pool_cgroup.exists() else None
        self._failures_before = _limit_failures(self.cgroup) if self.cgroup else 0
        self.nproc: int | None = None
        if self.cgroup is None and os.geteuid() != 0:
            self.nproc = _processes_of_uid(os.getuid()) + limits.processes

    def use_cgroup(self, cgroup: Path) -> None:
        """Count and kill in `cgroup` instead (a session host's spawn slot, toolq/workers/sessions)."""
        self.cgroup = cgroup
        self._failures_before = _limit_failures(cgroup)

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

    def apply_in_child(self) -> None:
        """Runs between fork and exec: syscalls only."""
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * MIB,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_seconds, lim.cpu_seconds + CPU_HARD_SLACK))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_mb * MIB,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (self.nproc,) * 2)

    def kill_all(self) -> None:
        """SIGKILL every process in the pool child's cgroup but the pool child, until none is left."""
        if self.cgroup is not None:
            _kill_members(self.cgroup)

    def close(self) -> bool:
        """True if a fork failed on the process limit during the call."""
        if self.cgroup is None:
            return False
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


def explain(limits: Limits, exit_code: int, output: str, process_limit_hit: bool) -> str | None:
    """The line that names the limit a command ran into, or None."""
    if exit_code == 128 + signal.SIGXCPU or "CPU time limit exceeded" in output:
        return f"the command exceeded the sandbox's CPU time limit of {limits.cpu_seconds} s"
    if exit_code == 128 + signal.SIGXFSZ or "File size limit exceeded" in output:
        return f"the command exceeded the sandbox's file size limit of {limits.file_mb} MiB"
    if process_limit_hit or (exit_code != 0 and _FORK_FAILURE.search(output)):
        return f"the command reached the sandbox's limit of {limits.processes} processes"
    if exit_code != 0 and _MEMORY_FAILURE.search(output):
        return f"the command ran out of memory: the sandbox limits each process to {limits.memory_mb} MiB"
    return None
