"""The host's namespace, where an unprivileged worker mounts its environments' overlays.

Overlayfs may be mounted by whoever holds CAP_SYS_ADMIN over the mount namespace: root, or any
user inside a user namespace of its own. A host's environments are shared by every worker
process of the machine (issue 28), and their pool children, session hosts and cells must all see
one mount of each environment (two overlay mounts on one upper dir disagree), so the namespace
is the host's, not a process's:

- a holder process (`ns_holder.py`) makes it: a user namespace mapping the worker's uid and gid
  to themselves, and a mount namespace owned by it;
- each worker process joins it (setns) at its start, before it has threads, with descriptors the
  holder hands over `locks/namespace.sock` once the worker proved the fleet's key (and the holder
  proved it back): whoever holds that user namespace holds every capability in it, enough to
  mount over the code the workers load, so no process of the user may enter it without the key
  (the holder is not dumpable: its `/proc/<pid>/ns/*` cannot be opened, nor can it be ptraced);
- each worker holds a shared lock on `locks/namespace-members.lock` for its life; everything it
  starts is inside too;
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
import hmac
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from toolq.core.libc import libc
from toolq.workers.environments import ns_holder

log = logging.getLogger("toolq.environments")

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000

#: Whether this process joined its host's namespace: the host mounts with `userxattr` then.
_joined = False
_stranded = False
#: The members lock, held open for the life of the process (its pool children share it).
_member_fd: int | None = None
_SOURCE: str | None = None


def stranded() -> bool:
    """Whether this process found its host's workers in a namespace it cannot join (the holder
    gone): it must then serve none of the host's environments, which it can neither see mounted
    nor mount again without mounting them twice."""
    return _stranded


def inside() -> bool:
    """Whether this process works in a host namespace of this module's making."""
    return _joined


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


def enter(root: Path, key: bytes) -> str:
    """Join the host's namespace under `root` (the environments' root), making it if there is none;
    `key` is the fleet key's `host_namespace_key`. Returns what was done, for the worker's log:
    "joined", "made", or why not (the worker then stays where it is and its environments are
    copies)."""
    global _joined, _member_fd
    if _joined:
        return "joined"
    root = root.absolute()
    reason = why_not(root)
    if reason is not None:
        return reason
    holder = None
    try:
        (root / "locks").mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        with _locked(root / "locks" / "namespace.lock"):
            made = False
            namespaces = _ask_holder(root, key)
            if namespaces is None:
                if _members_left(root):
                    # Its workers still mount there: a second namespace would mount their
                    # environments a second time, over the same upper dirs.
                    global _stranded
                    _stranded = True
                    return ("the host's namespace lost its holder while workers still use it: stop the host's "
                            "workers, then start them again")
                holder = _start_holder(root, key)
                made = True
                namespaces = _ask_holder(root, key)
                if namespaces is None:
                    raise RuntimeError("the namespace's new holder did not answer")
            try:
                _setns(namespaces)
            finally:
                for fd in namespaces:
                    os.close(fd)
            member = os.open(root / "locks" / "namespace-members.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(member, fcntl.LOCK_SH)  # inherited by the pool children: released with the last
        _joined, _member_fd = True, member
        return "made" if made else "joined"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        if holder is not None:  # nobody will join it: end it now rather than leave it to its check
            with contextlib.suppress(OSError):
                os.kill(holder, signal.SIGKILL)
                os.waitpid(holder, 0)
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


def _ask_holder(root: Path, key: bytes) -> list[int] | None:
    """The holder's user and mount namespaces (descriptors), or None where no holder listens.
    Both sides prove the key: a process that took the socket's name is never joined."""
    locks = os.open(root / "locks", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as conn:
            conn.settimeout(10)
            try:
                conn.connect(f"/proc/self/fd/{locks}/namespace.sock")
            except (FileNotFoundError, ConnectionRefusedError):
                return None
            theirs = ns_holder.read_exactly(conn, ns_holder.NONCE)
            ours = os.urandom(ns_holder.NONCE)
            conn.sendall(ns_holder.mac(key, b"join", theirs) + ours)
            proof, fds, _, _ = socket.recv_fds(conn, 32, 2)
    finally:
        os.close(locks)
    if len(theirs) != ns_holder.NONCE or not hmac.compare_digest(proof, ns_holder.mac(key, b"holder", ours)) \
            or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        raise RuntimeError("what answers on namespace.sock does not prove this fleet's key (another fleet's holder, "
                           "or no holder)")
    return fds


def _holder_source() -> str:
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = Path(ns_holder.__file__).read_text()
    return _SOURCE


def _start_holder(root: Path, key: bytes) -> int:
    """Start a holder for `root` (its own session: it outlives this worker while others live),
    its key on its stdin, and wait for its "ready"."""
    proc = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-c", _holder_source(), str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/",
        env={"PATH": "/usr/bin:/bin"}, start_new_session=True, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(key.hex().encode() + b"\n")
    proc.stdin.close()
    line = proc.stdout.readline().decode(errors="replace").strip()
    proc.stdout.close()
    if line != "ready":
        proc.wait(timeout=5)
        raise RuntimeError(line or f"the namespace's holder exited {proc.returncode}")
    tmp = root / "locks" / f"namespace.pid.{os.getpid()}"
    tmp.write_text(f"{proc.pid}\n")  # for its operator: the process to look for
    os.replace(tmp, root / "locks" / "namespace.pid")
    # Not waited for by this process: it is the host's, and outlives it while other workers live
    # (it becomes a child of init when this worker exits).
    proc.returncode = 0
    return proc.pid


def _setns(namespaces: list[int]) -> None:
    cwd = os.getcwd()  # setns(mnt) moves the cwd to the namespace's root; the same path is there
    for fd, kind, ns in zip(namespaces, (_CLONE_NEWUSER, _CLONE_NEWNS), ("user", "mnt"), strict=True):
        if libc.setns(fd, kind) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    os.chdir(cwd)
