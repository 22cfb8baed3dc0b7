"""Durable turns: a turn's settings, committed items and outputs live in Redis as they happen,
and a lease says which orchestrator drives it, so `toolq resume` can finish a turn whose
orchestrator died (SIGKILL, OOM, a lost machine) from Redis alone.

The lease is a key holding the driver's random token with a TTL that a heartbeat refreshes: taking
it is one `SET NX` (two orchestrators never drive one turn), renewing and releasing check the token.
A `running` turn with no lease is `orphaned`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import Counter
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel

from toolq.orchestrator import keys
from toolq.orchestrator.calls import ToolName

log = logging.getLogger("toolq.durable")

# KEYS: lease. ARGV: token, ttl ms. Renew only our own lease.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class TurnSettings(BaseModel):
    """What a resumed turn needs to go on as the first orchestrator would have."""

    model: str
    workspace: str
    tools: list[str] = []
    instructions: str | None = None
    reasoning: dict[str, Any] | None = None
    deadline: float
    loaded_tools: list[ToolName] = []


class Committed(BaseModel):
    """One item as it was recorded: model items carry the step and output index that name their task."""

    item: dict[str, Any]
    step: int | None = None
    output_index: int | None = None


class TurnStore:
    def __init__(self, r: aioredis.Redis, lease_ttl: float) -> None:
        self.r = r
        self.lease_ttl = lease_ttl
        self._renew = r.register_script(_RENEW)
        self._release = r.register_script(_RELEASE)

    # --- the lease ---------------------------------------------------------------------------

    async def take_lease(self, turn_id: str) -> str | None:
        """The lease's token, or None if another orchestrator holds it (atomic: SET NX)."""
        token = secrets.token_hex(16)
        ok = await self.r.set(keys.turn_lease(turn_id), token, nx=True, px=int(self.lease_ttl * 1000))
        return token if ok else None

    async def renew(self, turn_id: str, token: str) -> bool:
        return bool(await self._renew(keys=[keys.turn_lease(turn_id)], args=[token, int(self.lease_ttl * 1000)]))

    async def release(self, turn_id: str, token: str) -> None:
        await self._release(keys=[keys.turn_lease(turn_id)], args=[token])

    async def heartbeat(self, turn_id: str, token: str) -> None:
        """Renew the lease until cancelled. Returns when another orchestrator holds it: the caller
        must stop driving the turn (two drivers would both ask the model and both append items).
        Redis trouble is retried; a lease that lapsed with nobody holding it (a Redis restarted
        empty) is taken again."""
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                if await self.renew(turn_id, token):
                    continue
                if await self.r.set(keys.turn_lease(turn_id), token, nx=True, px=int(self.lease_ttl * 1000)):
                    log.warning("the lease on %s had lapsed; took it again", turn_id)
                    continue
                log.warning("another orchestrator took over %s after its lease lapsed here", turn_id)
                return
            except Exception as e:
                log.warning("lease heartbeat for %s failed: %s", turn_id, e)

    # --- settings and items --------------------------------------------------------------------

    async def save_settings(self, turn_id: str, settings: TurnSettings) -> None:
        await self.r.hset(keys.turn(turn_id), "settings", settings.model_dump_json())

    async def append(self, turn_id: str, entries: list[Committed]) -> None:
        if not entries:
            return
        async with self.r.pipeline(transaction=True) as p:
            p.rpush(keys.turn_items(turn_id), *[e.model_dump_json(exclude_none=True) for e in entries])
            p.expire(keys.turn_items(turn_id), keys.RECORD_TTL)
            await p.execute()

    async def load(self, turn_id: str) -> tuple[dict[str, str], TurnSettings | None, list[Committed]]:
        """The turn's record, its settings (None: not a durable turn) and its items in order."""
        raw = await self.r.hgetall(keys.turn(turn_id))
        record = {k.decode(): v.decode() for k, v in raw.items()}
        settings = TurnSettings.model_validate_json(record["settings"]) if "settings" in record else None
        items = [Committed.model_validate(json.loads(x)) for x in await self.r.lrange(keys.turn_items(turn_id), 0, -1)]
        return record, settings, items


def unanswered(committed: list[Committed]) -> list[tuple[int, list[Committed]]]:
    """The model's calls that have no output yet, by step, in call order: what a resumed turn
    hands to the barrier again (their task ids follow from turn, step, output index and call_id)."""
    outputs = Counter(c.item.get("call_id") for c in committed if str(c.item.get("type", "")).endswith("_output"))
    by_step: dict[int, list[Committed]] = {}
    for c in committed:
        call_id = c.item.get("call_id")
        if c.step is None or not call_id or str(c.item.get("type", "")).endswith("_output"):
            continue
        if outputs[call_id] > 0:
            outputs[call_id] -= 1
            continue
        by_step.setdefault(c.step, []).append(c)
    return sorted(by_step.items())


async def mark_orphans(r: aioredis.Redis, turns: list[tuple[str, dict[str, str]]]) -> None:
    """Show a durable turn still `running` whose lease lapsed (its orchestrator died) as `orphaned`."""
    running = [(t, h) for t, h in turns if h.get("state") == "running" and "settings" in h]
    if not running:
        return
    async with r.pipeline(transaction=False) as p:
        for t, _ in running:
            p.exists(keys.turn_lease(t))
        leases = await p.execute()
    for (_, h), leased in zip(running, leases):
        if not leased:
            h["state"] = ORPHANED


#: The state `toolq turns` and `toolq status` show for a running turn nobody drives.
ORPHANED = "orphaned"
