"""The orchestrator's MCP tools: each MCP server's namespace in the registry, as the fleet
catalog lists it (workers advertise their servers' tools as full declarations on the queue
`mcp.<server>`; `toolq.workers.mcp.fleet` is their side)."""

from __future__ import annotations

from toolq.core.catalog import ToolSpec
from toolq.core.mcp_specs import MCP_QUEUE_PREFIX
from toolq.orchestrator.registry import Registry
from toolq.orchestrator.transport.catalog_reader import FleetCatalog


def mcp_namespaces(declarations: list[ToolSpec]) -> dict[str, list[ToolSpec]]:
    """The MCP servers' tools among the fleet's declarations, by server: one spec per tool (the
    first declaration by digest, should two workers list a server's tool differently)."""
    out: dict[str, dict[str, ToolSpec]] = {}
    for spec in sorted(declarations, key=ToolSpec.digest):
        if spec.namespace is not None and spec.queue.startswith(MCP_QUEUE_PREFIX):
            out.setdefault(spec.namespace, {}).setdefault(spec.name, spec)
    return {server: list(tools.values()) for server, tools in out.items()}


class FleetMcpTools:
    """The orchestrator's MCP tools: `follow()` at a turn's start makes each server's namespace in
    the registry what live workers offer now, and drops the namespace of a server no live worker
    hosts, so its tools stay out of the model's list. A namespace the orchestrator loaded itself
    is never replaced."""

    def __init__(self, registry: Registry, fleet: FleetCatalog) -> None:
        self.registry, self.fleet = registry, fleet
        self.servers: set[str] = set()
        self.local = {s.namespace for s in registry.catalog if s.namespace is not None}

    async def follow(self) -> int:
        """Returns how many MCP tools the registry now holds."""
        specs = [s for a in await self.fleet.declarations(max_age=0) if (s := a.to_spec()) is not None]
        by_server = {n: tools for n, tools in mcp_namespaces(specs).items() if n not in self.local}
        for server in sorted(self.servers | set(by_server)):
            self.registry.replace_namespace(server, by_server.get(server, []))
        self.servers = set(by_server)
        return sum(len(v) for v in by_server.values())
