"""MCP servers on a worker: start the host, put its tools in the catalog, forward calls to it.

The worker's main process starts the host (`host.py`) before Celery forks its pool, and puts
each server's tools in the catalog as namespaced function tools whose handler is `Forward`; pool
children inherit both. Before a child runs an MCP call it asks the host for the current listing
(`sync`), so a tool list that changed since the fork is what `execute` checks the call's
declaration digest against. The main process follows the listing too, for the fleet catalog
(`follow.py`).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from toolq.orchestrator.calls import ToolName
from toolq.orchestrator.errors import ConfigurationError, RespondToModel, ToolTimedOut
from toolq.workers.catalog import Catalog, ToolContext, ToolReturn
from toolq.workers.mcp.config import BASIC_ENV, McpServerConfig
from toolq.workers.mcp.specs import mcp_queue, tool_spec
from toolq.workers.mcp.wire import CallReply, CallRequest, Listing, ListRequest
from toolq.workers.sandbox import CallCancelled

log = logging.getLogger("toolq.worker")

#: How often a child waiting on a call checks whether the turn or the call was cancelled.
CANCEL_POLL = 0.25


class HostUnavailable(Exception):
    pass


class HostClient:
    """One connection to the host per process (re-made after a fork), one request at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._pid = 0

    def _connection(self) -> socket.socket:
        if self._sock is None or self._pid != os.getpid():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                raise HostUnavailable(f"the worker's MCP host is not running ({e.strerror})") from None
            self._sock, self._pid, self._file = sock, os.getpid(), sock.makefile("rb")
        return self._sock

    def close(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()
        self._sock = None

    def _ask(self, request: BaseModel, is_cancelled: Callable[[], bool] = lambda: False) -> bytes:
        sock = self._connection()
        answered = False
        try:
            sock.sendall(request.model_dump_json().encode() + b"\n")
            while not select.select([sock], [], [], CANCEL_POLL)[0]:
                if is_cancelled():
                    raise CallCancelled()  # closing the connection is what cancels the call
            line = self._file.readline()
            if not line:
                raise HostUnavailable("the worker's MCP host went away during the call")
            answered = True
            return line
        except OSError as e:
            raise HostUnavailable(f"the worker's MCP host is not reachable ({e})") from None
        finally:
            if not answered:  # cancelled, timed out (SoftTimeLimitExceeded) or broken: the host cancels
                self.close()

    def listing(self, timeout: float | None = None) -> Listing:
        end = None if timeout is None else time.monotonic() + timeout
        try:
            late = (lambda: time.monotonic() > end) if end is not None else (lambda: False)
            return Listing.model_validate_json(self._ask(ListRequest(), late))
        except CallCancelled:
            raise HostUnavailable(f"the worker's MCP host did not answer in {timeout}s") from None

    def call(self, request: CallRequest, is_cancelled: Callable[[], bool]) -> CallReply:
        return CallReply.model_validate_json(self._ask(request, is_cancelled))


@dataclass
class McpHost:
    """The worker's host process and what it serves."""

    servers: dict[str, McpServerConfig]
    proc: subprocess.Popen
    client: HostClient
    generation: int = -1

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


#: This process's host (set in the worker's main process; pool children inherit it).
_host: McpHost | None = None


def start_host(servers: dict[str, McpServerConfig], catalog: Catalog, logfile: str | None = None) -> Listing:
    """Start the host, wait for every server's first start, and install their tools. The host's
    log and its servers' stderr go to the worker's logfile when it has one."""
    global _host
    from toolq.workers.mcp.host import HostConfig

    taken = {s.namespace for s in catalog if s.namespace in servers}
    if taken:
        raise ConfigurationError(f"MCP server {sorted(taken)[0]}: its name is already a namespace of loaded tools")
    path = os.path.join(tempfile.mkdtemp(prefix="toolq-mcp-"), "host.sock")
    config = HostConfig(servers=servers, environments={n: c.environment() for n, c in servers.items()})
    # The host gets no secrets either: it needs only to find Python and toolq.
    env = {k: v for k, v in os.environ.items() if k in (*BASIC_ENV, "PYTHONPATH", "VIRTUAL_ENV")}
    log_to = open(logfile, "ab") if logfile else None  # noqa: SIM115 - the host holds it for its life
    proc = subprocess.Popen([sys.executable, "-m", "toolq.workers.mcp.host", path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log_to, env=env)
    if log_to is not None:
        log_to.close()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(config.model_dump_json().encode())
    proc.stdin.close()
    first = proc.stdout.readline()  # after every server started or failed its first start
    if not first:
        raise ConfigurationError(f"the MCP host exited with {proc.wait()} before its servers started")
    _host = McpHost(servers=servers, proc=proc, client=HostClient(path))
    listing = Listing.model_validate_json(first)
    install(catalog, listing)
    return listing


def install(catalog: Catalog, listing: Listing) -> None:
    """Each server's namespace in the catalog becomes exactly what it last listed. A server that is
    restarting keeps its tools here, so that a call waits for it in the host (up to its startup
    timeout) rather than being refused; the fleet is not offered them meanwhile (`Listing.records`)."""
    assert _host is not None
    listed = {s.name: s for s in listing.servers}
    for name in _host.servers:
        server = listed.get(name)
        records = server.tools if server else []
        catalog.replace_namespace(name, [tool_spec(r, Forward(r.server, r.name)) for r in records])
    _host.generation = listing.generation


def sync(catalog: Catalog, invocation: dict[str, Any]) -> None:
    """Before an MCP call runs in a pool child: if the catalog here does not hold the declaration
    the call carries, reload it as the host lists it now, so `execute` judges the call against
    the server's current listing. When it does hold it, the host re-checks at the call (`Forward`)."""
    if _host is None:
        return
    name = invocation.get("tool_name") or {}
    if name.get("namespace") not in _host.servers:
        return
    spec = catalog.get(ToolName(namespace=name.get("namespace"), name=str(name.get("name"))))
    if spec is not None and spec.digest() == invocation.get("spec_digest"):
        return
    reload(catalog)


def reload(catalog: Catalog) -> None:
    assert _host is not None
    try:
        listing = _host.client.listing()
    except HostUnavailable:
        return  # the call's own forward says so
    if listing.generation != _host.generation:
        install(catalog, listing)


def queues() -> list[str]:
    """Every configured server's queue, consumed even while the server is down."""
    return [mcp_queue(name) for name in (_host.servers if _host else {})]


@dataclass(frozen=True)
class Forward:
    """An MCP tool's handler in the catalog: the call goes to the host, the output comes back."""

    server: str
    tool: str

    def __call__(self, args: Any, ctx: ToolContext) -> Any:
        if _host is None:
            raise RespondToModel(f"MCP server {self.server} is not hosted in this process; not run")
        if not isinstance(args, dict):
            raise RespondToModel("failed to parse function arguments: expected a JSON object")
        spec = ctx.catalog.get(ctx.invocation.tool_name) if ctx.catalog else None
        timeout = min(spec.timeout if spec else ctx.remaining(), ctx.remaining())
        request = CallRequest(server=self.server, tool=self.tool, arguments=args,
                              digest=ctx.invocation.spec_digest, timeout=max(timeout, 0.001))
        try:
            reply = _host.client.call(request, ctx.cancelled)
        except HostUnavailable as e:
            raise RespondToModel(f"{e}; not run") from None
        if reply.timed_out is not None:
            raise ToolTimedOut(reply.timed_out)  # the host asked the server to cancel it
        if reply.stale and ctx.catalog is not None:
            reload(ctx.catalog)  # this process's copy of the server's tools is out of date
        if reply.refusal is not None or reply.result is None:
            raise RespondToModel(reply.refusal or "the MCP host gave no result")
        out = reply.result
        if out.is_error:
            text = out.output if isinstance(out.output, str) else "\n".join(
                getattr(p, "text", "") for p in out.output if getattr(p, "text", ""))
            raise RespondToModel(text or f"MCP tool {self.server}.{self.tool} failed")
        return ToolReturn(output=out.output)


def banner(listing: Listing) -> list[str]:
    """What `toolq worker` says at start: each server, how it runs, and its tools."""
    assert _host is not None
    lines = []
    for s in listing.servers:
        how = _host.servers[s.name].describe()
        if s.state == "ready":
            deferred = " (deferred behind tool_search)" if any(t.deferred for t in s.tools) else ""
            lines.append(f"mcp server {s.name} ({how}): {len(s.tools)} tools{deferred}")
        else:
            lines.append(f"mcp server {s.name} ({how}): not running: {s.error}; retrying")
        lines += [f"mcp server {s.name}: skipped {why}" for why in s.skipped]
    return lines


#: How long the heartbeat waits for the host's listing; a host that does not answer counts as down.
LISTING_TIMEOUT = 2.0


def current_listing() -> Listing | None:
    """The host's listing now (the worker's main process follows it, `follow.py`); None if it is
    gone or does not answer in time (the heartbeat must go on)."""
    if _host is None:
        return None
    try:
        return _host.client.listing(LISTING_TIMEOUT)
    except HostUnavailable:
        return None


def stop() -> None:
    if _host is not None:
        _host.stop()
