"""The Celery side of MCP (the only MCP module that imports Celery): start with the worker, say
what it serves, and let the orchestrator read every worker's MCP tools.

Until the fleet catalog advertises tools, the orchestrator learns a worker's MCP tools through a
remote-control command, `toolq_mcp_tools`, answered by the worker's main process from its host's
current listing: live, so a server that is down or changed its list is reported as it is now.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown
from celery.worker.control import inspect_command

from toolq.orchestrator.registry import Registry
from toolq.orchestrator.settings import Settings
from toolq.workers.catalog import Catalog
from toolq.workers.mcp import worker
from toolq.workers.mcp.config import load_servers
from toolq.workers.mcp.specs import McpToolRecord, mcp_tool_specs
from toolq.workers.mcp.wire import Listing

log = logging.getLogger("toolq.worker")


def start_with_worker(settings: Settings, catalog: Catalog, logfile: str | None = None) -> list[str]:
    """`toolq worker`'s hook, before Celery forks: start the configured servers, add their tools to
    the catalog, and return the queues their calls arrive on (none when no server is configured)."""
    servers = load_servers(settings.mcp, settings.mcp_config)
    if not servers:
        return []
    listing = worker.start_host(servers, catalog, logfile)
    lines = worker.banner(listing)

    @worker_ready.connect(weak=False)
    def _say_servers(**_: Any) -> None:
        for line in lines:
            log.info("%s", line)

    worker_shutdown.connect(lambda **_: worker.stop(), weak=False)
    return worker.queues()


@inspect_command(name=worker.CONTROL_COMMAND)
def _mcp_tools(state: Any, **_: Any) -> dict[str, Any]:
    listing = worker.current_listing()
    return listing.model_dump(mode="json") if listing else {}


def fleet_listings(app: Celery, timeout: float = 1.0) -> dict[str, Listing]:
    """Each live worker's MCP listing, by worker name (workers without MCP servers left out)."""
    out = {}
    for reply in app.control.broadcast(worker.CONTROL_COMMAND, reply=True, timeout=timeout) or []:
        for hostname, body in reply.items():
            if body and "servers" in body:
                out[hostname] = Listing.model_validate(body)
    return out


class FleetMcpTools:
    """The orchestrator's wiring until the fleet catalog carries MCP records: the MCP tools some
    live worker serves, in the registry. `refresh()` at a turn's start (or on a timer) makes each
    server's namespace what the fleet lists now, and drops the namespace of a server no live
    worker hosts, so its tools stay out of the model's list."""

    def __init__(self, registry: Registry, app: Celery, timeout: float = 1.0) -> None:
        self.registry, self.app, self.timeout = registry, app, timeout
        self.servers: set[str] = set()

    def refresh(self) -> int:
        """Returns how many MCP tools the registry now holds."""
        by_server: dict[str, list] = {}
        for spec in mcp_tool_specs(fleet_records(self.app, self.timeout)):
            by_server.setdefault(spec.namespace or "", []).append(spec)
        for server in self.servers | set(by_server):
            self.registry.replace_namespace(server, by_server.get(server, []))
        self.servers = set(by_server)
        return sum(len(v) for v in by_server.values())


def add_fleet_tools(registry: Registry, app: Celery, timeout: float = 1.0) -> int:
    """One `FleetMcpTools.refresh()` at runtime start. Returns how many tools it added."""
    return FleetMcpTools(registry, app, timeout).refresh()


def fleet_records(app: Celery, timeout: float = 1.0) -> list[McpToolRecord]:
    """The MCP tools some live worker serves now, for `mcp_tool_specs` (the orchestrator's seam)."""
    return [r for _, listing in sorted(fleet_listings(app, timeout).items()) for r in listing.records()]
