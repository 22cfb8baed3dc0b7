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

from toolq.core import keys
from toolq.core.calls import ToolName

log = logging.getLogger("toolq.durable")

MIB = 1024 * 1024
#: Redis's own cost of one entry of a turn's item list beside its bytes (the list node, the
#: `Committed` envelope's step and output index), counted for every item so a stream of tiny items
#: is bounded too.
ENTRY_OVERHEAD = 96
#: What a queued call keeps in Redis besides the model's text: the ledger's call record and
#: indexes, the task message's headers and properties, a worker's result envelope.
CALL_OVERHEAD = 4096
#: Flower's `argsrepr`, twice in each task message, holds the call_id (counted apart) and at most
#: this much more of the arguments: 300 characters of an exec_command's command, each at most 12
#: bytes once `repr` and JSON have escaped it (core.flower_args).
ARGSREPR_BYTES = 300 * 12 + 64
#: The call_id is the model's text, copied (escaped) into the ledger's call record and call_id
#: index, the task message's `argsrepr` (twice), the output item and the worker's result: each copy
#: is counted at its most escaped (`argsrepr` holds its `repr`).
CALL_ID_COPIES = 8
#: Redis holds what jemalloc gives it, which rounds a large allocation up by as much as a quarter.
ALLOCATOR_SLACK = 1.25
#: The item types that become a task message (when bound to a tool) and get an output.
CALL_TYPES = frozenset({"function_call", "custom_tool_call", "local_shell_call", "tool_search_call"})
#: The item types that answer a call: the worker's Celery result holds the output a second time.
OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output", "tool_search_output"})


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
    environment: str | None = None
    """The environment its calls ran in (issue 28): a resumed turn takes it up from its last checkpoint."""


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
        record = keys.record(raw)
        settings = TurnSettings.model_validate_json(record["settings"]) if "settings" in record else None
        items = [Committed.model_validate(json.loads(x)) for x in await self.r.lrange(keys.turn_items(turn_id), 0, -1)]
        return record, settings, items


def store_error(bound_mb: int) -> str:
    """The one line a turn stopped at its store bound ends with: the limit, and how to raise it."""
    return (f"turn stopped: it would keep more than {bound_mb} MiB in Redis (the model's items and the tools' "
            f"outputs of one turn, kept for `toolq resume`); set TOOLQ_TURN_STORE_MB above {bound_mb} to allow more")


_PLAIN_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")


def _escaped_id(call_id: str | None) -> int:
    """Bytes of one copy of a call_id at its most escaped: its JSON (ASCII), or its `repr`'s."""
    if not call_id:
        return 0
    if len(call_id) <= 256 and _PLAIN_ID.issuperset(call_id):  # what real servers send: nothing to escape
        return len(call_id) + 4
    return max(len(json.dumps(call_id)), len(json.dumps(repr(call_id))))


def item_cost(utf8_bytes: int, escaped_bytes: int, type_: str | None, call_id: str | None) -> int:
    """What keeping one item of a turn costs Redis, about and never less, given its JSON's size as
    UTF-8 (the turn's item list keeps it so) and with every non-ASCII character escaped (Celery's
    JSON: a call's task message, base64 on top, and a worker's result)."""
    cost = utf8_bytes + ENTRY_OVERHEAD
    if type_ in CALL_TYPES:
        cost += (CALL_OVERHEAD + -(-escaped_bytes * 4 // 3) + 2 * min(escaped_bytes, ARGSREPR_BYTES)
                 + CALL_ID_COPIES * _escaped_id(call_id))
    elif type_ in OUTPUT_TYPES:
        cost += escaped_bytes
    return int(cost * ALLOCATOR_SLACK)


def wire_cost(obj: dict[str, Any], *, history: bool = False) -> int:
    """`item_cost` of an item as wire JSON (what a resumed turn finds in Redis, an output).
    `history`: an item of an earlier turn, which this turn's item list holds again, and nothing
    else (its call's task message and result belong to the turn that made it)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if text.isascii():
        utf8 = escaped = len(text)
    else:
        utf8, escaped = len(text.encode(errors="replace")), len(json.dumps(obj, separators=(",", ":")))
    if history:
        return item_cost(utf8, escaped, None, None)
    call_id = obj.get("call_id")
    return item_cost(utf8, escaped, obj.get("type"), call_id if isinstance(call_id, str) else None)


class StoreBudget:
    """What one turn may make toolq keep in Redis (TOOLQ_TURN_STORE_MB), and what it has kept.

    Counted where toolq writes it, before it writes it: each model item at its commit point (the
    item, and for a call its task message, ledger record and the copies of its call_id), each tool
    output as the barrier hands it over (the worker's result holds it too), and the conversation a
    turn starts from (the turn's item list holds it again, for `toolq resume`)."""

    def __init__(self, bound_mb: int, used: int = 0) -> None:
        self.bound_mb = bound_mb
        self.bound = bound_mb * MIB
        self.used = used
        self.full = used > self.bound
        """Something was refused or passed the bound: the turn stops (with `error`) before it asks
        the model again."""

    def take(self, cost: int) -> bool:
        """Count `cost` if it fits under the bound; False (and `full`) if it does not."""
        if self.used + cost > self.bound:
            self.full = True
            return False
        self.used += cost
        return True

    def add(self, cost: int) -> None:
        """Count what is kept whatever the bound (the history a turn starts from, a refused output's line)."""
        self.used += cost
        if self.used > self.bound:
            self.full = True

    @property
    def error(self) -> str:
        return store_error(self.bound_mb)


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
