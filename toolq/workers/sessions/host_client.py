"""A pool child's side of the session host: send one request, wait for the reply, hang up on cancel."""

from __future__ import annotations

import base64
import os
import select
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from toolq.workers.sessions.protocol import OutputFrame, Reply, Request
from toolq.workers.unix_socket import connect_when_listening

if TYPE_CHECKING:
    from toolq.core.catalog import LiveOutput

SOCKET_ENV = "TOOLQ_SESSION_SOCKET"
#: The key a request must start with (`start.start` makes it; the host gets it on its stdin, the
#: pool children inherit it from the worker's memory). The socket's 0700 folder keeps other users
#: out, not the worker's own uid: a Landlock command runs as that uid and finds the socket in
#: `/proc/net/unix`, and the host must never start a command with a workspace it did not get
#: from its own worker.
_key: bytes | None = None


def set_key(key: bytes | None) -> None:
    global _key
    _key = key
STEP = 0.05
#: How long a request waits for a host the worker is restarting (a killed host is back in about a second).
HOST_RESTART_WAIT = 10.0
#: How a frame of streamed output starts (a reply never does).
_FRAME = b'{"progress":'


class HostUnavailable(Exception):
    """This worker has no session host (or it is gone): the request never reached it, nothing ran."""


class HostLost(HostUnavailable):
    """The host got the request and hung up before it answered: the command may have started."""


class Cancelled(Exception):
    """The call was cancelled while it waited; the host was told by the hang-up."""


def socket_path() -> str | None:
    return os.environ.get(SOCKET_ENV) or None


def _connect(path: str, is_cancelled: Callable[[], bool], wait: float) -> socket.socket:
    """A connection to the host, waiting up to `wait` for one the worker is restarting (its
    watcher starts a new host on the same path when one dies)."""
    try:
        sock = connect_when_listening(path, wait, is_cancelled, STEP)
    except OSError as e:
        raise HostUnavailable(f"the session host does not answer: {e}") from None
    if sock is None:
        raise Cancelled()
    return sock


def call(request: Request, is_cancelled: Callable[[], bool], timeout: float,
         output: LiveOutput | None = None, frames: Callable[[OutputFrame], None] | None = None) -> Reply:
    """`output`: where the frames of a streaming request go (and it is ticked while waiting);
    `frames`: who takes each frame whole instead (a front door's process, `process_start`)."""
    path = socket_path()
    if path is None:
        raise HostUnavailable("this worker runs no session host")
    sock = _connect(path, is_cancelled, min(timeout, HOST_RESTART_WAIT))
    try:
        try:
            # The host starts nothing before it has read the whole line: a send that failed was not heard.
            sock.sendall((_key or b"") + b"\n" + request.model_dump_json().encode() + b"\n")
        except OSError as e:
            raise HostUnavailable(f"the session host did not take the request: {e}") from None
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + STEP
        data = bytearray()
        while True:
            line, sep, rest = data.partition(b"\n")
            if sep and line.startswith(_FRAME):
                frame, data = OutputFrame.model_validate_json(bytes(line)), bytearray(rest)
                if frames is not None:
                    frames(frame)
                elif output is not None:
                    output.write(base64.b64decode(frame.progress))
                continue
            if sep:
                return Reply.model_validate_json(bytes(line))
            ready, _, _ = select.select([sock], [], [], STEP)
            if ready:
                try:
                    chunk = sock.recv(65536)
                except OSError as e:
                    raise HostLost(f"the session host dropped the connection before it answered ({e})") from None
                if not chunk:
                    raise HostLost("the session host hung up before it answered")
                data += chunk
            # Checked after a wait, not before the first: the call was found not cancelled just
            # before it started, and a command that ends at once costs no round trip. A stream of
            # frames still gets it checked every STEP.
            now = time.monotonic()
            if not ready or now >= next_check:
                next_check = now + STEP
                if is_cancelled() or now > deadline:
                    raise Cancelled()
            if output is not None:
                output.tick()
    finally:
        sock.close()  # before a reply, this is what kills a command that has not yielded


def output_text(reply: Reply) -> str:
    return base64.b64decode(reply.output).decode("utf-8", errors="replace")
