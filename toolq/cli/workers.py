"""`toolq workers`: the fleet catalog, one row (or JSON line) per live worker process instance.

Rendering is pure (records in, text out); only `workers_cmd` touches Redis.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from typing import Any, TextIO

from toolq.cli.status import render_json_lines, render_table
from toolq.cli.terminal import human_age, printable
from toolq.core.advert import WorkerAdvert
from toolq.core.settings import Settings
from toolq.orchestrator.transport.catalog_reader import FleetCatalog
from toolq.orchestrator.transport.redis_faults import reaching
from toolq.workers import redis_clients

WORKER_COLUMNS = ("worker", "instance", "state", "pid", "host", "concurrency", "up", "sandbox", "tools")
#: The tools cell is cut to this many characters in the table (JSON lists every tool).
TOOLS_WIDTH = 160


def tool_names(w: WorkerAdvert) -> str:
    """Each plain tool by name, each namespace (an MCP server's) once with its count: a fleet with
    MCP servers listed their dozens of tools first and cut the user's own off the table."""
    plain = [t.tool_name.name for t in w.tools if not t.tool_name.namespace]
    spaces = Counter(t.tool_name.namespace for t in w.tools if t.tool_name.namespace)
    return ", ".join([*plain, *(f"{ns}.* ({n})" for ns, n in sorted(spaces.items()))])


def host_of(w: WorkerAdvert) -> str:
    """The machine, and the host id its environments are placed under when that differs (TOOLQ_HOST_ID)."""
    return w.host if not w.env_host or w.env_host == w.host else f"{w.env_host} ({w.host})"


def worker_row(w: WorkerAdvert, now: float) -> dict[str, Any]:
    names = tool_names(w)
    tools = f"{len(w.tools)}: {names}" if names else "0"
    return {"worker": w.hostname, "instance": w.instance[:8], "state": "draining" if w.draining else "ready",
            "pid": w.pid, "host": host_of(w), "concurrency": w.concurrency,
            "up": human_age(now - w.started_at),
            "sandbox": f"{w.sandbox}, envs {w.env_mode}" if w.env_mode else w.sandbox,
            "tools": tools if len(tools) <= TOOLS_WIDTH else tools[:TOOLS_WIDTH - 1] + "…"}


def render_workers(workers: list[WorkerAdvert], now: float, as_json: bool = False) -> str:
    if as_json:
        return render_json_lines([{**w.model_dump(mode="json"), "state": "draining" if w.draining else "ready"}
                                  for w in workers])
    if not workers:
        return "no live workers in the fleet catalog (start one with `toolq worker`)\n"
    return render_table([worker_row(w, now) for w in workers], WORKER_COLUMNS)


def workers_cmd(settings: Settings, *, as_json: bool = False, out: TextIO = sys.stdout,
                err: TextIO = sys.stderr) -> int:
    if not settings.redis_url:
        print("toolq workers: set REDIS_URL (or CELERY_BROKER_URL) to the broker the workers use", file=err)
        return 2
    url = settings.redis_url

    async def read() -> list[WorkerAdvert]:
        r = redis_clients.async_client(settings.redis_target() or url, client_name="toolq-workers")
        try:
            return await FleetCatalog(r).workers()
        finally:
            await r.aclose()

    with reaching(url):  # one line, exit 2 (the CLI's ConfigurationError), as `toolq status`
        workers = asyncio.run(read())
    shown = render_workers(workers, time.time(), as_json)
    out.write(shown if as_json else printable(shown))  # names and tools are the fleet's, not ours
    return 0
