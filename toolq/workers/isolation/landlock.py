"""Landlock (Linux >= 5.13): the fallback sandbox where user namespaces are not allowed.

Unprivileged and inherited by every descendant: files (read the system directories and the
workspace, write the workspace and the call's private temporary directory), TCP bind/connect
(ABI >= 4) and signals to processes outside the sandbox (ABI >= 6). A Landlock-confined process
also cannot ptrace, so `/proc/<worker>/mem` and `environ` stay closed. The ruleset is built in
the worker for each call; the child only calls `landlock_restrict_self` before exec.

Landlock confines TCP only; with the network off, a seccomp filter also refuses socket(2) for
every family and io_uring (which creates and connects sockets without socket(2)). Unix sockets
always (the network on too): Landlock does not confine connecting to a pathname socket, so a
command could reach the worker's session host, a Redis unix socket, `docker.sock` or systemd's
private socket anywhere on the host. Pipes and `socketpair(2)` still work.

Nor does Landlock confine a file's metadata: `chmod`, `chown`, `utime` and extended attributes
work on any file the command's uid owns, wherever it is (as root, every file of the host's root).
The filter sends the first three to the worker (`metadata.py`), which makes each call itself when
its target lies in the command's writable roots, and refuses extended attributes (ACLs) outright.

Of /etc, only the allowlisted entries are granted (`Policy.etc`), and beneath the read directories
what other users may not read (`Policy.hidden`) is left out: a rule grants a whole hierarchy, so
its parents are granted entry by entry around it (descriptors kept per process).

Limits of this backend, compared with bubblewrap: `.git/` inside the workspace stays writable
(Landlock rules only add rights, beneath a directory), a command cannot listen on a unix socket
of its own (Python's multiprocessing forkserver and managers need one), and `/tmp` itself is not
writable (TMPDIR points at the call's own directory).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import struct

from toolq.core.libc import PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS
from toolq.core.libc import libc as _libc
from toolq.workers.isolation import cell_init

_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "riscv64": (444, 445, 446)}
CREATE, ADD_RULE, RESTRICT = _SYSCALLS.get(platform.machine(), (444, 445, 446))
_VERSION_FLAG = 1
_RULE_PATH_BENEATH = 1


def _last_capability() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


_CAP_LAST = _last_capability()

# access rights (include/uapi/linux/landlock.h)
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = EXECUTE | READ_FILE | READ_DIR
FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE
#: Device nodes a command may use (reading all of /dev would let root read raw disks).
DEVICES = {"/dev/null": READ_FILE | WRITE_FILE | TRUNCATE, "/dev/zero": READ_FILE, "/dev/full": READ_FILE | WRITE_FILE,
           "/dev/random": READ_FILE, "/dev/urandom": READ_FILE}



def _syscall(*args: int | bytes | None) -> int:
    ret = _libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def abi_version() -> int:
    """The kernel's Landlock ABI, 0 when it has none (or it is disabled)."""
    try:
        return _syscall(CREATE, None, 0, _VERSION_FLAG)
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            return 0
        raise


def handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    return rights


def confine_syscalls(deny_sockets: bool) -> int:
    """On this thread (and what it spawns), the filter every sandboxed command runs under
    (`cell_init.seccomp_program`: no setuid modes, no user namespaces, no io_uring, no keyrings),
    with `deny_sockets` no socket(2) either, else no Unix socket; the metadata calls Landlock does
    not confine wait for the worker (`metadata.py`). Returns the listener they wait on, which the
    caller hands to `metadata.watch`. Needs no_new_privs first."""
    code = cell_init.seccomp_program(deny_sockets, deny_unix=True, metadata=True)
    if code is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {platform.machine()}")
    listener = cell_init.install_seccomp(code, listener=True)
    assert listener is not None
    return listener


@functools.lru_cache(maxsize=64)
def _granted(top: str, hidden: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    """The rules that grant reading `top` but nothing in `hidden`: (path, listing only). A rule
    grants a whole hierarchy, so each parent of a hidden path is listed only and its other
    entries granted one by one. Symlinks are left out: a target is checked by its own hierarchy.
    Cached per process (the system directories do not change under a worker)."""
    if not any(h.startswith(top.rstrip("/") + "/") for h in hidden):
        return ((top, False),)
    try:
        entries = [e.path for e in os.scandir(top) if not e.is_symlink() and e.path not in hidden]
    except OSError:
        return ()
    return ((top, True), *(g for path in sorted(entries) for g in _granted(path, hidden)))


@functools.cache
def _pinned(path: str) -> tuple[int, bool]:
    """An O_PATH descriptor of a granted system path, kept for the process's life (opening the
    ~150 entries of /etc for every call cost ~1.3 ms), and whether it is a directory; -1 if gone."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return -1, False
    return fd, os.path.isdir(path)


class Ruleset:
    """One call's ruleset, as an fd the child hands to `landlock_restrict_self`."""

    def __init__(self, abi: int, *, read: list[str], write: list[str], deny_tcp: bool,
                 hidden: tuple[str, ...] = ()) -> None:
        """`hidden`: paths beneath `read` that stay unreadable (a rule grants a whole hierarchy,
        so their parents are granted entry by entry instead)."""
        fs = handled_fs(abi)
        net = NET_BIND_TCP | NET_CONNECT_TCP if deny_tcp and abi >= 4 else 0
        scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
        self.deny_sockets = deny_tcp
        #: Where the command may change modes, owners and times (`metadata.py`), links resolved.
        self.writable = tuple(os.path.realpath(p) for p in write)
        attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
        self.fd = _syscall(CREATE, attr, len(attr), 0)
        try:
            for path in read:
                if not hidden:
                    self._allow(path, READ & fs)
                # By where it leads: a rule on /lib -> usr/lib grants /usr/lib, hidden paths and all.
                for granted, listing_only in _granted(os.path.realpath(path), hidden) if hidden else ():
                    self._add_rule(*_pinned(granted), READ_DIR & fs if listing_only else READ & fs)
            for path, rights in DEVICES.items():
                self._allow(path, rights & fs)
            for path in write:
                self._allow(path, fs)
        except BaseException:
            self.close()
            raise

    def _allow(self, path: str, rights: int) -> None:
        try:
            target = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            self._add_rule(target, os.path.isdir(path), rights)
        finally:
            os.close(target)

    def _add_rule(self, target: int, is_dir: bool, rights: int) -> None:
        if target < 0:
            return
        rule = struct.pack("=Qi", rights if is_dir else rights & FILE_ONLY, target)
        _syscall(ADD_RULE, self.fd, _RULE_PATH_BENEATH, rule, 0)

    def restrict_self(self) -> int:
        """In the child, before exec (or in a thread that then spawns it): from here on this
        process and its descendants are confined. Returns the metadata listener
        (`confine_syscalls`), close-on-exec.

        A root worker's command also loses every capability at exec (an empty bounding set):
        with CAP_SYS_PTRACE it could still read `/proc/<worker>/mem` through Landlock."""
        if os.geteuid() == 0:
            for cap in range(_CAP_LAST + 1):
                _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
            _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        _syscall(RESTRICT, self.fd, 0)
        return confine_syscalls(self.deny_sockets)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
