"""Nothing a call starts outlives it, without a pid namespace: the worker is a child subreaper.

A process that leaves the call's process group (`setsid -f`, a double fork) is re-parented to
the worker instead of init, so after the call the worker finds it among its own children and
kills it (and, one generation at a time, whatever it started). Only a process that runs nothing
but calls may sweep its children: a Celery pool child opts in (`become_subreaper`, from the
worker's process-init hook); elsewhere (tests, a bench) the sweep does nothing. A pool child runs
one call at a time; a sweep still spares the live calls' leaders.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

from toolq.core.libc import PR_SET_CHILD_SUBREAPER
from toolq.core.libc import libc as _libc

_subreaper_of: int | None = None


def become_subreaper() -> None:
    """Once per process (a forked pool child must set it again: it is not inherited)."""
    global _subreaper_of
    if _subreaper_of != os.getpid():
        if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        _subreaper_of = os.getpid()


def is_subreaper() -> bool:
    return _subreaper_of == os.getpid()


def has_exited(pid: int) -> bool:
    """True once the child has exited, without reaping it (WNOWAIT keeps the pgid reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped elsewhere
        return True


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def sweep(spare: frozenset[int] | set[int] = frozenset()) -> int:
    """SIGKILL and reap every child of this process outside `spare`, until none is left; orphans
    of the killed ones come back as children and go in the next round. Returns how many died."""
    if not is_subreaper():
        return 0
    killed = 0
    for _ in range(10_000):
        victims = [c for c in children(os.getpid()) if c not in spare]
        if not victims:
            break
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                killed += 1
            except (ProcessLookupError, ChildProcessError):
                pass
    return killed
