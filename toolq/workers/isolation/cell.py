"""Bubblewrap cells: a session-host slot starts one bwrap sandbox per workspace and forks each
command inside it, instead of starting bwrap for every command.

A bwrap start costs ~6 ms of CPU here (the namespaces, ~20 binds each reading the whole mount
table again, exec), ~8.7 ms a call with toolq's gate; a fork in a cell ~3.5 ms. The command's
confinement is the same: the cell's root (built by `bwrap.argv`, its `.git` checked by the start
gate; every git directory below the top bound read-only before each command, `cell_init.GitGuard`),
and per command new mount and pid namespaces with their own `/tmp`, `/dev/shm` and `/proc`,
the rlimits set by the worker before the command runs, no capabilities, no_new_privs
(`cell_init.py`). The slot's cgroups hold the cell and its commands, as they held the commands.

A cell serves one workspace: a call for another one, or a workspace whose directory or `.git`
is no longer what the cell bound (made, removed or replaced since), gets a new cell. It lives as
long as its slot's thread (bwrap's --die-with-parent) or until replaced.
"""

from __future__ import annotations

import array
import errno
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolq.workers.isolation import bwrap, cell_init, limits
from toolq.workers.isolation.policy import Policy

#: Processes of a cell besides its commands: bwrap, its pid 1, the cell's program, a command's pid 1.
CELL_TASKS = 4
#: How long the worker waits for a cell to start, or a command to reach its gate.
START_TIMEOUT = 10.0
_SOURCE: str | None = None
#: The cell's command line: it reads its program (`cell_init.py`) from stdin, then serves.
BOOTSTRAP = ("import sys; source = sys.stdin.read(); "
             "exec(compile(source, 'toolq-cell', 'exec'), {'__name__': '__main__'})")
_slot_cell = threading.local()
#: `s` and the wait status, as the cell sends it on a command's gate.
STATUS_BYTES = 5


def _source() -> str:
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = Path(cell_init.__file__).read_text()
    return _SOURCE


Identity = tuple[int, int, int]


def _identity(path: str) -> Identity | None:
    """(device, inode, type) of `path` itself (a symlink is not followed)."""
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino, stat.S_IFMT(found.st_mode)


class Cell:
    """One bwrap sandbox for one workspace, started from the calling (slot) thread."""

    def __init__(self, bwrap_path: str, policy: Policy, workspace: str) -> None:
        self.workspace = workspace
        bwrap.placeholder_git(os.path.realpath(workspace))  # before its state: the cell binds it
        self.bound = self._state()
        control, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control = control
        # The program comes on stdin, so that its command line (what `ps` shows) stays short.
        # Its workspace, where it makes each git directory an earlier command made read-only.
        command = [os.path.realpath(sys.executable), "-I", "-S", "-c", BOOTSTRAP, str(child_end.fileno()),
                   os.path.realpath(workspace)]
        source_r, source_w = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = bwrap.spawn(
                lambda gate: [*limits.uid_ceiling_prefix(),  # the worker's bound on a user namespace's processes
                              *bwrap.argv(bwrap_path, policy, workspace, workspace, command, gate, cell=True)],
                lambda pid: None, pass_fds=(child_end.fileno(),), env={"PATH": "/usr/bin:/bin"}, stdin=source_r,
                stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
            os.close(source_r)
            source_r = -1
            with open(source_w, "wb", closefd=True) as f:
                source_w = -1
                f.write(_source().encode())
        except BaseException:
            control.close()
            raise
        finally:
            child_end.close()
            for fd in (source_r, source_w):
                if fd >= 0:
                    os.close(fd)
        control.settimeout(START_TIMEOUT)
        try:
            ready = control.recv(16)
        except OSError as e:
            self.close()
            raise OSError(f"the sandbox cell did not start: {e}") from None
        if ready != b"ready":
            self.close()
            raise OSError(f"the sandbox cell did not start (bwrap exit {self.proc.poll()})")
        control.settimeout(None)

    def _state(self) -> tuple[str, Identity | None, Identity | None]:
        """What the cell's binds depend on: where the workspace's path leads, that directory, and its `.git`."""
        real = os.path.realpath(self.workspace)
        return real, _identity(real), _identity(os.path.join(real, ".git"))

    def serves(self, workspace: str) -> bool:
        return workspace == self.workspace and self.proc.poll() is None and self._state() == self.bound

    def run(self, argv: list[str], env: dict[str, str], cwd: str, tmp_size: int, stdio: tuple[int, int, int],
            set_limits: Callable[[int], None], ctty: bool = False) -> CellProcess:
        """Start a command; it runs once `set_limits(pid)` returned. Raises OSError. `ctty`: stdin
        is the command's own pty, which it takes as its controlling terminal (`cell_init._init`)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.control.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", [*stdio, theirs.fileno()]))])
            request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "tmp_size": tmp_size, "ctty": ctty}).encode()
            mine.settimeout(START_TIMEOUT)
            mine.sendall(struct.pack("I", len(request)) + request)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        try:
            data, ancillary, _, _ = mine.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("iII")))
            pid = next((struct.unpack("iII", d[:12])[0] for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            if data.startswith(b"r"):  # refused (more git directories than it can make read-only)
                raise bwrap.GateRefused(data[1:].decode(errors="replace"))
            if data.startswith(b"e"):  # it could not set up (a missing working directory)
                errno, strerror = json.loads(data[1:])
                raise OSError(errno, strerror)
            if not data.startswith(b"p") or pid is None:  # it ended before its gate (or the cell did)
                return CellProcess(None, mine, data)
            process = CellProcess(pid, mine)
            try:
                set_limits(pid)
                mine.sendall(b"1")
            except BaseException:
                process.kill()
                process.wait()
                raise
            return process
        except BaseException:
            mine.close()
            raise

    def close(self) -> None:
        self.control.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class CellProcess:
    """A command in a cell, as `subprocess.Popen` shows one: `pid` (its namespace's pid 1, as this
    process sees it, and its process group), `poll`, `wait`, `kill`. Its status comes from the cell;
    it is killed through a pidfd, so a pid the kernel reused later is never signalled."""

    stdout = None

    def __init__(self, pid: int | None, gate: socket.socket, status: bytes = b"") -> None:
        self.pid = pid if pid is not None else -1
        self._gate = gate
        self._data = status
        self.returncode: int | None = None
        self._pidfd: int | None = None
        if pid is not None:
            self._pidfd = os.pidfd_open(pid)  # held at its gate: it cannot have exited yet
        self._lock = threading.Lock()
        if len(self._data) >= STATUS_BYTES:
            self._finish()

    def _finish(self) -> None:
        if len(self._data) >= STATUS_BYTES and self._data.startswith(b"s"):
            self.returncode = os.waitstatus_to_exitcode(struct.unpack("i", self._data[1:STATUS_BYTES])[0])
        else:  # the cell went away without a word: it was killed, and the command with it
            self.returncode = -signal.SIGKILL
        self._gate.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _read(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            self._gate.settimeout(timeout)
            try:
                while len(self._data) < STATUS_BYTES:
                    chunk = self._gate.recv(STATUS_BYTES - len(self._data))
                    if not chunk:
                        break
                    self._data += chunk
            except (TimeoutError, BlockingIOError):
                return
            except OSError:
                pass
            self._finish()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("cell command", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL its pid 1, and with it everything in its pid namespace."""
        with self._lock:
            if self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def slot_cell(bwrap_path: str, policy: Policy, workspace: str) -> Cell:
    """The calling slot thread's cell for `workspace`, started (or started again) when needed."""
    found: Cell | None = getattr(_slot_cell, "cell", None)
    if found is not None and found.serves(workspace):
        return found
    if found is not None:
        _slot_cell.cell = None
        found.close()
    cell = Cell(bwrap_path, policy, workspace)
    _slot_cell.cell = cell
    return cell


def close_slot_cell() -> None:
    found: Cell | None = getattr(_slot_cell, "cell", None)
    if found is not None:
        _slot_cell.cell = None
        found.close()


def spawn(bwrap_path: str, policy: Policy, workspace: str, argv: list[str], env: dict[str, str], workdir: str,
          set_limits: Callable[[int], None], **popen: Any) -> CellProcess:
    """What `subprocess.Popen` would do with `popen`'s stdin/stdout/stderr (DEVNULL, PIPE, STDOUT,
    a descriptor), for a command in this slot thread's cell, run in `workdir`. A cell command is
    always in a session of its own, with no other descriptor (the rest of `popen` says no more)."""
    opened: list[int] = []

    def fd_for(value: Any, default: int) -> int:
        if value is None:
            return default
        if value == subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
            return opened[-1]
        return value.fileno() if hasattr(value, "fileno") else int(value)

    reader = None
    ctty = bool(popen.get("ctty"))
    try:
        stdin = fd_for(popen.get("stdin"), 0)
        out = popen.get("stdout")
        if out == subprocess.PIPE:
            reader, writer = os.pipe2(os.O_CLOEXEC)
            opened.append(writer)
            stdout = writer
        else:
            stdout = fd_for(out, 1)
        err = popen.get("stderr")
        stderr = stdout if err == subprocess.STDOUT else (fd_for(err, 2) if err != subprocess.PIPE else 2)

        def start() -> CellProcess:
            return slot_cell(bwrap_path, policy, workspace).run(
                argv, env, workdir, policy.limits.memory_mb * 1024 * 1024, (stdin, stdout, stderr), set_limits,
                ctty)

        try:
            try:
                process = start()
            except (BrokenPipeError, ConnectionResetError):
                close_slot_cell()  # the cell died since it was last checked: once more with a new one
                process = start()
        except TimeoutError:
            close_slot_cell()  # a cell that does not answer serves no later command either
            raise OSError(errno.ETIMEDOUT, "the sandbox cell did not start the command in time") from None
    except BaseException:
        if reader is not None:
            os.close(reader)
        raise
    finally:
        for fd in opened:
            os.close(fd)
    if reader is not None:
        process.stdout = os.fdopen(reader, "rb", buffering=0)  # type: ignore[assignment]
    return process
