"""The program inside a bubblewrap cell: it starts each command in a sandbox of its own, by fork.

A cell is one bwrap sandbox per session-host slot and workspace (`cell.py`), built once: the
system directories read-only, the workspace read-write with `.git` read-only, no network, its
`.git` checked by the start gate. This program is its first process, with the capabilities of
its own user namespace and nothing else of toolq: it imports only the standard library, and its
source reaches it as `python -I -S -c` (the toolq package need not be readable in the sandbox).

Per command (`serve`), one fork is pid 1 of a new pid namespace (`_init`). It takes new mount
and IPC namespaces, mounts a fresh `/tmp`, `/dev/shm`, `/dev/pts` and `/proc` (so the command
sees only its own processes), tells the worker its pid (SCM_CREDENTIALS: the kernel translates it into the
worker's namespace) and waits there while the worker sets its rlimits. Released, it drops every
capability, sets no_new_privs and starts the command as pid 2 (by vfork: no second copy of this
interpreter), then reaps until the command exits and exits with its status. When pid 1 of a
namespace exits the kernel kills all that is left in it, so nothing a command starts outlives
it (`setsid -f`, double forks). The cell reaps pid 1 and sends the worker its wait status.

Everything here runs before the command and trusts nothing the command can touch: the request
comes from the worker over a socket only this process holds.
"""

from __future__ import annotations

import array
import ctypes
import errno
import gc
import json
import os
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWIPC = 0x20000, 0x20000000, 0x8000000
_PR_SET_DUMPABLE = 4
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 0x4000, 1 << 18)
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_RECURSIVE, _O_CLOEXEC, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, 0o2000000, 4
_AT_EMPTY_PATH, _MOVE_MOUNT_T_EMPTY_PATH = 0x1000, 0x40
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 1, 2, 4
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
#: What a fresh /proc hides again, as bwrap's --proc does (uid 0 here passes a sysctl's check).
PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")
#: Fresh per command: each gets a private, empty /tmp (its HOME) and /dev/shm.
FRESH = ("/tmp", "/dev/shm")
#: The largest request (argv and environment) a command may have.
MAX_REQUEST = 64 << 20
#: The status sent when the command could not be started (what a shell says of a missing program).
NOT_STARTED = 127


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None = None) -> None:
    _check(_libc.mount(source, target.encode(), fstype, flags, data), f"mount {target}")


def _mounts() -> list[str]:
    """The mount points of this namespace, unescaped."""
    with open("/proc/self/mountinfo", "rb") as f:
        points = [line.split(b" ")[4] for line in f.read().splitlines()]
    return [p.decode("unicode_escape") if b"\\" in p else p.decode() for p in points]


def survivors() -> tuple[list[str], list[tuple[str, str]]]:
    """What bwrap put under the fresh directories (a workspace or a read directory under /tmp, a
    symlink to one): mount points, outermost first, and symlinks. Found once, at the cell's start;
    carried over the fresh mount by each command (`_carry`)."""
    points = sorted({p for p in _mounts() if any(p.startswith(f + "/") for f in FRESH)}, key=len)
    outer = [p for i, p in enumerate(points) if not any(p.startswith(q + "/") for q in points[:i])]
    links: list[tuple[str, str]] = []
    for top in FRESH:
        for where, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if os.path.join(where, d) not in outer]
            for name in dirs + files:
                path = os.path.join(where, name)
                if os.path.islink(path):
                    links.append((path, os.readlink(path)))
    return outer, links


def _carry(outer: list[str]) -> list[tuple[str, int]]:
    """A detached copy of each mount under a fresh directory, made before the fresh mount hides it."""
    return [(p, _check(_libc.syscall(_SYS_OPEN_TREE, -100, p.encode(), _OPEN_TREE_CLONE | _AT_RECURSIVE | _O_CLOEXEC),
                       f"open_tree {p}")) for p in outer]


def _mount_fresh(size: int, carried: list[tuple[str, int]], links: list[tuple[str, str]]) -> None:
    for path in FRESH:
        _mount(b"tmpfs", path, b"tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},mode=0755".encode())
    for path, tree in carried:
        os.makedirs(path, exist_ok=True)
        _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", -100, path.encode(), _MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount {path}")
        os.close(tree)
    for path, target in links:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)


def _mount_devpts() -> None:
    """Its own pseudo-terminals (`script`, `tmux`, `ssh -t`), as bwrap's --dev gives each sandbox."""
    _mount(b"devpts", "/dev/pts", b"devpts", _MS_NOSUID | _MS_NOEXEC, b"newinstance,ptmxmode=0666,mode=620")


def private_proc_files(proc: str = "/proc") -> list[str]:
    """The files at the top of /proc only their owner (root) may read: `timer_list`, `slabinfo`,
    `vmallocinfo`, `pagetypeinfo`... A root worker's command is uid 0 without capabilities, which
    the kernel's check of most of them does not ask for (kernel addresses, allocator state: what
    an exploit needs). Covered with /dev/null in every bubblewrap sandbox."""
    found = []
    for entry in os.scandir(proc):
        try:
            if entry.is_file(follow_symlinks=False) and not entry.stat(follow_symlinks=False).st_mode & 0o004:
                found.append(entry.path)
        except OSError:
            continue
    return sorted(found)


def _mount_proc() -> None:
    _mount(b"proc", "/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for name in PROC_COVERS:
        path = f"/proc/{name}"
        if os.path.lexists(path):
            _mount(path.encode(), path, None, _MS_BIND | _MS_REC)
            _mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for path in private_proc_files():
        _mount(b"/dev/null", path, None, _MS_BIND)
        _mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def _drop_capabilities(last_cap: int) -> None:
    """No capability is left, in any set, none can come back (no_new_privs), and this process
    cannot be traced or read by the command it starts (not dumpable)."""
    prctl = _libc.prctl
    for cap in range(last_cap + 1):
        _check(prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "PR_CAPBSET_DROP")
    prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    _check(_libc.capset(header, bytes(24)), "capset")
    _check(prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    _check(prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")


#: Kernel keyrings are checked by uid, not by namespace: a root worker's command (uid 0) could
#: read the host root's keys, and a cell's commands share its user namespace's keyrings.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 8
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
_ENOSYS, _EPERM, _EACCES, _EOPNOTSUPP = 38, 1, 13, 95
_AF_UNIX = 1
_X32_SYSCALL_BIT = 0x40000000
#: Mode bits that would let another user run a file with its owner's rights (the owner of what a
#: root worker's command writes is the host's root).
PRIVILEGE_BITS = 0o6000
_O_CREAT, _O_TMPFILE = 0o100, 0o20000000
_CLONE_NEWUSER = 0x10000000
#: Per machine: syscall numbers (None: the architecture has no such call).
_NR: dict[str, dict[str, int | None]] = {
    "x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "io_uring_setup": 425, "io_uring_enter": 426,
               "io_uring_register": 427, "openat2": 437, "clone3": 435, "chmod": 90, "fchmod": 91,
               "fchmodat": 268, "fchmodat2": 452, "open": 2, "creat": 85, "openat": 257, "mkdir": 83,
               "mkdirat": 258, "mknod": 133, "mknodat": 259, "unshare": 272, "clone": 56, "socket": 41,
               "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320,
               "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260, "utime": 132, "utimes": 235,
               "futimesat": 261, "utimensat": 280, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190,
               "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "setxattrat": 463,
               "removexattrat": 466, "file_setattr": 469, "seccomp": 317, "prlimit64": 302,
               "ioctl": 16, "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144,
               "sched_setaffinity": 203, "sched_setattr": 314, "ioprio_set": 251, "socketpair": 53},
    "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "io_uring_setup": 425, "io_uring_enter": 426,
                "io_uring_register": 427, "openat2": 437, "clone3": 435, "chmod": None, "fchmod": 52,
                "fchmodat": 53, "fchmodat2": 452, "open": None, "creat": None, "openat": 56, "mkdir": None,
                "mkdirat": 34, "mknod": None, "mknodat": 33, "unshare": 97, "clone": 220, "socket": 198,
                "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294,
               "chown": None, "fchown": 55, "lchown": None, "fchownat": 54, "utime": None, "utimes": None,
               "futimesat": None, "utimensat": 88, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7,
               "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16, "setxattrat": 463,
               "removexattrat": 466, "file_setattr": 469, "seccomp": 277, "prlimit64": 261,
               "ioctl": 29, "setpriority": 140, "sched_setparam": 118, "sched_setscheduler": 119,
               "sched_setaffinity": 122, "sched_setattr": 274, "ioprio_set": 30, "socketpair": 199},
}
#: Refused outright, with ENOSYS so that programs fall back: the keyrings; io_uring (sockets past a
#: socket(2) filter); bpf, perf_event_open, userfaultfd and kexec, kernel attack surface no build
#: or test needs (Docker's default profile refuses them all too; perf_event_open and a user-mode
#: userfaultfd need no capability); openat2 and clone3, whose mode and flags sit in a struct a
#: filter cannot read (the C library falls back to openat and clone, which are checked below).
REFUSED = ("add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf",
           "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "openat2", "clone3")
#: (syscall, the argument holding the mode, the argument holding open's flags or None): refused
#: with EPERM when the mode asks for setuid or setgid (and, for open, the call may create).
MODE_ARGS = (("chmod", 1, None), ("fchmod", 1, None), ("fchmodat", 2, None), ("fchmodat2", 2, None),
             ("creat", 1, None), ("mkdir", 1, None), ("mkdirat", 2, None), ("mknod", 1, None),
             ("mknodat", 2, None), ("open", 2, 1), ("openat", 3, 2))
#: (syscall, the argument holding its flags): refused with EPERM when it asks for a new user
#: namespace, where a command would hold every capability again (mounts, nf_tables...).
NAMESPACE_ARGS = (("unshare", 0), ("clone", 0))
#: The metadata calls Landlock does not confine, on any path: with `metadata`, the chmod calls
#: (past the setuid check) and these go to the worker's supervisor (`metadata.py`), which makes
#: them itself, inside the command's writable roots only.
SUPERVISED = ("chown", "fchown", "lchown", "fchownat", "utime", "utimes", "futimesat", "utimensat")
#: Under Landlock, calls that name another process by pid work on the caller only (argument
#: index of the pid); the worker is a process of the same uid beside the command. A pid other
#: than 0 goes to the worker's supervisor, which lets it through when it is the calling thread's
#: own id or its process's (`pthread_setaffinity_np(pthread_self())` passes a thread id).
OWN_PROCESS_ONLY = (("prlimit64", 0), ("sched_setparam", 0), ("sched_setscheduler", 0), ("sched_setaffinity", 0),
                    ("sched_setattr", 0))
#: (call, the `which` naming one process): with any other `which` (a group, a user), refused:
#: `setpriority(PRIO_USER, 0, 19)` would renice the worker too; a `who` other than 0 goes to the
#: supervisor, as above.
WHO_SELF_ONLY = (("setpriority", 0), ("ioprio_set", 1))
#: ioctl requests that change an inode (flags, version, project, verity, encryption, ext4
#: migration) refused under Landlock: they need only a descriptor open for reading.
FILE_IOCTLS = (0x40086602, 0x40046602, 0x401C5820, 0x40087602, 0x40047602, 0x40806685, 0x800C6613, 0x6609)
_SOCK_DGRAM, _SOCK_RAW, _SOCK_TYPE_MASK = 2, 3, 0xF  # AF_UNIX makes a RAW socket a datagram one
#: Refused with EOPNOTSUPP under Landlock (ACLs and extended attributes are not supported there;
#: `cp -a` and tar skip them quietly): an ACL would grant another user a host file.
NO_ATTRIBUTES = ("setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setxattrat",
                 "removexattrat", "file_setattr")


def seccomp_program(deny_sockets: bool = False, machine: str | None = None, *, deny_unix: bool = False,  # noqa: C901
                    metadata: bool = False) -> bytes | None:  # one BPF program, its blocks in the order they run
    """The BPF filter every sandboxed command runs under (cells, bubblewrap per command, Landlock);
    None on an architecture not listed. A syscall of a foreign ABI (i386, x32) is refused too: it
    could reach the same calls by other numbers. `deny_sockets`: socket(2) fails with EACCES
    (Landlock with the network off); `deny_unix`: only for AF_UNIX (Landlock with the network on:
    it does not confine connecting to a socket by its path, the session host's included).
    `metadata`: `SUPERVISED` and chmod go to a user-notification listener, `NO_ATTRIBUTES` fail,
    and prlimit(2) works on the caller only (Landlock: the worker is a process of the same uid, in
    the same pid namespace, whose limits a command lowered). `machine`: this one's unless given
    (`uname -m`)."""
    machine = machine or os.uname().machine
    if machine not in _NR:
        return None
    nr = {k: v for k, v in _NR[machine].items() if v is not None}
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, JSET, BPF_RET|K
    alu_and = 0x54  # BPF_ALU|BPF_AND|BPF_K

    def arg(i: int) -> tuple[int, int, int, int]:  # the low 32 bits of argument i (little endian)
        return (ld, 0, 0, 16 + 8 * i)

    deny, eperm = (ret, 0, 0, _SECCOMP_RET_ERRNO | _ENOSYS), (ret, 0, 0, _SECCOMP_RET_ERRNO | _EPERM)
    allow = (ret, 0, 0, _SECCOMP_RET_ALLOW)
    program = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH[machine]), (ret, 0, 0, _SECCOMP_RET_KILL_PROCESS), (ld, 0, 0, 0)]
    if machine == "x86_64":  # x32 syscalls share the arch: refuse them all
        program += [(jge, 0, 1, _X32_SYSCALL_BIT), deny]
    eacces = (ret, 0, 0, _SECCOMP_RET_ERRNO | _EACCES)
    notify = (ret, 0, 0, SECCOMP_RET_USER_NOTIF)
    if deny_sockets:
        program += [(jeq, 0, 1, nr["socket"]), eacces]
    for name in REFUSED:
        program += [(jeq, 0, 1, nr[name]), deny]
    for name in NO_ATTRIBUTES if metadata else ():
        program += [(jeq, 0, 1, nr[name]), (ret, 0, 0, _SECCOMP_RET_ERRNO | _EOPNOTSUPP)]
    for name in SUPERVISED if metadata else ():
        if name in nr:
            program += [(jeq, 0, 1, nr[name]), notify]
    # Each block below reads an argument, so it ends with a verdict instead of falling through.
    if metadata:
        # Landlock has no pid namespace: another process of the uid (the worker) is in reach by pid.
        for name, pid in OWN_PROCESS_ONLY:
            program += [(jeq, 0, 4, nr[name]), arg(pid), (jeq, 1, 0, 0), notify, allow]
        for name, which in WHO_SELF_ONLY:  # (which, who): this process only
            program += [(jeq, 0, 7, nr[name]), arg(0), (jeq, 1, 0, which), eperm, arg(1), (jeq, 1, 0, 0), notify,
                        allow]
        # Inode flags and the like, on any file the command can open (Landlock checks the open only).
        codes = FILE_IOCTLS
        program += [(jeq, 0, len(codes) + 3, nr["ioctl"]), arg(1),
                    *[(jeq, len(codes) - i, 0, code) for i, code in enumerate(codes)],
                    allow, (ret, 0, 0, _SECCOMP_RET_ERRNO | _EOPNOTSUPP)]
        # A datagram socket pair sends to any socket by its path (`sendto`): /dev/log, systemd's.
        # (A stream or seqpacket pair is connected: an address given to sendto is ignored.)
        program += [(jeq, 0, 8, nr["socketpair"]), arg(0), (jeq, 0, 5, _AF_UNIX), arg(1),
                    (alu_and, 0, 0, _SOCK_TYPE_MASK), (jeq, 1, 0, _SOCK_DGRAM), (jeq, 0, 1, _SOCK_RAW), eacces,
                    allow]
    if deny_unix and not deny_sockets:
        program += [(jeq, 0, 4, nr["socket"]), arg(0), (jeq, 0, 1, _AF_UNIX), eacces, allow]
    for name, mode, flags in MODE_ARGS:
        if name not in nr:
            continue
        passed = notify if metadata and "chmod" in name else allow
        block = [arg(mode), (jset, 0, 1, PRIVILEGE_BITS), eperm, passed]
        if flags is not None:  # open's mode counts only when the call may create
            block = [arg(flags), (jset, 1, 0, _O_CREAT | _O_TMPFILE), allow, *block]
        program += [(jeq, 0, len(block), nr[name]), *block]
    for name, flags in NAMESPACE_ARGS:
        block = [arg(flags), (jset, 0, 1, _CLONE_NEWUSER), eperm, allow]
        program += [(jeq, 0, len(block), nr[name]), *block]
    program.append(allow)
    return b"".join(struct.pack("HBBI", *op) for op in program)


def install_seccomp(program: bytes | None, listener: bool = False) -> int | None:
    """`listener`: the filter notifies (`SECCOMP_RET_USER_NOTIF`); returns the listener's fd
    (close-on-exec, in this process), which must be served or closed: until then a notified call
    waits."""
    if program is None:
        return None
    filters = ctypes.create_string_buffer(program)
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(filters))
    if not listener:
        _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")
        return None
    nr = _NR[os.uname().machine]["seccomp"]
    if nr is None:  # every machine listed has it; seccomp_program returned None for the others
        raise OSError(errno.ENOSYS, "seccomp(2) is not known on this machine")
    return _check(_libc.syscall(ctypes.c_long(nr), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                                ctypes.c_long(_SECCOMP_FILTER_FLAG_NEW_LISTENER), ctypes.c_char_p(fprog)), "seccomp")


def _last_cap() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


# Git directories below the workspace's top (issue 24 item 7). A human's `git` in a folder obeys
# the repository it finds there (`core.fsmonitor`, hooks, a pager: commands git runs), so every
# git directory and `.git` file below the top is made read-only: by bwrap's binds when a sandbox
# starts per command (`bwrap.argv`), and in a cell before each command (`GitGuard`), so that a
# repository one command made cannot be changed by the next.

#: At most this many directory entries are looked at per search (the first search of a 20,000-file
#: workspace lists them all, ~15 ms; later ones list again only the folders changed since).
SCAN_ENTRIES = 200_000
#: At most this many git directories and `.git` files below the top are made read-only; with more
#: a command is refused (`TooManyGits`): the rest could not be protected.
GITS_MOST = 256
#: A folder whose ctime is this close to when it was listed is listed again on the next search:
#: a change in the same clock tick as the listing would leave its ctime as it was.
_RACY_NS = 1_000_000_000
_NO_GIT, _GIT_DIR, _GIT_FILE, _GIT_LINK = 0, 1, 2, 3
#: Paths this long are opened one component at a time (PATH_MAX is 4096 bytes with its NUL; a
#: character may be 4 bytes, so by characters the margin is wide).
_DEEP = 1000


class TooManyGits(Exception):
    """More git directories below the workspace's top than GITS_MOST."""


class GitScan:
    """The git directories and `.git` files below a workspace's top `.git` (what is inside a git
    directory is read-only with it), searched again cheaply: a folder is listed again only when
    its ctime changed (an entry made, removed or renamed in it; a command cannot set a ctime),
    else its last listing is used. Every `.git` that is not a link, the gitdir a `.git` file names
    and the target of a `.git` link, where they lie in the workspace. Links are never followed and
    other file systems never entered while searching; a folder that cannot be listed is skipped."""

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace.rstrip("/")  # folders are joined with "/": never the root itself
        self.top = self.workspace + "/.git"
        # folder -> (device, inode, ctime, when listed, subfolders, its `.git`, entries)
        self._folders: dict[str, tuple[int, int, int, int, tuple[str, ...], int, int]] = {}
        self.stopped = False
        """The last search stopped at SCAN_ENTRIES: folders beyond were not searched."""
        self.entries = 0

    def search(self) -> dict[str, tuple[int, int]]:
        """path -> (device, inode). Raises TooManyGits."""
        found: dict[str, tuple[int, int]] = {}
        folders: dict[str, tuple[int, int, int, int, tuple[str, ...], int, int]] = {}
        try:
            device = os.lstat(self.workspace).st_dev
        except OSError:
            self._folders = {}
            return found
        stack, seen, cached, lstat, racy = [self.workspace], 0, self._folders, os.lstat, _RACY_NS
        while stack and seen < SCAN_ENTRIES:
            folder = stack.pop()
            deep = len(folder) >= _DEEP  # by path the kernel would refuse it (ENAMETOOLONG)
            try:
                fd = self._open_deep(folder, os.O_RDONLY | os.O_DIRECTORY) if deep else None
            except OSError:
                continue
            try:
                st = os.fstat(fd) if fd is not None else lstat(folder)
                if st.st_dev != device or not stat.S_ISDIR(st.st_mode):
                    continue
                known = cached.get(folder)
                if known is None or known[1] != st.st_ino or known[2] != st.st_ctime_ns or \
                        known[0] != st.st_dev or known[3] - st.st_ctime_ns <= racy:
                    known = self._list(folder, st, fd)
                    if known is None:
                        continue
            except OSError:
                continue
            finally:
                if fd is not None:
                    os.close(fd)
            folders[folder] = known
            seen += known[6]
            kind = known[5]
            if kind:
                git = folder + "/.git"
                if kind == _GIT_DIR:
                    self._add(found, git, real=False)
                elif kind == _GIT_FILE:
                    self._add(found, git, real=False)
                    if gitdir := gitdir_named(git, self._open_deep if len(git) >= _DEEP else None):
                        self._add(found, os.path.join(folder, gitdir))
                else:
                    self._add(found, git)
                if len(found) > GITS_MOST:
                    raise TooManyGits(f"the workspace holds more than {GITS_MOST} git directories below its top "
                                      "(git repositories, .git files, their gitdirs): toolq cannot make them all "
                                      "read-only, so it runs no command here (docs/security.md)")
            stack += [folder + "/" + name for name in known[4]]
        self.stopped, self.entries = bool(stack), seen
        self._folders = folders
        return found

    def _open_deep(self, path: str, flags: int) -> int:
        """`path` below the workspace, opened one component at a time (past PATH_MAX, and
        following no link)."""
        parent, _, name = path[len(self.workspace):].rpartition("/")
        base = open_no_links(self.workspace, parent)
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
        finally:
            os.close(base)

    def _list(self, folder: str, st: os.stat_result,
              fd: int | None = None) -> tuple[int, int, int, int, tuple[str, ...], int, int] | None:
        listed = time.time_ns()
        subfolders: list[str] = []
        kind, count = _NO_GIT, 0
        try:
            with os.scandir(folder if fd is None else fd) as entries:
                for entry in entries:
                    count += 1
                    if entry.name == ".git":
                        if folder == self.workspace:
                            continue  # the top one: bound by bwrap and checked at the start gate
                        if entry.is_symlink():
                            kind = _GIT_LINK
                        elif entry.is_dir(follow_symlinks=False):
                            kind = _GIT_DIR  # not searched further: read-only whole
                        elif entry.is_file(follow_symlinks=False):
                            kind = _GIT_FILE
                    elif entry.is_dir(follow_symlinks=False):
                        subfolders.append(entry.name)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_ctime_ns, listed, tuple(subfolders), kind, count

    def _add(self, found: dict[str, tuple[int, int]], path: str, real: bool = True) -> None:
        path = os.path.realpath(path) if real else path
        top = self.top
        if path == top or path.startswith(top + "/") or not path.startswith(self.workspace + "/") or path in found:
            return
        # Its identity looked up from the workspace down without following any link: by path
        # (`realpath`, `lstat`), a folder above it swapped for a link in between gave a host
        # folder's identity, which the start gate then took for this one's (a red team's race).
        try:
            fd = open_no_links(self.workspace, path[len(self.workspace):])
        except OSError:
            return
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            found[path] = (st.st_dev, st.st_ino)


def gitdir_named(path: str, opener: Callable[[str, int], int] | None = None) -> str | None:
    """The `gitdir: ...` a `.git` file names (read without following links, its first 4 KiB).
    `opener`: how to open `path` (`GitScan._open_deep` past PATH_MAX)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = opener(path, flags) if opener is not None else os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.read(fd, 4096).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    first = head.split("\n", 1)[0].strip()
    return first[len("gitdir:"):].strip() or None if first.startswith("gitdir:") else None


def open_no_links(root: str | int, path: str) -> int:
    """An O_PATH descriptor of `path` beneath `root` (a path, or a descriptor of it), opened one
    component at a time without following any link (ELOOP on one)."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if isinstance(root, str) else os.dup(root)
    try:
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if i < len(parts) - 1 else 0)
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def bind_read_only(fd: int) -> None:
    """Mount the file or directory `fd` (O_PATH) names read-only over itself, by descriptor only:
    no path is looked up again, so nothing swapped in meanwhile (a link) can redirect it."""
    flags = _OPEN_TREE_CLONE | _AT_RECURSIVE | _AT_EMPTY_PATH | _O_CLOEXEC
    tree = _check(_libc.syscall(_SYS_OPEN_TREE, fd, b"", flags), "open_tree")
    try:
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID |
                                                        _MOUNT_ATTR_NODEV, 0, 0, 0))
        _check(_libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, attr, 32),
               "mount_setattr")
        _check(_libc.syscall(_SYS_MOVE_MOUNT, tree, b"", fd, b"", _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH),
               "move_mount")
    finally:
        os.close(tree)


class GitGuard:
    """In a cell: before each command, every git directory and `.git` file below the workspace's
    top that is not read-only yet (made by an earlier command) is bound read-only in the cell's
    mount namespace, which each later command's namespace copies. Each is opened without following
    links from the workspace down and bound by descriptor, so a parallel command that swaps a
    folder above it for a link gets nothing bound elsewhere (the next search finds what is there).
    A bound `.git` is a mount point in every command's namespace: it can be neither removed nor
    renamed, and a folder above it carries it along when renamed."""

    def __init__(self, workspace: str) -> None:
        self.scan = GitScan(workspace)
        self.refusal: str | None = None
        self._said = False

    def refresh(self) -> None:
        try:
            found = self.scan.search()
        except TooManyGits as e:
            self.refusal = str(e)
            return
        self.refusal = None
        if self.scan.stopped and not self._said:
            self._said = True
            print(f"toolq cell: searched {self.scan.entries} entries of {self.scan.workspace} for git directories "
                  "and stopped (SCAN_ENTRIES): any beyond are not made read-only", file=sys.stderr, flush=True)
        if not found:
            return
        try:
            root = os.open(self.scan.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            for path, identity in found.items():
                try:
                    fd = open_no_links(root, os.path.relpath(path, self.scan.workspace))
                except OSError:
                    continue  # gone, or a link on the way since the search: the next one sees what is there
                try:
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != identity or os.fstatvfs(fd).f_flag & os.ST_RDONLY:
                        continue  # replaced since the search, or read-only already
                    bind_read_only(fd)
                except OSError as e:
                    print(f"toolq cell: could not make {path!r} read-only: {e}", file=sys.stderr, flush=True)
                finally:
                    os.close(fd)
        finally:
            os.close(root)


def _init(stdio: list[int], gate: socket.socket, outer: list[str], links: list[tuple[str, str]], last_cap: int,
          seccomp: bytes | None, refusal: str | None = None) -> None:
    """pid 1 of the command's namespaces: set up, report, wait for the release, then start the
    command as pid 2 (pid 1 gets no signal it has no handler for: SIGXCPU at the CPU limit, a
    `kill` from inside) and reap until it exits. Exits with its status, as a shell reports one;
    the kernel then kills whatever the command left in the namespace. Never returns."""
    try:
        req = _request(gate)
        if refusal is not None:  # the worker's sandbox refusal: the command never starts
            gate.sendall(b"r" + refusal.encode())
            os._exit(NOT_STARTED)
        # IPC too: a System V segment outlives its processes, and must not outlive the call.
        _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC), "unshare")
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing mounted for the command shows in the cell
        _mount_fresh(req["tmp_size"], _carry(outer), links)
        _mount_proc()
        _mount_devpts()
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # in a full memory cgroup the kernel kills the command, not the cell
        os.chdir(req["cwd"])  # a missing working directory is the worker's spawn error, as in Popen
    except OSError as e:
        gate.sendall(b"e" + json.dumps([e.errno or 0, e.strerror or str(e)]).encode())
        os._exit(NOT_STARTED)
    creds = struct.pack("iII", os.getpid(), os.getuid(), os.getgid())
    gate.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
    if gate.recv(1) != b"1":
        os._exit(NOT_STARTED)  # the worker let go of the call before it started
    gate.close()
    for sig in range(1, signal.NSIG):  # a command's `kill -INT 1` must not run any handler of this interpreter's
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    try:
        _drop_capabilities(last_cap)
        install_seccomp(seccomp)
        argv, env = req["argv"], req["env"]
        program = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
        # vfork and exec (no copy of this interpreter); every other descriptor here is close-on-exec.
        actions: list[tuple] = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)]
        if req.get("ctty") and os.isatty(stdio[0]):
            # A tty session: its pty (the worker's, made for this command alone) becomes the
            # command's controlling terminal, its group the foreground one, so ^C written to it
            # sends SIGINT. The child opens it again after its setsid (glibc runs file actions
            # after it): a session leader with no terminal that opens one without O_NOCTTY takes
            # it, as a terminal emulator's TIOCSCTTY does. Its own pty: TIOCSTI on it reaches
            # only what reads it, the command itself.
            actions.append((os.POSIX_SPAWN_OPEN, 0, "/proc/self/fd/1", os.O_RDWR, 0))
        command = os.posix_spawn(program, argv, env, setsid=True, setsigdef=_DEFAULTED, file_actions=actions)
    except BaseException as e:  # after the worker's check that the program is there: a shell's 127
        _say(stdio, e)
        os._exit(NOT_STARTED)
    for fd in stdio:
        os.close(fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        if pid == command:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


#: Every signal a command starts with at its default (pid 1 ignores them; Python ignored SIGPIPE,
#: SIGXFSZ), but those no process may set and the C library's own (between 31 and SIGRTMIN).
_DEFAULTED = tuple(sig for sig in range(1, signal.NSIG)
                   if sig not in (signal.SIGKILL, signal.SIGSTOP) and not signal.SIGSYS < sig < signal.SIGRTMIN)


def _say(stdio: list[int], error: BaseException) -> None:
    try:
        os.write(stdio[2], f"toolq cell: the command could not start: {error}\n".encode(errors="replace"))
    except OSError:
        pass


def _request(gate: socket.socket) -> dict:
    """The command's request, as the worker writes it on the gate: its length, then JSON."""
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("I", data[:4])[0]:
        if len(data) >= 4 and struct.unpack("I", data[:4])[0] > MAX_REQUEST:
            raise ValueError("request too large")
        chunk = gate.recv(1 << 16)
        if not chunk:
            raise EOFError("the worker hung up")
        data += chunk
    return json.loads(data[4:])


def _receive(control: socket.socket) -> tuple[list[int], socket.socket] | None:
    """A command's descriptors (stdin, stdout, stderr, gate); None when the worker closed the cell."""
    msg, ancillary, _, _ = control.recvmsg(16, socket.CMSG_SPACE(4 * array.array("i").itemsize),
                                           socket.MSG_CMSG_CLOEXEC)
    if not msg:
        return None
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(fds) != 4:
        for fd in fds:
            os.close(fd)
        return [], control
    *stdio, gate = fds
    return stdio, socket.socket(fileno=gate)


def serve(control: socket.socket, workspace: str | None = None) -> None:
    """Commands as the worker sends them: each forked as pid 1 of a new pid namespace, and its
    wait status sent back on its gate once it is reaped.

    The gate, one socket per command: the worker writes the request; pid 1 answers `p` with its
    credentials (or `e` and `[errno, strerror]` when it cannot set up: the command never starts);
    the worker writes `1` to release it; the cell writes `s` and the wait status at the end."""
    # Nothing bwrap handed down (its gate's descriptors) may reach a command: only the control socket stays.
    os.closerange(3, control.fileno())
    os.closerange(control.fileno() + 1, 1 << 16)
    outer, links = survivors()
    last_cap = _last_cap()
    seccomp = seccomp_program()
    gc.freeze()  # a fork then copies fewer pages (the collector no longer writes to the old objects)
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    guard = GitGuard(workspace) if workspace else None
    if guard is not None:
        guard.refresh()  # what was there when the cell started, before its first command
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, gate)
    control.sendall(b"ready")
    while True:
        waitables: list[socket.socket | int] = [control, *running]
        ready, _, _ = select.select(waitables, [], [])
        for pidfd in [fd for fd in ready if fd in running]:
            pid, gate = running.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            os.close(pidfd)
            try:
                gate.sendall(b"s" + struct.pack("i", status))
            except OSError:
                pass  # the worker let go of the call
            gate.close()
        if control not in ready:
            continue
        received = _receive(control)
        if received is None:
            return  # the worker closed the cell
        stdio, gate = received
        if not stdio:
            continue
        if guard is not None:
            guard.refresh()  # what the commands before made
        # The next fork is pid 1 of a new pid namespace; then back, so the one after is not in it.
        _check(_libc.unshare(_CLONE_NEWPID), "unshare")
        pid = os.fork()
        if pid == 0:
            gc.disable()
            control.close()
            _init(stdio, gate, outer, links, last_cap, seccomp, guard.refusal if guard is not None else None)
        _check(_libc.setns(own_pid_ns, _CLONE_NEWPID), "setns")
        running[os.pidfd_open(pid)] = (pid, gate)
        for fd in stdio:
            os.close(fd)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2] if len(sys.argv) > 2 else None)
