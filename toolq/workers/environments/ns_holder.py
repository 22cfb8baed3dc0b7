"""The process that holds a host's namespace for unprivileged overlays (`namespace.py`).

Importing it runs nothing (the worker's side takes `mac`, `read_exactly`, the constants and the
file names from it). It reaches its process as `python -I -S -c SOURCE ROOT NAME`, with no
environment but PATH: it imports only the standard library. Whoever entered the namespace would
hold every capability in it, enough to mount over the code the workers load, so the holder:

- makes the namespace (a user namespace that maps the user to itself, a mount namespace owned by
  it) and makes itself not dumpable at once: its /proc files are then root's and no process of its
  user can ptrace it or open its `/proc/<pid>/ns/*`. Its maps are written through descriptors
  opened in between (access is checked at open). It refuses to go on if a tracer attached before;
- only then asks for its key ("key" on stdout; the worker writes it on stdin only after that line,
  so the key never waits in a pipe of a process its user could still inspect): the fleet key's
  derived `host_namespace_key`;
- listens on `locks/NAME.sock` and hands both namespaces' descriptors to a connection that proves
  the key (an HMAC of the holder's nonce), after proving it itself (an HMAC of the caller's);
- every `CHECK_EVERY` seconds, if it can take `locks/NAME.lock` at once, tries
  `locks/NAME-members.lock` exclusively; once no worker holds its shared lock there, it removes
  its socket and pid file and exits: the namespace and its mounts end with the last process in it.
"""

from __future__ import annotations

import ctypes
import fcntl
import hmac
import os
import select
import signal
import socket
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC, MS_SLAVE = 0x4000, 0x80000
PR_SET_DUMPABLE = 4
CHECK_EVERY = 2.0
#: How long one connection may take: a slow or silent one is dropped, never waited on.
SERVE_TIMEOUT = 1.0
NONCE = 32
KEY_BYTES = 32


def main(root: str, name: str) -> int:
    # A worker's stop (SIGTERM, SIGINT, SIGHUP: `pkill toolq`, a terminal closed) is not the
    # host's: the holder leaves with the last worker, by its lock, and only then.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    failed = _make_namespace()
    if failed:
        print(failed, flush=True)
        return 1
    print("key", flush=True)
    try:
        key = bytes.fromhex(sys.stdin.readline().strip())
    except ValueError:
        key = b""
    sys.stdin.close()
    if len(key) != KEY_BYTES:
        print("no key", flush=True)
        return 1
    namespaces = [os.open(f"/proc/self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC) for ns in ("user", "mnt")]
    locks = os.open(os.path.join(root, "locks"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = f"/proc/self/fd/{locks}/"  # short whatever the root's length (a socket path has 108 bytes)
    try:
        os.unlink(f"{name}.sock", dir_fd=locks)  # a holder's that died
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    server.bind(here + f"{name}.sock")
    server.listen(16)
    print("ready", flush=True)
    os.close(1)
    _serve_until_last(server, key, namespaces, locks, name)
    return 0


def _make_namespace() -> str:
    """The user and mount namespaces, this process out of its user's reach; or what failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    maps = [os.open(f"/proc/self/{m}", os.O_WRONLY | os.O_CLOEXEC) for m in ("setgroups", "uid_map", "gid_map")]
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return f"prctl(PR_SET_DUMPABLE): {os.strerror(ctypes.get_errno())}"
    if _tracer() != 0:  # attached in the moment before: it would keep its hold
        return "a process traces the holder"
    for fd, text in zip(maps, ("deny", f"{uid} {uid} 1", f"{gid} {gid} 1"), strict=True):
        os.write(fd, text.encode())
        os.close(fd)
    # The host's mounts reach this namespace; its overlays never reach the host's.
    if libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) != 0:
        return f"mount --make-rslave /: {os.strerror(ctypes.get_errno())}"
    return ""


def _serve_until_last(server: socket.socket, key: bytes, namespaces: list[int], locks: int, name: str) -> None:
    check_at = time.monotonic() + CHECK_EVERY
    while True:
        readable, _, _ = select.select([server], [], [], max(0.0, check_at - time.monotonic()))
        if readable:
            try:
                conn, _ = server.accept()
            except OSError:  # out of descriptors, a connection gone: the next one may do
                pass
            else:
                with conn:
                    _serve(conn, key, namespaces)
        if time.monotonic() >= check_at:  # whatever the traffic: a stream of connections keeps nothing alive
            if _last(locks, name):
                return
            check_at = time.monotonic() + CHECK_EVERY


def _serve(conn: socket.socket, key: bytes, namespaces: list[int]) -> None:
    """One worker's join: its proof, then ours with the namespaces. Anything else: nothing."""
    conn.settimeout(SERVE_TIMEOUT)
    try:
        nonce = os.urandom(NONCE)
        conn.sendall(nonce)
        got = read_exactly(conn, 32 + NONCE)
        if len(got) != 32 + NONCE or not hmac.compare_digest(got[:32], mac(key, b"join", nonce)):
            return
        socket.send_fds(conn, [mac(key, b"holder", got[32:])], namespaces)
    except OSError:
        return


def read_exactly(conn: socket.socket, n: int) -> bytes:
    """`n` bytes from `conn`, or fewer where it closed (the worker's side reads with this too)."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def mac(key: bytes, tag: bytes, nonce: bytes) -> bytes:
    return hmac.digest(key, tag + nonce, "sha256")


def _tracer() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def _last(locks: int, name: str) -> bool:
    """Whether no worker holds the namespace any more (then the socket and pid file are gone)."""
    ns = os.open(f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=locks)
    members = os.open(f"{name}-members.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=locks)
    try:
        try:  # at once: a worker holding it may be waiting on this process to answer its join
            fcntl.flock(ns, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        for leftover in (f"{name}.sock", f"{name}.pid"):
            try:
                os.unlink(leftover, dir_fd=locks)
            except FileNotFoundError:
                pass
        return True
    finally:
        os.close(members)
        os.close(ns)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
