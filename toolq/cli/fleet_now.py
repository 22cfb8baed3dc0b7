"""What the fleet is doing now, across every turn: `toolq queues` (how many calls wait on each
tool's queue, and how many live workers consume it) and `toolq calls` (every call not yet
answered, of every running turn).

`toolq turns` and `toolq status` answer per turn; an operator scaling the fleet asks per queue and
per call. Rendering is pure (records in, text out); only the `*_cmd` functions touch Redis.
"""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import aclosing
from typing import Any, TextIO

from toolq.cli.ledgers import ledgers
from toolq.cli.status import call_row, render_json_lines, render_table
from toolq.cli.terminal import printable
from toolq.core.advert import WorkerAdvert
from toolq.core.settings import Settings
from toolq.core.states import parse_state
from toolq.orchestrator.transport.catalog_reader import FleetCatalog
from toolq.orchestrator.transport.redis_faults import reaching
from toolq.orchestrator.transport.task_message import queue_key
from toolq.workers import redis_clients

QUEUE_COLUMNS = ("queue", "tool", "waiting", "workers")
NOW_COLUMNS = ("turn_id", "tool", "call_id", "state", "worker", "run_time")
#: How many of the newest turns `toolq calls` looks through for running ones.
RECENT_TURNS = 200


def queue_rows(workers: list[WorkerAdvert], depths: dict[str, int]) -> list[dict[str, Any]]:
    """One row per tool queue some live worker consumes: its tool, the calls waiting on it, and
    how many live (not draining) instances consume it. Deepest first: where a worker is wanted."""
    tools: dict[str, str] = {}
    serving: dict[str, set[str]] = {}
    for w in workers:
        for t in w.tools:
            tools[t.route] = str(t.tool_name)
            serving.setdefault(t.route, set())
            if not w.draining:
                serving[t.route].add(w.instance)
    rows = [{"queue": q, "tool": tools[q], "waiting": depths.get(q, 0), "workers": len(serving[q])} for q in tools]
    return sorted(rows, key=lambda r: (-r["waiting"], r["queue"]))


def unanswered_rows(turns: list[tuple[str, list[dict[str, str]]]], now: float) -> list[dict[str, Any]]:
    """Every call of the given running turns that has no terminal state yet."""
    rows = []
    for turn_id, calls in turns:
        for call in calls:
            state = parse_state(call.get("state"))
            if state is None or not state.terminal:
                row = call_row(call, now)
                rows.append({"turn_id": turn_id, **{k: row[k] for k in NOW_COLUMNS if k != "turn_id"}})
    return rows


def queues_cmd(settings: Settings, *, as_json: bool = False, out: TextIO = sys.stdout,
               err: TextIO = sys.stderr) -> int:
    if not settings.redis_url:
        print("toolq queues: set REDIS_URL (or CELERY_BROKER_URL) to the broker the workers use", file=err)
        return 2
    url = settings.redis_url

    async def read() -> tuple[list[WorkerAdvert], dict[str, int]]:
        r = redis_clients.async_client(settings.redis_target() or url, client_name="toolq-queues")
        try:
            workers = await FleetCatalog(r).workers()
            routes = sorted({t.route for w in workers for t in w.tools})
            async with r.pipeline(transaction=False) as p:
                for q in routes:
                    p.llen(queue_key(q))
                lengths = await p.execute()
            return workers, dict(zip(routes, lengths, strict=True))
        finally:
            await r.aclose()

    with reaching(url):
        workers, depths = asyncio.run(read())
    rows = queue_rows(workers, depths)
    if as_json:
        out.write(render_json_lines(rows))
    elif not rows:
        out.write("no live workers in the fleet catalog, so no tool queue is consumed "
                  "(start one with `toolq worker`)\n")
    else:
        out.write(printable(render_table(rows, QUEUE_COLUMNS)))  # tool names are the fleet's
    return 0


def calls_cmd(settings: Settings, *, as_json: bool = False, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr) -> int:
    async def read() -> list[tuple[str, list[dict[str, str]]]]:
        found = []
        async with aclosing(ledgers(settings.redis_target())) as each:
            async for _, ledger in each:
                for turn_id, turn in await ledger.recent_turns(RECENT_TURNS):
                    if turn.get("state") == "running":
                        found.append((turn_id, await ledger.calls(turn_id)))
        return found

    with reaching(settings.redis_url):
        turns = asyncio.run(read())
    rows = unanswered_rows(turns, time.time())
    if as_json:
        out.write(render_json_lines(rows))
    elif not rows:
        out.write(f"no call is waiting or running ({len(turns)} running turn(s))\n")
    else:
        out.write(printable(render_table(rows, NOW_COLUMNS)))
    return 0
