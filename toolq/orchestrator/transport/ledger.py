"""The ledger: toolq's own record of every turn and call, in Redis, apart from Celery's.

It maps call_id <-> task id both ways, keeps each call's state (a `CallState` value, written by
the orchestrator and the workers alike), makes dispatch at-most-once (a claim is set only if
absent), and holds the durable cancel records that workers check before they start a call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import redis.asyncio as aioredis

from toolq.core import keys
from toolq.core.calls import ToolInvocation
from toolq.core.redis_target import RedisTarget
from toolq.core.states import CallState, parse_state
from toolq.orchestrator.transport.cancel_listener import CancelListener
from toolq.orchestrator.transport.redis_pool import DEFAULT_CONNECTIONS, blocking_client


# KEYS: call record, turn's task list, turn's call_id index[, queue]. ARGV: ttl, task id, call id[, message],
# record... (`first`: the index of the record's first field in ARGV)
def _record(first: int) -> str:
    return f"""
redis.call('HSET', KEYS[1], unpack(ARGV, {first}))
redis.call('EXPIRE', KEYS[1], ARGV[1])
"""


_INDEX = """
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[2])
redis.call('EXPIRE', KEYS[3], ARGV[1])
"""
# A record that is only `throttled` (listed while it waited for a limit) was never sent: it is claimed.
_CLAIM = """
local listed = redis.call('HGET', KEYS[1], 'state')
if listed and listed ~= 'throttled' then return 0 end
""" + _record(4) + "if listed then return 1 end" + _INDEX + "return 1"
# The same keys and arguments: list the call (in the turn's order) only if it has no record yet.
_THROTTLED = "if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end" + _record(4) + _INDEX + "return 1"
# The claim, the publish (KEYS[4] is the queue's list, ARGV[4] the task message) and the `sent`
# mark at once: no process can die between them. A call claimed and never sent (its orchestrator
# died between the claim and the publish, or `dispatch` claimed it before it could route it) is
# sent now: 2. Claimed and sent, or past `queued`: 0, nothing pushed.
_CLAIM_AND_SEND = """
local listed = redis.call('HGET', KEYS[1], 'state')
local claimed = listed and listed ~= 'throttled'
if claimed and (listed ~= 'queued' or redis.call('HEXISTS', KEYS[1], 'sent') == 1) then return 0 end
if not claimed then
""" + _record(5) + "if not listed then" + _INDEX + """end
end
redis.call('LPUSH', KEYS[4], ARGV[4])
redis.call('HSET', KEYS[1], 'sent', '1')
if claimed then return 2 end
return 1
"""


# KEYS: the turn's record, its lease. ARGV: field, value, ... Only a running turn ends (once).
_END_TURN = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
redis.call('DEL', KEYS[2])
return 1
"""
#: A turn record's `driver` when `Fleet.run_calls` runs its calls and the caller's own loop drives it.
FLEET_DRIVER = "fleet"


class Sent(IntEnum):
    """What `Ledger.claim_and_send` did."""

    BEFORE = 0
    """Nothing: the call was sent before (by another orchestrator, or by a retried attempt of this one)."""
    NOW = 1
    """Claimed and sent."""
    CLAIMED_BEFORE = 2
    """Sent now, claimed before: by this dispatch, or by an orchestrator that died before sending it."""


def _record_fields(inv: ToolInvocation, state: CallState, **fields: Any) -> list[str]:
    record = {"call_id": inv.call_id, "task_id": inv.task_id, "turn_id": inv.turn_id, "tool": str(inv.tool_name),
              "state": state.value, "step": inv.step, "output_index": inv.output_index, **fields}
    return [str(x) for kv in record.items() for x in kv]


def _call_keys(inv: ToolInvocation) -> list[str]:
    return [keys.call(inv.task_id), keys.turn_calls(inv.turn_id), keys.call_ids(inv.turn_id)]


#: Step numbers `next_step` takes from a turn's counter at once, and the turns whose block it keeps.
STEP_BLOCK = 16
STEP_BLOCKS_KEPT = 10_000


#: Seconds one ledger command may wait for its reply. Without it, a Redis that stops answering
#: (packets dropped, the host frozen) holds the turn's every await for as long as TCP keeps trying;
#: with it the command raises `redis.TimeoutError`, which the turn handles as any Redis fault.
#: No retry on timeout: a command that timed out may have run (an RPUSH twice is two items).
SOCKET_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0
#: An idle connection is pinged before use after this long (a dead one is replaced, not awaited).
HEALTH_CHECK_INTERVAL = 15


class Ledger:
    def __init__(self, r: aioredis.Redis) -> None:
        self.r = r
        self._claim = r.register_script(_CLAIM)
        self._throttled = r.register_script(_THROTTLED)
        self._claim_and_send = r.register_script(_CLAIM_AND_SEND)
        self._end_turn = r.register_script(_END_TURN)
        self._cancels: CancelListener | None = None
        """Every turn's cancel channel on one subscription, opened by the first `wait_for_cancel`."""
        self._steps: dict[str, tuple[int, int]] = {}
        """Per turn, the next step number of the block this ledger took and the block's end."""

    @classmethod
    def from_url(cls, url: RedisTarget | str, max_connections: int = DEFAULT_CONNECTIONS) -> Ledger:
        """A ledger whose commands wait for a free connection rather than fail (redis_pool.py) and
        give up on a Redis that stops answering."""
        return cls(blocking_client(url, "toolq-ledger", max_connections, socket_timeout=SOCKET_TIMEOUT,
                                   socket_connect_timeout=CONNECT_TIMEOUT, socket_keepalive=True,
                                   health_check_interval=HEALTH_CHECK_INTERVAL))

    async def aclose(self) -> None:
        if self._cancels is not None:
            await self._cancels.aclose()
        await self.r.aclose()

    # --- turns -------------------------------------------------------------------------------

    async def start_turn(self, turn_id: str, prompt: str, workspace: str, *, driver: str | None = None,
                         lease: float | None = None) -> None:
        """`driver="fleet"`: a turn whose calls `Fleet.run_calls` runs and whose loop is the caller's
        (it ends with `Fleet.end_turn`, a cancel, or its fleet's `aclose`); its lease (`lease`
        seconds, renewed by `touch_turns`) says its process is alive."""
        now = time.time()
        async with self.r.pipeline(transaction=True) as p:
            p.hset(keys.turn(turn_id), mapping={"state": "running", "started_at": now, "prompt": prompt[:500],
                                                "workspace": workspace, **({"driver": driver} if driver else {})})
            if lease is not None:
                p.set(keys.turn_lease(turn_id), FLEET_DRIVER, px=int(lease * 1000))
            p.expire(keys.turn(turn_id), keys.RECORD_TTL)
            p.zadd(keys.TURNS, {turn_id: now})
            p.zremrangebyscore(keys.TURNS, 0, now - keys.RECORD_TTL)  # their records have expired
            await p.execute()

    async def finish_turn(self, turn_id: str, state: str, error: str | None = None) -> None:
        await self.r.hset(keys.turn(turn_id), mapping={"state": state, "finished_at": time.time(),
                                                       **({"error": error[:2000]} if error else {})})

    async def end_turn(self, turn_id: str, state: str, error: str | None = None) -> bool:
        """Record the end of a turn still `running` (False: it had ended, or has no record), and drop
        its lease: an end already recorded (a cancel) is never overwritten."""
        fields = ["state", state, "finished_at", str(time.time()), *(["error", error[:2000]] if error else [])]
        return bool(await self._end_turn(keys=[keys.turn(turn_id), keys.turn_lease(turn_id)], args=fields))

    async def touch_turns(self, turn_ids: list[str], lease: float) -> None:
        """Fleet turns are being driven: each one's lease lives `lease` seconds more. A running
        Fleet turn whose lease lapsed (its process died without ending it) shows `orphaned`."""
        if not turn_ids:
            return
        async with self.r.pipeline(transaction=False) as p:
            for turn_id in turn_ids:
                p.set(keys.turn_lease(turn_id), FLEET_DRIVER, px=int(lease * 1000))
            await p.execute()

    async def turn(self, turn_id: str) -> dict[str, str]:
        return keys.record(await self.r.hgetall(keys.turn(turn_id)))

    async def recent_turns(self, limit: int = 20) -> list[tuple[str, dict[str, str]]]:
        ids = [keys.text(i) for i in await self.r.zrevrange(keys.TURNS, 0, limit - 1)]
        async with self.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(keys.turn(i))
            rows = await p.execute()
        return [(i, keys.record(h)) for i, h in zip(ids, rows, strict=True)]

    # --- calls -------------------------------------------------------------------------------

    async def claim(self, inv: ToolInvocation, queue: str) -> bool:
        """Record the call as queued; False if it was already dispatched (never send twice)."""
        fields = _record_fields(inv, CallState.QUEUED, queue=queue, queued_at=time.time())
        return bool(await self._claim(keys=_call_keys(inv), args=[keys.RECORD_TTL, inv.task_id, inv.call_id, *fields]))

    async def claim_and_send(self, inv: ToolInvocation, queue: str, queue_key: str, message: str) -> Sent:
        """Claim the call as `claim` does, push its task `message` onto the broker's list `queue_key`
        and mark it sent, in one script: one round trip on every call's path, and no moment where an
        orchestrator killed leaves a call claimed but unsent, or sent but not marked. Re-running it
        is harmless (it sends nothing twice), so redis-py may retry it after a lost reply."""
        fields = _record_fields(inv, CallState.QUEUED, queue=queue, queued_at=time.time())
        return Sent(await self._claim_and_send(keys=[*_call_keys(inv), queue_key],
                                               args=[keys.RECORD_TTL, inv.task_id, inv.call_id, message, *fields]))

    async def mark_throttled(self, inv: ToolInvocation, reason: str) -> None:
        """List a call held back by a limit (`toolq status` shows it `throttled`); a no-op once it
        has a record (the claim may have come first). The claim then takes it as never sent."""
        fields = _record_fields(inv, CallState.THROTTLED, throttled_by=reason, throttled_at=time.time())
        await self._throttled(keys=_call_keys(inv), args=[keys.RECORD_TTL, inv.task_id, inv.call_id, *fields])

    async def never_sent(self, task_id: str) -> bool:
        """Claimed, still queued, and never marked sent: its orchestrator died before sending it."""
        sent, state = await self.r.hmget(keys.call(task_id), "sent", "state")
        return sent is None and state == CallState.QUEUED.value.encode()

    async def record_unqueued(self, turn_id: str, step: int, output_index: int, call_id: str, tool: str,
                              state: str, task_id: str) -> None:
        """A call that never reached the queue (bad arguments, unknown tool): still listed."""
        async with self.r.pipeline(transaction=False) as p:
            p.hset(keys.call(task_id), mapping={"task_id": "", "call_id": call_id, "turn_id": turn_id, "tool": tool,
                                                "state": state, "step": step, "output_index": output_index,
                                                "queued_at": time.time(), "finished_at": time.time()})
            p.expire(keys.call(task_id), keys.RECORD_TTL)
            p.rpush(keys.turn_calls(turn_id), task_id)
            await p.execute()

    async def set_state(self, task_id: str, state: str, **fields: Any) -> None:
        """Record a state the orchestrator decided (timed out, lost, cancelled...)."""
        mapping = {"state": state, **{k: v for k, v in fields.items() if v is not None}}
        await self.r.hset(keys.call(task_id), mapping={k: str(v) for k, v in mapping.items()})

    async def recorded_end(self, task_id: str) -> tuple[CallState, str] | None:
        state, worker, finished = await self.r.hmget(keys.call(task_id), "state", "worker", "finished_at")
        ended = parse_state(keys.text(state)) if state else None
        if ended is None or not ended.terminal or not finished or not worker:
            return None
        return ended, keys.text(worker)

    async def calls(self, turn_id: str) -> list[dict[str, str]]:
        ids = [keys.text(i) for i in await self.r.lrange(keys.turn_calls(turn_id), 0, -1)]
        async with self.r.pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(keys.call(i))
            rows = await p.execute()
        return [keys.record(h) for h in rows]

    async def started_at(self, task_id: str) -> float | None:
        """When the worker started the call, by the worker's own clock (None: not recorded)."""
        raw = await self.r.hget(keys.call(task_id), "started_at")
        try:
            return float(raw) if raw else None
        except ValueError:
            return None

    # --- cancel ------------------------------------------------------------------------------

    async def cancel_turn(self, turn_id: str, reason: str = "user") -> None:
        """Durable first (workers check it before starting), then tell the running orchestrator."""
        await self.r.set(keys.cancel_turn(turn_id), json.dumps({"reason": reason, "at": time.time()}),
                         ex=keys.RECORD_TTL)
        await self.r.publish(keys.cancel_channel(turn_id), json.dumps({"scope": "turn"}))

    async def cancel_call(self, turn_id: str, task_id: str) -> None:
        await self.r.set(keys.cancel_call(task_id), "1", ex=keys.RECORD_TTL)
        await self.r.publish(keys.cancel_channel(turn_id), json.dumps({"scope": "call", "task_id": task_id}))

    async def wait_for_cancel(self, turn_id: str) -> None:
        """Return once the turn is cancelled from any process (`toolq cancel`, Ctrl-C elsewhere).

        One subscription for all the turns of this ledger (cancel_listener.py); the durable record
        is checked once it is confirmed, so a cancel sent earlier counts too."""
        await self._cancel_listener().wait(turn_id)

    def on_call_cancel(self, turn_id: str, heard: Callable[[str], None]) -> Callable[[], None]:
        """Tell `heard` the task id of each call of the turn cancelled alone while the turn's cancel
        is waited for; returns what stops it."""
        return self._cancel_listener().on_call(turn_id, heard)

    def _cancel_listener(self) -> CancelListener:
        if self._cancels is None:
            self._cancels = CancelListener(self.r, self.is_cancelled, self.is_call_cancelled)
        return self._cancels

    async def is_call_cancelled(self, task_id: str) -> bool:
        return bool(await self.r.exists(keys.cancel_call(task_id)))

    async def next_step(self, turn_id: str) -> int:
        """A step number no other caller of this turn gets (successive `Fleet.run_calls` never collide).

        Taken from the turn's counter in blocks of `STEP_BLOCK`: one round trip per block, not
        per step (another process's calls of the turn get numbers from another block)."""
        taken = self._steps.pop(turn_id, None)
        if taken is None or taken[0] >= taken[1]:
            async with self.r.pipeline(transaction=True) as p:
                p.incrby(keys.turn_steps(turn_id), STEP_BLOCK)
                p.expire(keys.turn_steps(turn_id), keys.RECORD_TTL)
                end, _ = await p.execute()
            taken = (int(end) - STEP_BLOCK, int(end))
        self._steps[turn_id] = (taken[0] + 1, taken[1])  # most recent last: the oldest is dropped first
        if len(self._steps) > STEP_BLOCKS_KEPT:
            del self._steps[next(iter(self._steps))]
        return taken[0]

    async def is_draining(self, hostname: str) -> bool:
        """A worker in warm shutdown: silent to pings, still finishing its calls."""
        return bool(await self.r.exists(keys.draining(hostname)))

    async def is_cancelled(self, turn_id: str) -> bool:
        return bool(await self.r.exists(keys.cancel_turn(turn_id)))


#: The state `toolq turns` and `toolq status` show for a running turn nobody drives.
ORPHANED = "orphaned"


async def mark_orphans(r: aioredis.Redis, turns: list[tuple[str, dict[str, str]]]) -> None:
    """Show a turn still `running` whose lease lapsed as `orphaned`: a durable turn whose
    orchestrator died (`toolq resume` finishes it), or a `Fleet` turn no open `Fleet` touches."""
    running = [(t, h) for t, h in turns
               if h.get("state") == "running" and ("settings" in h or h.get("driver") == FLEET_DRIVER)]
    if not running:
        return
    async with r.pipeline(transaction=False) as p:
        for t, _ in running:
            p.exists(keys.turn_lease(t))
        leases = await p.execute()
    for (_, h), leased in zip(running, leases, strict=True):
        if not leased:
            h["state"] = ORPHANED
