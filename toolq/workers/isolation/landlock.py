"""Landlock (Linux >= 5.13): the fallback sandbox where user namespaces are not allowed.

Unprivileged and inherited by every descendant: files (read the system directories and the
workspace, write the workspace and the call's private temporary directory), TCP bind/connect
(ABI >= 4) and signals to processes outside the sandbox (ABI >= 6). A Landlock-confined process
also cannot ptrace, so `/proc/<worker>/mem` and `environ` stay closed. The ruleset is built in
the worker for each call; the child only calls `landlock_restrict_self` before exec.

Landlock confines TCP only; with the network off, a seccomp filter also refuses every socket
that is not AF_UNIX (UDP, raw, netlink), as Codex's Landlock sandbox does.

Limits of this backend, compared with bubblewrap: `.git/` inside the workspace stays writable
(Landlock rules only add rights, beneath a directory), pathname unix sockets are not confined,
and `/tmp` itself is not writable (TMPDIR points at the call's own directory).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

_SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "riscv64": (444, 445, 446)}
CREATE, ADD_RULE, RESTRICT = _SYSCALLS.get(platform.machine(), (444, 445, 446))
_VERSION_FLAG = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4


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

# seccomp: the architecture and socket(2)'s number, per machine
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}.get(platform.machine())
_NR_SOCKET = {"x86_64": 41, "aarch64": 198}.get(platform.machine())
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_AF_UNIX = 1
_X32_SYSCALL_BIT = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


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


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _socket_filter() -> bytes:
    """BPF: socket(family != AF_UNIX) fails with EACCES; so does every syscall of a foreign ABI
    (i386, x32), which could reach socket(2) by another number."""
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EACCES
    prog = [
        (ld, 0, 0, 4),                   # 0: arch
        (jeq, 1, 0, _AUDIT_ARCH),        # 1: native -> 3
        (ret, 0, 0, deny),               # 2
        (ld, 0, 0, 0),                   # 3: syscall number
        (jge, 3, 0, _X32_SYSCALL_BIT),   # 4: x32 -> 8
        (jeq, 0, 3, _NR_SOCKET),         # 5: socket -> 6, else -> 9
        (ld, 0, 0, 16),                  # 6: args[0], the family (low 32 bits)
        (jeq, 1, 0, _AF_UNIX),           # 7: AF_UNIX -> 9
        (ret, 0, 0, deny),               # 8
        (ret, 0, 0, allow),              # 9
    ]
    return b"".join(struct.pack("HBBI", *insn) for insn in prog)


def deny_network_sockets() -> None:
    """On this thread (and what it spawns); needs no_new_privs first."""
    if _AUDIT_ARCH is None or _NR_SOCKET is None:
        raise OSError(errno.ENOSYS, f"no socket filter for {platform.machine()}")
    code = _socket_filter()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


class Ruleset:
    """One call's ruleset, as an fd the child hands to `landlock_restrict_self`."""

    def __init__(self, abi: int, *, read: list[str], write: list[str], deny_tcp: bool) -> None:
        fs = handled_fs(abi)
        net = NET_BIND_TCP | NET_CONNECT_TCP if deny_tcp and abi >= 4 else 0
        scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0
        self.deny_sockets = deny_tcp
        attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
        self.fd = _syscall(CREATE, attr, len(attr), 0)
        try:
            for path in read:
                self._allow(path, READ & fs)
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
            if not os.path.isdir(path):
                rights &= FILE_ONLY
            rule = struct.pack("=Qi", rights, target)
            _syscall(ADD_RULE, self.fd, _RULE_PATH_BENEATH, rule, 0)
        finally:
            os.close(target)

    def restrict_self(self) -> None:
        """In the child, before exec: from here on this process and its descendants are confined.

        A root worker's command also loses every capability at exec (an empty bounding set):
        with CAP_SYS_PTRACE it could still read `/proc/<worker>/mem` through Landlock."""
        if os.geteuid() == 0:
            for cap in range(_CAP_LAST + 1):
                _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
            _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        _syscall(RESTRICT, self.fd, 0)
        if self.deny_sockets:
            deny_network_sockets()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
