"""The Redis side of fleet-wide limits, shared by orchestrators and workers (no I/O here).

`max_concurrency`: a lease-based semaphore per tool. Its holders are a sorted set of task ids
scored by lease expiry (Redis's own clock, so hosts' clocks never matter). Taking a permit prunes
expired leases first, so a permit held by a crashed worker or orchestrator is free again once its
lease lapses; a holder renews its lease while the call is queued (the orchestrator) and while it
runs (the worker). The member is the task id: taking it again is a renewal (a resumed turn, a
worker confirming the permit its orchestrator took), and releasing only ever removes one's own.

`rate_limit`: a sliding log per tool of the last window's starts; a refused start is told how long
to wait, so nobody polls.
"""

from __future__ import annotations

from pydantic import BaseModel

from toolq.core import keys

# KEYS: holders. ARGV: task id, limit, lease ms. 1: held (taken or renewed), 0: every permit is taken.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return 1
end
return 0
"""

# KEYS: holders. ARGV: task id, lease ms. 1: renewed, 0: not held (released, or its lease lapsed).
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) > now then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""

# KEYS: holders. ARGV: task id, channel, tool. Tells waiting orchestrators a permit is free.
RELEASE = """
local n = redis.call('ZREM', KEYS[1], ARGV[1])
if n == 1 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
return n
"""

# KEYS: starts. ARGV: task id, calls, window ms. 0: may start now (recorded); else ms to wait.
RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], now, ARGV[1])
    redis.call('PEXPIRE', KEYS[1], window)
    return 0
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return math.max(1, tonumber(oldest[2]) + window - now)
"""


class Permit(BaseModel):
    """A max_concurrency permit the orchestrator took for a call; it travels with the invocation so
    the worker renews it while the call runs and releases it at the end."""

    tool: str
    limit: int
    lease: float
    """Seconds the permit outlives its holders' last renewal."""

    @property
    def key(self) -> str:
        return keys.limit_holders(self.tool)

    @property
    def lease_ms(self) -> int:
        return int(self.lease * 1000)

    @property
    def renew_every(self) -> float:
        return self.lease / 3
