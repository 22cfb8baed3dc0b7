"""The process that holds a host's namespace for unprivileged overlays (`namespace.py`).

It reaches its process as `python -I -S -c SOURCE ROOT` with no environment but PATH: it imports
only the standard library and holds nothing (it stays dumpable, so that a worker of the same user
can open its `/proc/<pid>/ns/*` to join it). It makes a user namespace that maps the user to
itself and a mount namespace owned by it, says "ready" on stdout, and then only waits: every
`CHECK_EVERY` seconds, under `locks/namespace.lock`, it tries to take `locks/namespace-members.lock`
exclusively; once no worker holds its shared lock there, it removes `namespace.pid` and exits, and
the namespace and its mounts end with the last process in them.
"""

import ctypes
import fcntl
import os
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC, MS_SLAVE = 0x4000, 0x80000
CHECK_EVERY = 2.0


def main(root):
    # A worker's stop (SIGTERM, SIGINT, SIGHUP: `pkill toolq`, a terminal closed) is not the
    # host's: the holder leaves with the last worker, by its lock, and only then.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        print("unshare: " + os.strerror(ctypes.get_errno()), flush=True)
        return 1
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    # The host's mounts reach this namespace; its overlays never reach the host's.
    if libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) != 0:
        print("mount --make-rslave /: " + os.strerror(ctypes.get_errno()), flush=True)
        return 1
    locks = os.path.join(root, "locks")
    print("ready", flush=True)
    os.close(1)
    while True:
        time.sleep(CHECK_EVERY)
        ns = os.open(os.path.join(locks, "namespace.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        members = os.open(os.path.join(locks, "namespace-members.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(ns, fcntl.LOCK_EX)
            try:
                fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a worker still lives in the namespace
            try:
                with open(os.path.join(locks, "namespace.pid")) as f:
                    ours = f.read().split()[:1] == [str(os.getpid())]
            except OSError:
                ours = False
            if ours:
                os.unlink(os.path.join(locks, "namespace.pid"))
            return 0
        finally:
            os.close(members)
            os.close(ns)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
