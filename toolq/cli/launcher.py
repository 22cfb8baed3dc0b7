"""A warm fleet's launcher: the process `toolq run` forks from (its client: toolq/cli/launch.py).

A child process of `toolq up --foreground`. It imports the run path once, then waits on its
socket with no thread, connection or event loop (a fork copies only the thread that forks). For
each caller it forks a child that becomes the caller's `toolq run`: the caller's standard
streams, arguments, environment, directory and umask. The child reports its own exit status; the
launcher reports a child killed by a signal, and kills the child of a caller that hung up.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import selectors
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from toolq.cli import launch
from toolq.cli.launch import COMMANDS, KEY_NAME, MAX_REQUEST, SOCKET_NAME, peer_uid, python_identity


class Launcher:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / SOCKET_NAME
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, tuple[socket.socket, int]] = {}
        """pidfd -> (the caller's connection, the child's pid)"""
        self.python = python_identity(os.environ)
        self.key = secrets.token_hex(32)

    def listen(self) -> socket.socket:
        """The key first, then the socket: a client that finds the socket finds the key."""
        key_path = self.root / KEY_NAME
        key_path.unlink(missing_ok=True)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.key)
        self.path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            server.bind(str(self.path))
        finally:
            os.umask(old)
        server.listen(64)
        return server

    def serve(self, server: socket.socket, stop: Any) -> None:
        """Until `stop()` is true: take requests, fork their children, report their ends."""
        self.selector.register(server, selectors.EVENT_READ, "accept")
        while not stop():
            for key, _ in self.selector.select(timeout=0.5):
                if key.data == "accept":
                    self._take(server)
                else:
                    self._ended(key.fd)

    def _take(self, server: socket.socket) -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            if peer_uid(conn) != os.geteuid():
                raise ValueError("another user")
            payload, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, 3)
            request = json.loads(payload)
            key = request.get("key")
            if not isinstance(key, str) or not hmac.compare_digest(key.encode(), self.key.encode()):
                raise ValueError("no key")  # dropped before anything else of it is looked at
            if len(fds) != 3 or request.get("python") != self.python or request["argv"][0] not in COMMANDS:
                raise ValueError("not for this launcher")
            pid = os.fork()
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            _send_quietly(conn, {"refused": True})
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        if pid == 0:
            self._become(conn, fds, request)  # never returns
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (conn, pid)
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        self.selector.register(conn, selectors.EVENT_READ, "caller")
        _send_quietly(conn, {"pid": pid})

    def _ended(self, fd: int) -> None:
        if fd in self.children:  # a child exited: tell its caller how (a child that exits says so itself)
            conn, pid = self.children.pop(fd)
            self.selector.unregister(fd)
            if conn.fileno() in self.selector.get_map():
                self.selector.unregister(conn)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                _send_quietly(conn, {"signal": os.WTERMSIG(status)})
            else:
                _send_quietly(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()
            return
        for conn, pid in self.children.values():  # a caller hung up (or wrote): it died
            if conn.fileno() == fd:
                try:
                    os.kill(pid, signal.SIGKILL)  # as if the run itself had been killed
                except ProcessLookupError:
                    pass
                self.selector.unregister(conn)
                return

    def _become(self, conn: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
        """In the child: turn into the caller's `toolq run`, then report its exit status itself (so
        the caller hears it even if the launcher is gone by then)."""
        launch.launched = True  # the run must not ask the launcher again
        code = 1
        try:
            os.setpgid(0, 0)  # out of the warm fleet's process group: its signals are not the run's
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            self.selector.close()
            for pidfd, (other, _) in self.children.items():
                os.close(pidfd)
                other.close()
            os.chdir(request["cwd"])
            os.umask(int(request["umask"]))
            os.environ.clear()
            os.environ.update(request["env"])
            sys.stdin, sys.stdout, sys.stderr = (os.fdopen(0, "r", closefd=False),
                                                 os.fdopen(1, "w", closefd=False),
                                                 os.fdopen(2, "w", closefd=False))
            sys.argv = ["toolq", *request["argv"]]
            from toolq.cli.main import main
            from toolq.core import import_path

            import_path.isolate()  # as the command line's own process does, in the caller's directory
            code = main(request["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # the ordinary command line would print it: so does this one
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # a reader that went away (`toolq run --json | head`)
                    pass
            _send_quietly(conn, {"exit": code})
            os._exit(code)


def _send_quietly(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the caller is gone


def serve(root: Path) -> int:
    """`python -m toolq.cli.launcher ROOT`: import the run path, then serve until SIGTERM."""
    from toolq.cli.main import RUNTIME_MODULES, import_quietly

    import_quietly(RUNTIME_MODULES["run"])
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    launcher = Launcher(root)
    server = launcher.listen()
    try:
        launcher.serve(server, lambda: bool(stopping))
    finally:
        launcher.path.unlink(missing_ok=True)
        (root / KEY_NAME).unlink(missing_ok=True)
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1])))
