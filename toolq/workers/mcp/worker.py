"""MCP servers on a worker: start the host, put its tools in the catalog, forward calls to it.

The worker's main process starts the host (`host.py`) before Celery forks its pool, and puts
each server's tools in the catalog as namespaced function tools whose handler is `Forward`; pool
children inherit both. Before a child runs an MCP call it asks the host for the current listing
(`sync`), so a tool list that changed since the fork is what `execute` checks the call's
declaration digest against. The main process follows the listing too, for the fleet catalog
(`follow.py`), and starts the host again should it die (`launch.py`); children reach it with
`host_client.py`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from toolq.core.calls import ToolName
from toolq.core.catalog import Catalog, ToolContext, ToolReturn
from toolq.core.errors import ConfigurationError, RespondToModel, ToolTimedOut
from toolq.core.honest import InfrastructureLost
from toolq.core.mcp_specs import mcp_queue, tool_spec
from toolq.workers import spans
from toolq.workers.mcp.config import BASIC_ENV, McpServerConfig
from toolq.workers.mcp.host_client import HostClient, HostGone, HostUnavailable
from toolq.workers.mcp.launch import HostProcess
from toolq.workers.mcp.wire import CallReply, CallRequest, Listing

log = logging.getLogger("toolq.worker")

#: How long a call waits for a host that is restarting (`launch.py`: its servers start anew too).
HOST_RESTART_WAIT = 15.0


@dataclass
class McpHost:
    """The worker's host process and what it serves."""

    servers: dict[str, McpServerConfig]
    process: HostProcess
    client: HostClient
    generation: int = -1

    def stop(self) -> None:
        self.process.stop()


#: This process's host (set in the worker's main process; pool children inherit it).
_host: McpHost | None = None


def start_host(servers: dict[str, McpServerConfig], catalog: Catalog, logfile: str | None = None) -> Listing:
    """Start the host, wait for every server's first start, install their tools, and from then on
    restart the host should it die. The host's log and its servers' stderr go to the worker's
    logfile when it has one."""
    global _host
    from toolq.workers.mcp.host import HostConfig

    taken = {s.namespace for s in catalog if s.namespace in servers}
    if taken:
        raise ConfigurationError(f"MCP server {sorted(taken)[0]}: its name is already a namespace of loaded tools")
    path = os.path.join(tempfile.mkdtemp(prefix="toolq-mcp-"), "host.sock")
    config = HostConfig(servers=servers, environments={n: c.environment() for n, c in servers.items()})
    # The host gets no secrets either: it needs only to find Python and toolq.
    env = {k: v for k, v in os.environ.items() if k in (*BASIC_ENV, "PYTHONPATH", "VIRTUAL_ENV")}
    process = HostProcess(path, config, env, logfile)
    listing = process.start()
    if listing is None:
        assert process.proc is not None
        raise ConfigurationError(f"the MCP host exited with {process.proc.wait()} before its servers started")
    _host = McpHost(servers=servers, process=process, client=HostClient(path))
    install(catalog, listing)
    process.supervise()
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
        # Traces: the MCP call's client span, whose context the host puts in the request's `_meta`.
        config = _host.servers.get(self.server)
        span = spans.start_mcp_call(self.server, self.tool, stdio=config is None or config.command is not None)
        request = CallRequest(server=self.server, tool=self.tool, arguments=args,
                              digest=ctx.invocation.spec_digest, timeout=max(timeout, 0.001),
                              trace=spans.context_of_span(span))
        try:
            reply = _host.client.call(request, ctx.cancelled, wait=min(timeout, HOST_RESTART_WAIT))
        except HostGone as e:
            spans.end(span, error="lost")
            raise InfrastructureLost(str(e)) from None
        except HostUnavailable as e:
            spans.end(span, error="not_run")
            raise InfrastructureLost(str(e), started=False) from None
        except BaseException as e:
            spans.end(span, error=type(e).__name__)
            raise
        spans.end(span, error=_span_error(reply))
        if reply.lost is not None:
            raise InfrastructureLost(reply.lost)
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


def _span_error(reply: CallReply) -> str | None:
    """A `tools/call` span's `error.type`: how the call did not return a result, or the tool's error."""
    if reply.lost is not None:
        return "lost"
    if reply.timed_out is not None:
        return "timeout"
    if reply.refusal is not None or reply.result is None:
        return "refused"
    return "tool_error" if reply.result.is_error else None


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
