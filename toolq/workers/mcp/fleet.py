"""The fleet side of MCP: start with the worker and keep its advertisement following its servers
(the only MCP module that imports Celery, on the worker side only), and, for the orchestrator, each server's namespace
in the registry as the fleet catalog lists it.

Both go through the fleet catalog (`toolq.workers.presence`, `toolq.orchestrator.catalog_reader`):
a worker advertises its MCP tools like any other, as full declarations on the queue `mcp.<server>`;
the orchestrator rebuilds them from there without starting the servers itself.
"""

from __future__ import annotations

import logging
from typing import Any

from toolq.orchestrator.catalog_reader import FleetCatalog
from toolq.orchestrator.registry import Registry
from toolq.orchestrator.settings import Settings
from toolq.workers.catalog import Catalog, ToolSpec
from toolq.workers.mcp.specs import MCP_QUEUE_PREFIX

log = logging.getLogger("toolq.worker")

#: How long the heartbeat waits for the worker to confirm it consumes a new declaration's queue.
CONTROL_TIMEOUT = 1.0


def start_with_worker(settings: Settings, catalog: Catalog, logfile: str | None = None) -> list[str]:
    """`toolq worker`'s hook, before Celery forks: start the configured servers, add their tools to
    the catalog, follow their changes from the heartbeat, and return the queues their calls
    arrive on (none when no server is configured)."""
    # here, not at the top: the orchestrator imports this module for `FleetMcpTools` on every start
    from toolq.workers import presence
    from toolq.workers.mcp import worker
    from toolq.workers.mcp.config import load_servers
    from toolq.workers.mcp.follow import Follower

    servers = load_servers(settings.mcp, settings.mcp_config)
    if not servers:
        return []
    from celery.signals import worker_ready, worker_shutdown  # here, so the orchestrator's side loads no Celery

    listing = worker.start_host(servers, catalog, logfile)
    lines = worker.banner(listing)
    consumer: list[Any] = []

    def consume(queue: str) -> bool:
        if not consumer:
            return False
        replies = consumer[0].app.control.add_consumer(queue, destination=[consumer[0].hostname], reply=True,
                                                       timeout=CONTROL_TIMEOUT)
        return any(consumer[0].hostname in r for r in replies or [])

    def stop_consuming(queue: str) -> None:
        if consumer:
            consumer[0].app.control.cancel_consumer(queue, destination=[consumer[0].hostname])

    @worker_ready.connect(weak=False)
    def _ready(sender: Any = None, **_: Any) -> None:
        consumer.append(sender)  # the heartbeat thread reaches the worker's consumer through remote control
        for line in lines:
            log.info("%s", line)

    presence.on_beat(Follower(catalog, set(servers), read=worker.current_listing, install=worker.install,
                              consume=consume, stop_consuming=stop_consuming))
    worker_shutdown.connect(lambda **_: worker.stop(), weak=False)
    return worker.queues()


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
