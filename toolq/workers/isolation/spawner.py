"""The thread that starts bubblewrap: a private copy of the mount namespace bwrap starts faster from.

bwrap copies its spawner's mount namespace and reads all of its mount table again at each bind;
a session-host slot thread, which only ever starts commands, prepares a smaller table once
(`prepare_spawning_thread`) and keeps it in step with the host's mounts (`follow_host_mounts`).
"""

from __future__ import annotations

import ctypes
import os
import threading

from toolq.workers.isolation.policy import Policy
from toolq.workers.isolation.reaper import _libc

_CLONE_NEWNS, _MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_SLAVE, _MNT_DETACH = (
    0x20000, 1, 2, 4, 32, 4096, 0x4000, 0x80000, 2)
#: Mount trees no sandbox binds from (`bwrap.argv` never names them) and, on a usual host, the biggest
#: ones (sysfs with its cgroup, bpf, security and trace file systems under it).
UNBOUND_TREES = ("/sys",)
#: What a thread prepared its namespace for (`prepare_spawning_thread`'s arguments).
_spawner = threading.local()


def prepare_spawning_thread(policy: Policy, masked: tuple[str, ...]) -> bool:
    """In the calling thread only: a private copy of the mount namespace that bwrap starts faster
    from, where it may (CAP_SYS_ADMIN; False and nothing changed elsewhere). The sandboxes it starts
    see the same; what changes is what bwrap copies and reads again at each of its ~20 binds (its
    whole mount table): no `UNBOUND_TREES` (those the policy reads from excepted; /sys held 13 of
    the 20 mounts here), and the file masks made once here instead of as 4 binds per sandbox: the
    recursive bind of /etc carries them, locked (a namespace made with a new user namespace cannot
    take apart what it copied), so `bwrap._masks` leaves them out. A spawning thread calls this once,
    before its first bwrap. Nothing flows back to the host: the copy is made a slave first, or
    nothing is mounted or unmounted."""
    trees = [t for t in UNBOUND_TREES if not any(d == t or d.startswith(t + "/") for d in policy.read_dirs)]
    if _libc.unshare(_CLONE_NEWNS) != 0:  # this thread's own namespace (and cwd) from now on
        return False
    _spawner.args = policy, masked
    if _libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        return False  # a copy still shared with the host's: a mount here would show there
    for tree in trees:
        _libc.umount2(tree.encode(), _MNT_DETACH)  # absent (not mounted here): nothing to hide
    for path in masked:
        if os.path.isfile(path) and not os.path.islink(path) and _libc.mount(
                b"/dev/null", path.encode(), None, _MS_BIND, None) == 0:
            _libc.mount(None, path.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)
    return True


def follow_host_mounts(workspace: str) -> None:
    """A prepared thread's copy of the mount table does not follow the host's where the host's
    mounts are private (no propagation): a workspace on a file system mounted since would be its
    empty mount point here (or, for a workspace made inside it since, no such directory). Then the
    copy is made again, from the process's own (its first thread's, as /proc/<pid>/ shows)."""
    args = getattr(_spawner, "args", None)
    if args is None:
        return
    try:
        own = os.stat(f"/proc/{os.getpid()}/root{workspace}")
    except OSError:
        return  # gone on the host: bwrap says so
    try:
        here = os.stat(workspace)
        if (here.st_dev, here.st_ino) == (own.st_dev, own.st_ino):
            return
    except OSError:
        pass  # only on a file system this copy does not have
    try:
        fd = os.open(f"/proc/{os.getpid()}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if _libc.setns(fd, _CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns to the host's mount namespace")
    finally:
        os.close(fd)
    _spawner.args = None
    prepare_spawning_thread(*args)
