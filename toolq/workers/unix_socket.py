"""Connecting to one of the worker's own host processes (the session host, the MCP host) over its
unix socket, waiting while the worker restarts it on the same path."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable

#: Errors of a connect while the host is restarting: its socket is not there yet, or not listening.
NOT_LISTENING = frozenset({errno.ENOENT, errno.ECONNREFUSED})


def connect_when_listening(path: str, wait: float, is_cancelled: Callable[[], bool],
                           poll: float) -> socket.socket | None:
    """A connection to `path`, waiting up to `wait` for a host that is restarting; None if
    `is_cancelled()` while it waits. Any other error, or one past `wait`, is raised."""
    end = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError as e:
            sock.close()
            if e.errno not in NOT_LISTENING or time.monotonic() + poll > end:
                raise
        if is_cancelled():
            return None
        time.sleep(poll)
