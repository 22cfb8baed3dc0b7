"""The process that holds a host's namespace for unprivileged overlays (`namespace.py`).

Importing it runs nothing (the worker's side takes `mac`, `read_exactly` and `NONCE` from it). It
reaches its process as `python -I -S -c SOURCE ROOT`, with no environment but PATH, and its key
(the fleet key's derived `host_namespace_key`, hex) as the first line of stdin: it imports only the
standard library. It is not dumpable, so no process of its user can ptrace it or open its
`/proc/<pid>/ns/*`: the namespace's user namespace is the user's own, and whoever entered it would
hold every capability there, enough to mount over the code the workers load. It makes a user
namespace that maps the user to itself and a mount namespace owned by it, listens on
`locks/namespace.sock`, says "ready" on stdout, and then serves: to a connection that proves the
key (an HMAC of the holder's nonce), and after proving it itself (an HMAC of the caller's), it
hands both namespaces' descriptors. Every `CHECK_EVERY` seconds, if it can take
`locks/namespace.lock` at once, it tries `locks/namespace-members.lock` exclusively; once no
worker holds its shared lock there, it removes its socket and pid file and exits, and the
namespace and its mounts end with the last process in them.
"""

import ctypes
import fcntl
import hmac
import os
import select
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC, MS_SLAVE = 0x4000, 0x80000
PR_SET_DUMPABLE = 4
CHECK_EVERY = 2.0
NONCE = 32


def main(root):
    # A worker's stop (SIGTERM, SIGINT, SIGHUP: `pkill toolq`, a terminal closed) is not the
    # host's: the holder leaves with the last worker, by its lock, and only then.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    # Not dumpable as soon as the namespace exists: its /proc files then belong to root, so its
    # own maps are written through descriptors opened in between (access is checked at open).
    # Those few microseconds are the one moment a process of the user could open /proc/<pid>/ns/user.
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return _fail("unshare")
    maps = [os.open(f"/proc/self/{name}", os.O_WRONLY | os.O_CLOEXEC) for name in ("setgroups", "uid_map", "gid_map")]
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return _fail("prctl(PR_SET_DUMPABLE)")
    for fd, text in zip(maps, ("deny", f"{uid} {uid} 1", f"{gid} {gid} 1"), strict=True):
        os.write(fd, text.encode())
        os.close(fd)
    key = bytes.fromhex(sys.stdin.readline().strip())
    sys.stdin.close()
    # The host's mounts reach this namespace; its overlays never reach the host's.
    if libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) != 0:
        return _fail("mount --make-rslave /")
    namespaces = [os.open(f"/proc/self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC) for ns in ("user", "mnt")]
    locks = os.open(os.path.join(root, "locks"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = f"/proc/self/fd/{locks}/"  # short whatever the root's length (a socket path has 108 bytes)
    try:
        os.unlink("namespace.sock", dir_fd=locks)  # a holder's that died
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    server.bind(here + "namespace.sock")
    server.listen(16)
    print("ready", flush=True)
    os.close(1)
    while True:
        readable, _, _ = select.select([server], [], [], CHECK_EVERY)
        if readable:
            conn, _ = server.accept()
            with conn:
                _serve(conn, key, namespaces)
        elif _last(locks):
            return 0


def _serve(conn, key, namespaces):
    """One worker's join: its proof, then ours with the namespaces. Anything else: nothing."""
    conn.settimeout(5)
    try:
        nonce = os.urandom(NONCE)
        conn.sendall(nonce)
        got = read_exactly(conn, 32 + NONCE)
        if len(got) != 32 + NONCE or not hmac.compare_digest(got[:32], mac(key, b"join", nonce)):
            return
        socket.send_fds(conn, [mac(key, b"holder", got[32:])], namespaces)
    except OSError:
        return


def read_exactly(conn, n):
    """`n` bytes from `conn`, or fewer where it closed (the worker's side reads with this too)."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def mac(key, tag, nonce):
    return hmac.digest(key, tag + nonce, "sha256")


def _last(locks):
    """Whether no worker holds the namespace any more (then the socket and pid file are gone)."""
    ns = os.open("namespace.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=locks)
    members = os.open("namespace-members.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=locks)
    try:
        try:  # at once: a worker holding it may be waiting on this process to answer its join
            fcntl.flock(ns, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        for name in ("namespace.sock", "namespace.pid"):
            try:
                os.unlink(name, dir_fd=locks)
            except FileNotFoundError:
                pass
        return True
    finally:
        os.close(members)
        os.close(ns)


def _fail(what):
    print(f"{what}: {os.strerror(ctypes.get_errno())}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
