"""A pool child's connection to the MCP host (`HostClient`) when the host dies and comes back,
against real Unix sockets with a stand-in host that answers one line per request."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from toolq.workers.mcp.backoff import Backoff
from toolq.workers.mcp.host_client import HostClient, HostGone, HostUnavailable
from toolq.workers.mcp.wire import CallReply, CallRequest, McpOutput
from toolq.workers.processes import CallCancelled

REQUEST = CallRequest(server="s", tool="t", arguments={}, digest="d", timeout=5)
OK = CallReply(result=McpOutput(output="ok")).model_dump_json().encode() + b"\n"


class StandIn:
    """A host on `path` that answers each request with OK, or reads one and dies (`die=True`)."""

    def __init__(self, path: Path, *, die: bool = False, after: float = 0.0) -> None:
        self.path, self.die = path, die
        self.listener: socket.socket | None = None
        self.connections: list[socket.socket] = []
        self.ready = threading.Event()
        threading.Thread(target=self._serve, args=(after,), daemon=True).start()

    def _serve(self, after: float) -> None:
        time.sleep(after)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(4)
        self.ready.set()
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for _ in lines:
                if self.die:
                    return
                conn.sendall(OK)

    def kill(self) -> None:
        """Gone as a SIGKILLed host is: listener and connections closed, the socket file left."""
        assert self.listener is not None
        for s in (self.listener, *self.connections):
            s.shutdown(socket.SHUT_RDWR)  # at once, whatever else holds the descriptor
            s.close()


def test_a_call_waits_for_a_host_that_is_restarting(tmp_path):
    path = tmp_path / "host.sock"
    StandIn(path, after=0.3)
    started = time.monotonic()
    assert HostClient(str(path)).call(REQUEST, lambda: False, wait=5).result.output == "ok"
    assert 0.25 < time.monotonic() - started < 3


def test_without_a_wait_a_missing_host_means_not_run(tmp_path):
    with pytest.raises(HostUnavailable, match="MCP host is not running") as e:
        HostClient(str(tmp_path / "host.sock")).call(REQUEST, lambda: False, wait=0)
    assert not isinstance(e.value, HostGone)


def test_a_cancel_stops_the_wait_for_the_host(tmp_path):
    started = time.monotonic()
    with pytest.raises(CallCancelled):
        HostClient(str(tmp_path / "host.sock")).call(REQUEST, lambda: time.monotonic() - started > 0.2, wait=10)
    assert time.monotonic() - started < 2


def test_a_host_that_dies_holding_the_call_says_it_may_have_run(tmp_path):
    path = tmp_path / "host.sock"
    StandIn(path, die=True).ready.wait(5)
    with pytest.raises(HostGone, match="exited during the call and is being restarted"):
        HostClient(str(path)).call(REQUEST, lambda: False, wait=0)


def test_a_connection_the_dead_host_left_is_made_anew_on_its_next_start(tmp_path):
    path = tmp_path / "host.sock"
    first = StandIn(path)
    first.ready.wait(5)
    client = HostClient(str(path))
    assert client.call(REQUEST, lambda: False, wait=0).result is not None
    first.kill()
    path.unlink()
    StandIn(path).ready.wait(5)
    # The kept connection's peer is gone: the request never reached a host, so it goes to the new one.
    assert client.call(REQUEST, lambda: False, wait=1).result.output == "ok"


def test_backoff_doubles_up_to_its_most_and_starts_over_after_a_long_run():
    b = Backoff(first=0.5, most=2.0, stayed_up=60)
    assert [b.after_crash(1) for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    assert b.after_crash(61) == 0.5
    assert b.after_crash(1) == 1.0
