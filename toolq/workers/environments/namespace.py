"""The host's namespace, where an unprivileged worker mounts its environments' overlays.

Overlayfs may be mounted by whoever holds CAP_SYS_ADMIN over the mount namespace: root, or any
user inside a user namespace of its own. A host's environments are shared by every worker
process of the machine (issue 28), and their pool children, session hosts and cells must all see
one mount of each environment (two overlay mounts on one upper dir disagree), so the namespace
is the host's, not a process's:

- a holder process (`ns_holder.py`) makes it: a user namespace mapping the worker's uid and gid
  to themselves, and a mount namespace owned by it;
- each worker process joins it (setns) at its start, before it has threads, and holds a shared
  lock on `locks/namespace-members.lock` for its life; everything it starts is inside too;
- the holder leaves once no worker holds that lock, so the namespace, and its mounts, end with
  the host's last worker; a worker started later makes a new one, and the host's reaper mounts
  the environments found whole on disk again (`EnvHost.remount`). The holder ignores the signals
  that stop a worker; killed outright while workers live, it leaves their namespace joinable by
  none: a worker started then copies (the reason logged) rather than mount their environments
  a second time;
- joining or making happens under `locks/namespace.lock`, so two workers starting at once never
  make two namespaces (two mounts of one environment).

A worker inside has every capability over the namespace's own objects and none over the host's:
it may mount there, and files and processes of other users stay as they were. Not done, and the
environments are copies then (the reason logged once, the mode shown in `toolq workers`): root,
which mounts in the host's own namespace; a process that already has threads; a kernel or policy
without user namespaces; and a worker whose uid is the kernel's overflow uid (`nobody`). In a
namespace that maps only the worker's uid, every other uid reads as the overflow uid, so such a
worker could not tell root's files and processes from its own (its commands' process cap counts
the user's processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from toolq.core.libc import libc

log = logging.getLogger("toolq.environments")

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000

#: The namespace this process joined (holder's pid), if any: the host mounts with `userxattr` then.
_joined: int | None = None
#: The members lock, held open for the life of the process (its pool children share it).
_member_fd: int | None = None
_SOURCE: str | None = None


def inside() -> bool:
    """Whether this process works in a host namespace of this module's making."""
    return _joined is not None


def overflow_uid() -> int:
    try:
        return int(Path("/proc/sys/kernel/overflowuid").read_text())
    except (OSError, ValueError):
        return 65534


def why_not(root: Path) -> str | None:
    """Why this process cannot work in a host namespace, or None."""
    if os.geteuid() == 0:
        return "root mounts in the host's own namespace"
    if os.getuid() == overflow_uid():
        return (f"uid {os.getuid()} is the kernel's overflow uid, which every other user's files and processes "
                "would read as in a user namespace: run workers as a user of their own")
    if threading.active_count() > 1:
        return "the worker already has threads"
    if any(c in str(root) for c in ",:\\\n"):
        return f"{root} cannot be named in overlay's options"
    return None


def enter(root: Path) -> str:
    """Join the host's namespace under `root` (the environments' root), making it if there is none.
    Returns what was done, for the worker's log: "joined", "made", or why not (the worker then
    stays where it is and its environments are copies)."""
    global _joined, _member_fd
    if _joined is not None:
        return "joined"
    root = root.absolute()
    reason = why_not(root)
    if reason is not None:
        return reason
    try:
        (root / "locks").mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        with _locked(root / "locks" / "namespace.lock"):
            made = False
            holder = _live_holder(root)
            if holder is None:
                if _members_left(root):
                    # Its workers still mount there: a second namespace would mount their
                    # environments a second time, over the same upper dirs.
                    return ("the host's namespace lost its holder while workers still use it: stop the host's "
                            "workers, then start them again")
                holder = _start_holder(root)
                made = True
            try:
                _setns(holder)
            except OSError:
                if made:  # nobody will join it: end it now rather than leave it to its check
                    with contextlib.suppress(OSError):
                        os.kill(holder, signal.SIGKILL)
                        os.waitpid(holder, 0)
                raise
            member = os.open(root / "locks" / "namespace-members.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(member, fcntl.LOCK_SH)  # inherited by the pool children: released with the last
        _joined, _member_fd = holder, member
        return "made" if made else "joined"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"no host namespace ({getattr(e, 'strerror', None) or e})"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _members_left(root: Path) -> bool:
    """Whether a worker still holds its share of `namespace-members.lock` (called under
    `namespace.lock`, where no other worker takes it)."""
    fd = os.open(root / "locks" / "namespace-members.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _start_time(pid: int) -> str | None:
    """The process's start time (stat's 22nd field): a pid reused by another process differs.
    None for a process that is gone, or a zombie (a holder killed before its parent reaped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else fields[19].decode()
    except (OSError, IndexError):
        return None


def _live_holder(root: Path) -> int | None:
    """The holder `namespace.pid` names, if that process still lives and holds a namespace."""
    try:
        pid_text, started = (root / "locks" / "namespace.pid").read_text().split()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if _start_time(pid) != started:
        return None
    try:
        if os.stat(f"/proc/{pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino:
            return None
    except OSError:
        return None
    return pid


def _holder_source() -> str:
    global _SOURCE
    if _SOURCE is None:
        from toolq.workers.environments import ns_holder

        _SOURCE = Path(ns_holder.__file__).read_text()
    return _SOURCE


def _start_holder(root: Path) -> int:
    """Start a holder for `root` (its own session: it outlives this worker while others live) and
    wait for its "ready"."""
    proc = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-c", _holder_source(), str(root)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/",
        env={"PATH": "/usr/bin:/bin"}, start_new_session=True, close_fds=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode(errors="replace").strip()
    proc.stdout.close()
    if line != "ready":
        proc.wait(timeout=5)
        raise RuntimeError(line or f"the namespace's holder exited {proc.returncode}")
    started = _start_time(proc.pid)
    tmp = root / "locks" / f"namespace.pid.{os.getpid()}"
    tmp.write_text(f"{proc.pid} {started}\n")
    os.replace(tmp, root / "locks" / "namespace.pid")
    # Not waited for by this process: it is the host's. Popen's own reaping is left to the kernel
    # (it becomes a child of init when this worker exits).
    proc.returncode = 0
    return proc.pid


def _setns(pid: int) -> None:
    cwd = os.getcwd()  # setns(mnt) moves the cwd to the namespace's root; the same path is there
    for ns, kind in (("user", _CLONE_NEWUSER), ("mnt", _CLONE_NEWNS)):
        fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, kind) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({ns}): {os.strerror(err)}")
        finally:
            os.close(fd)
    os.chdir(cwd)
