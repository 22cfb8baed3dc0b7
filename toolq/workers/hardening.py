"""What a worker-side process does at its start so that no tool can read the fleet's secrets out
of it: the worker (and the pool children it forks), the session host and the MCP host.

- Not dumpable (`PR_SET_DUMPABLE 0`): `/proc/<pid>/environ`, `mem`, `fd` and ptrace need
  CAP_SYS_PTRACE then, even for a process of the same user (an MCP server, which runs as the
  worker's user, read `/proc/<worker>/environ` through any tool that reads a path). Forked
  children keep it; an exec resets it, so each exec'd process calls `harden` itself.
- The secrets' values wiped from the initial environment block, which is what
  `/proc/<pid>/environ` shows (`os.environ` is a copy made at start, and unsetenv never touches
  the block): a root process with CAP_SYS_PTRACE can still read it otherwise.
- `drop_ptrace`: the MCP host, whose servers are not sandboxed, gives up CAP_SYS_PTRACE for
  itself and everything it starts, so a root worker's MCP server cannot read non-dumpable
  processes either.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os

from toolq.core.libc import PR_CAPBSET_DROP, PR_SET_DUMPABLE
from toolq.core.libc import libc as _libc
from toolq.workers.isolation.policy import FORBIDDEN_ENV as SECRET_ENV  # what commands never get either

_CAP_SYS_PTRACE = 19
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def harden() -> None:
    """Not dumpable, and the secrets gone from what `/proc/<pid>/environ` shows."""
    if _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    wipe_initial_environment()


def _environment_block() -> tuple[int, int]:
    """Where this process's initial environment lies in its memory (proc(5): env_start, env_end)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[47]), int(fields[48])  # fields 50 and 51, counted from the pid


def wipe_initial_environment(patterns: tuple[str, ...] = SECRET_ENV) -> list[str]:
    """Overwrite, in place, the values of the initial environment's variables that match
    `patterns`; returns their names. `os.environ` is left as it is."""
    start, end = _environment_block()
    block = ctypes.string_at(start, end - start)
    wiped, offset = [], 0
    for entry in block.split(b"\0"):
        name, eq, value = entry.partition(b"=")
        if eq and value and any(fnmatch.fnmatchcase(name.decode(errors="replace"), p) for p in patterns):
            ctypes.memset(start + offset + len(name) + 1, 0, len(value))
            wiped.append(name.decode(errors="replace"))
        offset += len(entry) + 1
    return wiped


def drop_ptrace() -> None:
    """This process and what it starts lose CAP_SYS_PTRACE for good (bounding, effective,
    permitted and inheritable sets); a no-op for a process that never had it."""
    if os.geteuid() != 0:
        return
    _libc.prctl(PR_CAPBSET_DROP, _CAP_SYS_PTRACE, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if _libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for i in (0, 1, 2):  # effective, permitted, inheritable: the low 32 capabilities
        data[i] &= ~(1 << _CAP_SYS_PTRACE)
    if _libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
