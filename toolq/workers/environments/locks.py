"""The host's flock files, which a fork does not carry off.

An flock belongs to the open file description and lives while any descriptor of it is open. The
environments agent takes its locks on threads of the worker's main process, and that process also
forks the Celery pool's children (billiard, `os.fork`). A child forked while a lock was held kept a
copy of its descriptor (O_CLOEXEC closes it at exec, not at fork), and with it the lock, for the
child's whole life: the environment's next destroy waited for ever, and so did the reaper on the
agent's request loop, after which the host answered no request. So every lock file's descriptor is
registered while it is open, and a forked child closes those first."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_open: set[int] = set()
#: Held across a lock file's open and registration, its unregistration and close, and each fork:
#: no fork falls between the two, so the child knows every descriptor it must close.
_guard = threading.Lock()


def _close_in_child() -> None:
    for fd in _open:
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy: the parent's lock stays the parent's
    _open.clear()
    _guard.release()


os.register_at_fork(before=_guard.acquire, after_in_parent=_guard.release, after_in_child=_close_in_child)


@contextlib.contextmanager
def locked(path: Path, how: int = fcntl.LOCK_EX) -> Iterator[bool]:
    """flock `path` (made if missing); with LOCK_NB in `how`, yields False if it is held."""
    with _guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _open.add(fd)
    try:
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        with _guard:
            if fd in _open:  # not in a child forked inside the `with`, which closed its copy already
                _open.discard(fd)
                os.close(fd)
