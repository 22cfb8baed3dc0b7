"""The C library, opened once, for what Python's `os` does not wrap (prctl, capset, Landlock's
syscalls, mount namespaces, statx), and whether a process exists. The program inside a sandbox
cell (`cell_init.py`) opens its own: it imports nothing of toolq."""

from __future__ import annotations

import ctypes
import os
import signal

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long  # a syscall returns a long (Landlock's file descriptors, -1)

#: prctl(2) options.
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent thread ends (for a `preexec_fn`:
    the child of a dying worker or orchestrator does not outlive it)."""
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def pid_exists(pid: int) -> bool:
    """Whether a process `pid` exists (signal 0; another user's counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
