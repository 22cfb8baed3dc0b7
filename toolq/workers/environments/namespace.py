"""The host's namespace, where an unprivileged worker mounts its environments' overlays.

Overlayfs may be mounted by whoever holds CAP_SYS_ADMIN over the mount namespace: root, or any
user inside a user namespace of its own. A host's environments are shared by every worker
process of the machine (issue 28), and their pool children, session hosts and cells must all see
one mount of each environment (two overlay mounts on one upper dir disagree), so the namespace
is the host's, not a process's:

- a holder process (`ns_holder.py`) makes it: a user namespace mapping the worker's uid and gid
  to themselves, and a mount namespace owned by it;
- each worker process joins it (setns) at its start, before it has threads, with descriptors the
  holder hands over `locks/namespace-FLEET.sock` once the worker proved the fleet's key (and the
  holder proved it back): whoever holds that user namespace holds every capability in it, enough
  to mount over the code the workers load, so no process of the user may enter it without the
  key (the holder is not dumpable: its `/proc/<pid>/ns/*` cannot be opened, nor can it be
  ptraced). Each fleet sharing a root has its own namespace and files (`name_of`);
- each worker holds a shared lock on `locks/namespace-FLEET-members.lock` for its life, and so do
  the session host and MCP host it starts (`member_fds`); everything it starts is inside too;
- the holder leaves once no worker holds that lock, so the namespace, and its mounts, end with
  the host's last worker; a worker started later makes a new one, and the host's reaper mounts
  the environments found whole on disk again (`EnvHost.remount`). The holder ignores the signals
  that stop a worker; killed outright (or not answering) while workers live, it leaves their
  namespace joinable by none: a worker started then is stranded and serves no environment
  (the reason logged) rather than mount theirs a second time;
- joining or making happens under `locks/namespace-FLEET.lock`, so two workers starting at once
  never make two namespaces (two mounts of one environment).

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
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from toolq.core.libc import libc
from toolq.workers.environments import locks as lock_files
from toolq.workers.environments import ns_holder

#: Whether this process joined its host's namespace: the host mounts with `userxattr` then.
_joined = False
_stranded = False
#: The members lock, held open for the life of the process (its pool children share it, and the
#: session host and MCP host get it too: `member_fds`).
_member_fd: int | None = None
_SOURCE: str | None = None
#: How long a worker waits for a holder's line or answer before it gives up (and copies).
WAIT = 10.0


class HalfJoined(SystemExit):
    """setns into the user namespace worked and into the mount namespace did not: the process
    cannot go back, and must not serve half inside (it exits, in one line)."""


def name_of(fleet: str) -> str:
    """The host's namespace files under `locks/` for one fleet (`agent.fleet_of`): two fleets
    sharing a root (a user's consecutive `toolq run`s, each with its own key) never meet."""
    return f"namespace-{fleet}"


def stranded() -> bool:
    """Whether this process found its host's workers in a namespace it cannot join (the holder
    gone, or not answering): it must then serve none of the host's environments, which it can
    neither see mounted nor mount again without mounting them twice."""
    return _stranded


def inside() -> bool:
    """Whether this process works in a host namespace of this module's making."""
    return _joined


def member_fds() -> tuple[int, ...]:
    """The members lock, for a process the worker starts that lives inside and must keep the
    namespace (the session host, the MCP host); never for a command."""
    return () if _member_fd is None else (_member_fd,)


def overflow_uid() -> int:
    try:
        return int(Path("/proc/sys/kernel/overflowuid").read_text())
    except (OSError, ValueError):
        return 65534


def plain_path(path: Path) -> bool:
    """Whether a path can go in overlay's options (a comma or colon would split them)."""
    return not any(c in str(path) for c in ",:\\\n")


def why_not(root: Path) -> str | None:
    """Why this process cannot work in a host namespace, or None."""
    if os.geteuid() == 0:
        return "root mounts in the host's own namespace"
    if os.getuid() == overflow_uid():
        return (f"uid {os.getuid()} is the kernel's overflow uid, which every other user's files and processes "
                "would read as in a user namespace: run workers as a user of their own")
    if threading.active_count() > 1:
        return "the worker already has threads"
    if not plain_path(root):
        return f"{root} cannot be named in overlay's options"
    return None


def enter(root: Path, key: bytes, fleet: str) -> str:
    """Join the host's namespace under `root` (the environments' root) for `fleet`, making it if
    there is none; `key` is the fleet key's `host_namespace_key`. Returns what was done, for the
    worker's log: "joined", "made", or why not (the worker then stays where it is and its
    environments are copies, or, stranded, it serves none). Raises `HalfJoined`."""
    global _joined, _member_fd, _stranded
    if _joined:
        return "joined"
    root = root.absolute()
    reason = why_not(root)
    if reason is not None:
        return reason
    name = name_of(fleet)
    locks = root / "locks"
    holder = None
    try:
        locks.mkdir(parents=True, exist_ok=True, mode=0o700)
        with lock_files.locked(locks / f"{name}.lock"):
            made, refused = False, ""
            try:
                namespaces = _ask_holder(root, name, key)
            except (OSError, RuntimeError) as e:  # a holder that does not prove the key, or is silent
                namespaces, refused = None, f" ({' '.join(str(e).split())})"
            if namespaces is None:
                if members_left(root, fleet):
                    # Its workers still mount there: a second namespace would mount their
                    # environments a second time, over the same upper dirs.
                    _stranded = True
                    return (f"the host's namespace cannot be joined while workers still use it{refused}: stop the "
                            "host's workers, then start them again")
                holder = _start_holder(root, name, key)
                made = True
                namespaces = _ask_holder(root, name, key)
                if namespaces is None:
                    raise RuntimeError("the namespace's new holder did not answer")
            try:
                _setns(namespaces)
            finally:
                for fd in namespaces:
                    os.close(fd)
            member = os.open(locks / f"{name}-members.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(member, fcntl.LOCK_SH)  # inherited by the pool children: released with the last
        _joined, _member_fd = True, member
        return "made" if made else "joined"
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        if holder is not None:  # nobody will join it: end it now rather than leave it to its check
            _end(holder)
        return f"no host namespace ({' '.join(str(getattr(e, 'strerror', None) or e).split())})"


def members_left(root: Path, fleet: str) -> bool:
    """Whether a worker of `fleet` holds its share of the namespace's members lock under `root`
    (called under the namespace's lock, where no other worker takes it; and by a root worker,
    which must not mount again an environment that such workers hold mounted)."""
    path = root / "locks" / f"{name_of(fleet)}-members.lock"
    if not path.exists():
        return False
    # Through lock_files: asked on the agent's threads, and a pool child forked meanwhile must not
    # keep this probe's lock, which would read as members for the child's whole life.
    with lock_files.locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as free:
        return not free


def _ask_holder(root: Path, name: str, key: bytes) -> list[int] | None:
    """The holder's user and mount namespaces (descriptors), or None where no holder listens.
    Both sides prove the key: a process that took the socket's name is never joined."""
    locks = os.open(root / "locks", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as conn:
            conn.settimeout(WAIT)
            try:
                conn.connect(f"/proc/self/fd/{locks}/{name}.sock")
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
        raise RuntimeError("what answers on the namespace's socket does not prove this fleet's key")
    return fds


def _holder_source() -> str:
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = Path(ns_holder.__file__).read_text()
    return _SOURCE


def _line(proc: subprocess.Popen, deadline: float) -> str:
    """The holder's next line on stdout, or "" at its end or the deadline."""
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        return ""
    return proc.stdout.readline().decode(errors="replace").strip()


def _start_holder(root: Path, name: str, key: bytes) -> int:
    """Start a holder for `root` (its own session: it outlives this worker while others live).
    It asks for its key once it is out of its user's reach; then it says "ready"."""
    proc = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-c", _holder_source(), str(root), name],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/",
        env={"PATH": "/usr/bin:/bin"}, start_new_session=True, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None
    deadline = time.monotonic() + WAIT
    said = _line(proc, deadline)
    if said == "key":
        try:
            proc.stdin.write(key.hex().encode() + b"\n")
            proc.stdin.close()
        except OSError:
            pass  # it died: its line says why
        said = _line(proc, deadline)
    proc.stdout.close()
    if said != "ready":
        _end(proc.pid)
        raise RuntimeError(said or "the namespace's holder did not start")
    tmp = root / "locks" / f"{name}.pid.{os.getpid()}"
    tmp.write_text(f"{proc.pid}\n")  # for its operator: the process to look for
    os.replace(tmp, root / "locks" / f"{name}.pid")
    # Not waited for by this process: it is the host's, and outlives it while other workers live
    # (it becomes a child of init when this worker exits).
    proc.returncode = 0
    return proc.pid


def _end(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _setns(namespaces: list[int]) -> None:
    """Into the user namespace, then the mount namespace. A failure of the first changes nothing
    (OSError); of the second, the process is half in (`HalfJoined`)."""
    user, mnt = namespaces
    cwd = os.getcwd()  # setns(mnt) moves the cwd to the namespace's root; the same path is there
    if libc.setns(user, ns_holder.CLONE_NEWUSER) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(user): {os.strerror(err)}")
    if libc.setns(mnt, ns_holder.CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise HalfJoined(f"toolq worker: joined its host's user namespace but not its mount namespace "
                         f"({os.strerror(err)}); not serving half inside")
    try:
        os.chdir(cwd)
    except OSError:  # not in the first worker's view of the files: the worker starts from / anyway
        os.chdir("/")
