"""The metadata calls Landlock does not confine, made by the worker on a command's behalf.

Landlock rules cover reading, writing, making and removing files, not their metadata: a confined
command may `chmod`, `chown` or `utime` any file its uid owns, wherever it lies. As a root
worker's command that is every root file of the host (`chmod 0666 /etc/shadow`); as an
unprivileged worker's, its user's own files (`chmod 0777 ~/.ssh`). No kernel facility checks a
path for these calls, so the command's seccomp filter hands them to this module
(`SECCOMP_RET_USER_NOTIF`), and a thread of the process that spawned the command answers each:

- it reads the path from the command's memory once, then resolves it itself, from the command's
  working directory or directory fd, without magic links (`/proc/self/...` would be the
  worker's); a path changed after the read is not what is resolved, nor looked up again;
- the resolved file, held by descriptor, must lie in one of the command's writable roots (its
  workspace, its temporary directory), belong to the command's uid and have no second name
  (a hard link may lie outside: a local `git clone` links its objects); then the worker makes the
  call on that descriptor, as the kernel would (a capability-less owner's rules: no setuid bit,
  an owner unchanged, a group the uid is in), and answers with its result;
- anything else fails with EPERM, which is what the command sees (`chmod: changing permissions
  of '/etc/passwd': Operation not permitted`).

Extended attributes and ACLs are refused in the filter itself (`cell_init.NO_ATTRIBUTES`).
One thread per process serves every command's listener, through epoll.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import select
import stat
import struct
import threading
from dataclasses import dataclass

from toolq.core.libc import libc as _libc
from toolq.workers.isolation import cell_init
from toolq.workers.workspace import RESOLVE_NO_MAGICLINKS, openat2

log = logging.getLogger("toolq.sandbox")

# struct seccomp_notif: id, pid, flags, then seccomp_data: nr, arch, instruction_pointer, args[6].
_NOTIF = struct.Struct("=QIIiIQ6Q")
# struct seccomp_notif_resp: id, val, error, flags.
_RESPONSE = struct.Struct("=QqiI")
_IOC_WRITE, _IOC_READ = 1, 2
_CONTINUE = 1  # SECCOMP_USER_NOTIF_FLAG_CONTINUE


def _ioc(direction: int, number: int, size: int) -> int:
    return direction << 30 | size << 16 | ord("!") << 8 | number


NOTIF_RECV = _ioc(_IOC_READ | _IOC_WRITE, 0, _NOTIF.size)
NOTIF_SEND = _ioc(_IOC_READ | _IOC_WRITE, 1, _RESPONSE.size)
NOTIF_ID_VALID = _ioc(_IOC_WRITE, 2, 8)
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_EMPTY_PATH = -100, 0x100, 0x1000
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
PATH_MAX = 4096
_UNCHANGED = 0xFFFFFFFF  # chown's "leave it" (-1 as an unsigned 32-bit id)
_TIMESPECS = struct.Struct("=qqqq")



class _Refused(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@dataclass(frozen=True)
class Command:
    """What one listener's commands may change: inside `writable` (links resolved), files of `uid`."""

    writable: tuple[str, ...]
    uid: int


def _signed(value: int) -> int:
    """An int argument (the low 32 bits, sign-extended): a directory fd or AT_FDCWD."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def _read_memory(pid: int, address: int, size: int) -> bytes:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, size, address)
    except OSError:
        raise _Refused(errno.EFAULT) from None
    finally:
        os.close(fd)
    if len(data) < size:
        raise _Refused(errno.EFAULT)
    return data


def _read_path(pid: int, address: int) -> bytes:
    """The NUL-terminated path at `address`, read page by page (the next page may be unmapped)."""
    if address == 0:
        raise _Refused(errno.EFAULT)
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        found = b""
        while len(found) < PATH_MAX:
            step = 4096 - (address + len(found)) % 4096
            try:
                chunk = os.pread(fd, step, address + len(found))
            except OSError:
                raise _Refused(errno.EFAULT) from None
            end = chunk.find(b"\0")
            if end >= 0:
                if len(found) + end >= PATH_MAX:  # as the kernel: PATH_MAX counts the NUL
                    break
                return found + chunk[:end]
            if not chunk:
                raise _Refused(errno.EFAULT)
            found += chunk
        raise _Refused(errno.ENAMETOOLONG)
    finally:
        os.close(fd)


#: /proc/{self,thread-self,PID}[/task/TID]/{fd/N,cwd}[/rest]
_OWN_MAGIC = re.compile(rb"/proc/(self|thread-self|[0-9]+)(?:/task/([0-9]+))?/(fd/([0-9]+)|cwd)(/.*)?\Z", re.S)


class _Call:
    """One notified call: the command's process and what it asked for."""

    def __init__(self, listener: int, notif_id: int, pid: int, args: tuple[int, ...]) -> None:
        self.listener, self.id, self.pid, self.args = listener, notif_id, pid, args

    def still_waiting(self) -> None:
        """The process that asked is still the one blocked in the call (its pid not reused):
        checked after each descriptor of it was opened, so each is the right process's."""
        try:
            fcntl.ioctl(self.listener, NOTIF_ID_VALID, struct.pack("=Q", self.id))
        except OSError:
            raise _Refused(errno.ESRCH) from None

    def fd_of(self, number: int) -> int:
        """The file the command's fd `number` (or its working directory, for AT_FDCWD) names."""
        where = f"/proc/{self.pid}/cwd" if number == AT_FDCWD else f"/proc/{self.pid}/fd/{number}"
        try:
            fd = os.open(where, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            raise _Refused(errno.EBADF) from None
        try:
            self.still_waiting()
        except BaseException:
            os.close(fd)
            raise
        return fd

    def own_magic_link(self, path: bytes) -> tuple[int, bytes] | None:
        """(fd number or AT_FDCWD, the rest) when `path` goes through one of the caller's own
        descriptors or its cwd in /proc (self, thread-self, its pid or tid): resolved as the
        caller's, never as the worker's. Another process's is not followed (that would be ELOOP)."""
        found = _OWN_MAGIC.match(path)
        if found is None:
            return None
        who, task, number, rest = found.group(1), found.group(2), found.group(4), found.group(5) or b""
        if who not in (b"self", b"thread-self"):
            tgid = self.thread_group()
            if int(who) not in (self.pid, tgid) or (task is not None and int(task) != self.pid):
                return None
        elif task is not None:
            return None
        return (int(number) if number is not None else AT_FDCWD), rest.lstrip(b"/")

    def thread_group(self) -> int:
        """The caller's process id (`pid` is its thread's)."""
        try:
            with open(f"/proc/{self.pid}/status", "rb") as status:
                for line in status:
                    if line.startswith(b"Tgid:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        raise _Refused(errno.ESRCH)

    def opened(self, number: int) -> int:
        """`fd_of` for fchmod and fchown, which need a descriptor opened for more than its path."""
        try:
            with open(f"/proc/{self.pid}/fdinfo/{number}", "rb") as info:
                flags = next(int(line.split()[1], 8) for line in info if line.startswith(b"flags:"))
        except (OSError, StopIteration, ValueError, IndexError):
            raise _Refused(errno.EBADF) from None
        if flags & os.O_PATH:
            raise _Refused(errno.EBADF)
        return self.fd_of(number)

    def target(self, dirfd: int, path_at: int, flags: int = 0, null_is_dirfd: bool = False) -> int:
        """An O_PATH fd of what the call names, resolved as the kernel would for the command but
        without magic links; the caller closes it."""
        if path_at == 0 and null_is_dirfd:  # futimens(fd): a descriptor, never the cwd
            if dirfd == AT_FDCWD:
                raise _Refused(errno.EFAULT)
            return self.fd_of(dirfd)
        path = _read_path(self.pid, path_at)
        self.still_waiting()  # the memory read was the asking process's
        if not path:
            if flags & AT_EMPTY_PATH:
                return self.fd_of(dirfd)
            raise _Refused(errno.ENOENT)
        own = self.own_magic_link(path)
        if own is not None:  # /proc/self/fd/N: glibc's fchmodat(AT_SYMLINK_NOFOLLOW) makes this call
            number, rest = own
            if not rest:
                return self.fd_of(number)
            base, path = self.fd_of(number), rest
        else:
            base = self.fd_of(dirfd) if not path.startswith(b"/") else os.open("/", os.O_PATH | os.O_CLOEXEC)
        follow = 0 if flags & AT_SYMLINK_NOFOLLOW == 0 else os.O_NOFOLLOW
        try:
            return openat2(base, os.fsdecode(path), os.O_PATH | os.O_CLOEXEC | follow, 0, RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            raise _Refused(e.errno or errno.EPERM) from None
        finally:
            os.close(base)


def _allowed(fd: int, command: Command, *, owner: bool = True) -> os.stat_result:
    """The file held by `fd` lies in a writable root and is the command's (`owner`); else EPERM."""
    where = os.readlink(f"/proc/self/fd/{fd}")
    inside = any(where == root or where.startswith(root.rstrip("/") + "/") for root in command.writable)
    if not inside or where.endswith(" (deleted)"):
        raise _Refused(errno.EPERM)
    st = os.fstat(fd)
    if owner and st.st_uid != command.uid:
        raise _Refused(errno.EPERM)
    if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
        # Another name may lie outside (a local `git clone` hard-links its objects): a mode made
        # here would open that file too. apply_patch never writes such a file either.
        raise _Refused(errno.EPERM)
    return st


def _may_write(st: os.stat_result, uid: int) -> bool:
    """The mode grants `uid` (a capability-less process of it, with this process's groups) write."""
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _chmod(fd: int, command: Command, mode: int) -> None:
    st = _allowed(fd, command)
    if stat.S_ISLNK(st.st_mode):
        raise _Refused(errno.EOPNOTSUPP)  # as Linux answers a link's mode
    os.chmod(f"/proc/self/fd/{fd}", mode & 0o7777 & ~cell_init.PRIVILEGE_BITS)


def _chown(fd: int, command: Command, uid: int, gid: int) -> None:
    st = _allowed(fd, command)
    uid, gid = uid & 0xFFFFFFFF, gid & 0xFFFFFFFF
    if uid not in (_UNCHANGED, st.st_uid):  # without CAP_CHOWN, an owner keeps its files
        raise _Refused(errno.EPERM)
    if gid not in (_UNCHANGED, st.st_gid) and gid not in (os.getegid(), *os.getgroups()):
        raise _Refused(errno.EPERM)
    _check(_libc.fchownat(fd, b"", ctypes.c_uint32(uid), ctypes.c_uint32(gid), AT_EMPTY_PATH))


def _utime(fd: int, command: Command, times: bytes | None) -> None:
    # Setting both times to now needs only write access: `touch` on a file of the workspace
    # another uid owns. Checked here by the mode bits, as for the command without capabilities:
    # a root worker's call below would pass the kernel's check whatever the mode.
    now = times is None or _TIMESPECS.unpack(times)[1::2] == (UTIME_NOW, UTIME_NOW)
    st = _allowed(fd, command, owner=not now)
    if now and st.st_uid != command.uid and not _may_write(st, command.uid):
        raise _Refused(errno.EACCES)
    buffer = ctypes.create_string_buffer(times, len(times)) if times is not None else None
    _check(_libc.utimensat(fd, b"", buffer, AT_EMPTY_PATH))


def _check(result: int) -> None:
    if result != 0:
        raise _Refused(ctypes.get_errno() or errno.EPERM)


def _times(call: _Call, name: str, at: int) -> bytes | None:
    """The times asked for, as `utimensat`'s two timespecs (None: now)."""
    if at == 0:
        return None
    if name == "utimensat":
        return _read_memory(call.pid, at, 32)
    if name == "utime":  # struct utimbuf: actime, modtime (seconds)
        actime, modtime = struct.unpack("=qq", _read_memory(call.pid, at, 16))
        return _TIMESPECS.pack(actime, 0, modtime, 0)
    sec_a, usec_a, sec_m, usec_m = struct.unpack("=qqqq", _read_memory(call.pid, at, 32))  # timeval[2]
    if not (0 <= usec_a < 1_000_000 and 0 <= usec_m < 1_000_000):
        raise _Refused(errno.EINVAL)
    return _TIMESPECS.pack(sec_a, usec_a * 1000, sec_m, usec_m * 1000)


#: The calls naming a process (cell_init.OWN_PROCESS_ONLY, WHO_SELF_ONLY) by the argument holding it.
_PROCESS_ARG = {**dict(cell_init.OWN_PROCESS_ONLY), **{name: 1 for name, _which in cell_init.WHO_SELF_ONLY}}


def own_thread(call: _Call, named: int) -> None:
    """`named` (the pid or tid the call names) is the calling thread itself or its process; else
    EPERM. The kernel then makes the call as asked (CONTINUE), looking the id up again: only these
    two ids cannot be handed to another process meanwhile, as the caller is blocked in the call. A
    sibling thread's id is refused: it may exit after the check and its id go to another process
    of the uid, which a command times by reading `ns_last_pid` (a red team's finding, reproduced
    on a root worker: a fresh process's limits lowered)."""
    if named not in (call.pid, call.thread_group()):
        raise _Refused(errno.EPERM)
    call.still_waiting()


def answer(call: _Call, name: str, command: Command) -> bool:
    """Make the call `name` for the command, or raise _Refused with the errno it gets. True: the
    kernel is to make it as the command asked (SECCOMP_USER_NOTIF_FLAG_CONTINUE)."""
    a = call.args
    if name in _PROCESS_ARG:
        own_thread(call, _signed(a[_PROCESS_ARG[name]]))
        return True
    if name in ("chmod", "fchmod", "fchmodat", "fchmodat2"):
        if name == "fchmod":
            fd, mode = call.opened(_signed(a[0])), a[1]
        elif name == "chmod":
            fd, mode = call.target(AT_FDCWD, a[0]), a[1]
        else:
            fd, mode = call.target(_signed(a[0]), a[1], a[3] if name == "fchmodat2" else 0), a[2]
        try:
            _chmod(fd, command, mode)
        finally:
            os.close(fd)
        return False
    if name in ("chown", "lchown", "fchown", "fchownat"):
        if name == "fchown":
            fd, owner = call.opened(_signed(a[0])), a[1:3]
        elif name == "fchownat":
            fd, owner = call.target(_signed(a[0]), a[1], a[4]), a[2:4]
        else:
            fd, owner = call.target(AT_FDCWD, a[0], AT_SYMLINK_NOFOLLOW if name == "lchown" else 0), a[1:3]
        try:
            _chown(fd, command, *owner)
        finally:
            os.close(fd)
        return False
    # utime(path, buf), utimes(path, tv), futimesat(dirfd, path, tv), utimensat(dirfd, path, ts, flags)
    if name in ("utime", "utimes"):
        fd, times_at = call.target(AT_FDCWD, a[0]), a[1]
    else:
        flags = a[3] if name == "utimensat" else 0
        fd, times_at = call.target(_signed(a[0]), a[1], flags, null_is_dirfd=True), a[2]
    try:
        _utime(fd, command, _times(call, name, times_at))
    finally:
        os.close(fd)
    return False


class Supervisor:
    """The thread that answers every notified call of this process's Landlock commands."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._commands: dict[int, Command] = {}
        self._lock = threading.Lock()
        names = cell_init._NR.get(os.uname().machine, {})
        self._names = {number: name for name, number in names.items() if number is not None}
        threading.Thread(target=self._serve, name="toolq-landlock-metadata", daemon=True).start()

    def watch(self, listener: int, command: Command) -> None:
        """Serve `listener` (this module closes it once no process is left under its filter)."""
        with self._lock:
            self._commands[listener] = command
        self._epoll.register(listener, select.EPOLLIN)

    def _serve(self) -> None:
        while True:
            try:
                events = self._epoll.poll()
            except InterruptedError:
                continue
            for listener, mask in events:
                if mask & select.EPOLLIN:
                    self._answer_one(listener)
                elif mask & (select.EPOLLHUP | select.EPOLLERR):
                    self._forget(listener)

    def _forget(self, listener: int) -> None:
        with self._lock:
            self._commands.pop(listener, None)
        try:
            self._epoll.unregister(listener)
        except OSError:
            pass
        os.close(listener)

    def _answer_one(self, listener: int) -> None:
        buffer = bytearray(_NOTIF.size)  # zeroed, as the kernel requires
        try:
            fcntl.ioctl(listener, NOTIF_RECV, buffer, True)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EINTR):  # ENOENT: the caller was killed meanwhile
                log.warning("landlock metadata listener failed: %s", e)
                self._forget(listener)
            return
        notif_id, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buffer)
        command = self._commands.get(listener)
        code, flags = errno.EPERM, 0
        try:
            if command is not None and nr in self._names:
                go_on = answer(_Call(listener, notif_id, pid, tuple(args)), self._names[nr], command)
                code, flags = 0, _CONTINUE if go_on else 0
        except _Refused as e:
            code = e.code
        except OSError as e:
            code = e.errno or errno.EPERM
        except Exception:  # the thread must outlive any one bad call
            log.exception("landlock metadata call failed")
        try:
            fcntl.ioctl(listener, NOTIF_SEND, _RESPONSE.pack(notif_id, 0, -code, flags))
        except OSError:
            pass  # the caller is gone


_supervisor: Supervisor | None = None
_started = threading.Lock()


def _forked() -> None:
    """A child has no supervisor thread, and a lock held across fork stays held in it."""
    global _supervisor, _started
    _supervisor, _started = None, threading.Lock()


os.register_at_fork(after_in_child=_forked)


def watch(listener: int, writable: tuple[str, ...]) -> None:
    """Serve a just-spawned command's listener: its chmod, chown and utime calls within
    `writable`, as this process's uid (the command's)."""
    global _supervisor
    with _started:
        if _supervisor is None:
            _supervisor = Supervisor()
        supervisor = _supervisor
    supervisor.watch(listener, Command(writable, os.geteuid()))
