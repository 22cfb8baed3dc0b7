"""A process's connection to the worker's MCP host (`host.py`, `wire.py`): one per process, kept
from call to call (re-made after a fork), one request at a time.

The host may be restarting (`launch.py`): a request then waits for it to listen again, up to
what the caller allows. A request the host got and never answered (it died) may have partly
run, and says so; one the host never got (a connection it closed when it died) is sent again.
"""

from __future__ import annotations

import io
import os
import select
import socket
import time
from collections.abc import Callable

from pydantic import BaseModel

from toolq.workers.mcp.wire import CallReply, CallRequest, Listing, ListRequest
from toolq.workers.processes import CallCancelled
from toolq.workers.unix_socket import connect_when_listening

#: How often a child waiting on a call checks whether the turn or the call was cancelled.
CANCEL_POLL = 0.25

#: How often a request waiting for a restarting host tries to connect again.
RECONNECT_POLL = 0.05



class HostUnavailable(Exception):
    """The host did not get the request: nothing ran."""


class HostGone(HostUnavailable):
    """The host got the request and died before it answered: the call may have partly run."""


class HostClient:
    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._file: io.BufferedReader | None = None
        self._pid = 0

    def _connection(self, wait: float, is_cancelled: Callable[[], bool]) -> socket.socket:
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        try:
            sock = connect_when_listening(self.path, wait, is_cancelled, RECONNECT_POLL)
        except OSError as e:
            raise HostUnavailable(f"the worker's MCP host is not running ({e.strerror})") from None
        if sock is None:
            raise CallCancelled()
        self._sock, self._pid, self._file = sock, os.getpid(), sock.makefile("rb")
        return sock

    def close(self) -> None:
        """Closing the connection mid-call is what makes the host cancel the call."""
        if self._sock is not None and self._pid == os.getpid():
            assert self._file is not None
            self._file.close()  # the socket's descriptor stays open while its file does
            self._sock.close()
        self._sock = self._file = None

    def _send(self, line: bytes, wait: float, is_cancelled: Callable[[], bool]) -> socket.socket:
        for _ in range(2):
            sock = self._connection(wait, is_cancelled)
            try:
                sock.sendall(line)
                return sock
            except OSError as e:  # EPIPE: a connection the host closed when it died; its next start gets it
                self.close()
                error = e
        raise HostUnavailable(f"the worker's MCP host is not reachable ({error})")

    def _ask(self, request: BaseModel, is_cancelled: Callable[[], bool], wait: float) -> bytes:
        sock = self._send(request.model_dump_json().encode() + b"\n", wait, is_cancelled)
        answered = False
        try:
            while not select.select([sock], [], [], CANCEL_POLL)[0]:
                if is_cancelled():
                    raise CallCancelled()  # closing the connection is what cancels the call
            assert self._file is not None
            line = self._file.readline()
            answered = bool(line)
        except OSError:
            line = b""
        finally:
            if not answered:  # cancelled, timed out (SoftTimeLimitExceeded), host gone: the host cancels
                self.close()
        if not line:
            raise HostGone("the worker's MCP host exited during the call and is being restarted")
        return line

    def listing(self, timeout: float | None = None) -> Listing:
        end = None if timeout is None else time.monotonic() + timeout
        late = (lambda: time.monotonic() > end) if end is not None else (lambda: False)
        try:
            return Listing.model_validate_json(self._ask(ListRequest(), late, wait=timeout or 0.0))
        except CallCancelled:
            raise HostUnavailable(f"the worker's MCP host did not answer in {timeout}s") from None

    def call(self, request: CallRequest, is_cancelled: Callable[[], bool], wait: float) -> CallReply:
        """`wait`: how long to wait for a host that is restarting."""
        return CallReply.model_validate_json(self._ask(request, is_cancelled, wait))
