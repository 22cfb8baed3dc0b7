"""Per-call resource limits: rlimits set in the command's first process, a pids cgroup where this
worker may create one, and the line that tells the model which limit a command hit.

RLIMIT_NPROC counts every process of the uid (and is never enforced for root), so the process
limit comes from a per-call pids cgroup when the worker can create one (root on cgroup v1 here),
else from RLIMIT_NPROC raised by what the uid already runs; as root without a pids cgroup there
is none, and the banner says so.
"""

from __future__ import annotations

import itertools
import os
import re
import resource
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
_counter = itertools.count()


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


class CallLimits:
    """The limits of one call: prepare in the worker, `apply_in_child` before exec, `close` after."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.cgroup: Path | None = None
        self._procs_path: bytes | None = None
        self.nproc: int | None = None
        base = pids_cgroup_base()
        if base is not None:
            try:
                cg = base / f"toolq-{os.getpid()}-{next(_counter)}"
                cg.mkdir()
                (cg / "pids.max").write_text(str(limits.processes))
                self.cgroup, self._procs_path = cg, os.fsencode(cg / "cgroup.procs")
            except OSError:
                self.cgroup = None
        if self.cgroup is None and os.geteuid() != 0:
            self.nproc = _processes_of_uid(os.getuid()) + limits.processes

    def apply_in_child(self) -> None:
        """Runs between fork and exec (async-signal-safe enough: syscalls only, no locks)."""
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * MIB,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_seconds, lim.cpu_seconds + CPU_HARD_SLACK))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_mb * MIB,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (self.nproc,) * 2)
        if self._procs_path is not None:
            fd = os.open(self._procs_path, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

    def kill_all(self) -> None:
        """SIGKILL whatever is still in the call's cgroup, until it is empty."""
        if self.cgroup is None:
            return
        for _ in range(1000):
            try:
                pids = [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
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

    def hit_process_limit(self) -> bool:
        if self.cgroup is None:
            return False
        try:
            events = (self.cgroup / "pids.events").read_text()
        except OSError:
            return False
        return any(line.split() and line.split()[0] == "max" and line.split()[1] != "0" for line in events.splitlines())

    def close(self) -> bool:
        """Remove the cgroup; True if a fork failed on the process limit during the call."""
        hit = self.hit_process_limit()
        if self.cgroup is not None:
            self.kill_all()
            for _ in range(100):
                try:
                    self.cgroup.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.002)
            self.cgroup = None
        return hit


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
