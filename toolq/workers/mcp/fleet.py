"""The worker's side of MCP on the fleet: start with the worker and keep its advertisement
following its servers (the only MCP module that imports Celery).

A worker advertises its MCP tools in the fleet catalog (`toolq.workers.presence`) like any other,
as full declarations on the queue `mcp.<server>`; the orchestrator rebuilds them from there
without starting the servers itself (`toolq.orchestrator.mcp_tools`).
"""

from __future__ import annotations

import logging
from typing import Any

from toolq.core.catalog import Catalog
from toolq.core.settings import Settings

log = logging.getLogger("toolq.worker")

#: How long the heartbeat waits for the worker to confirm it consumes a new declaration's queue.
CONTROL_TIMEOUT = 1.0


def start_with_worker(settings: Settings, catalog: Catalog, logfile: str | None = None) -> list[str]:
    """`toolq worker`'s hook, before Celery forks: start the configured servers, add their tools to
    the catalog, follow their changes from the heartbeat, and return the queues their calls
    arrive on (none when no server is configured)."""
    # here, not at the top: `toolq worker` imports this module whether or not it hosts MCP servers
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
