"""Limits as one orchestrator process applies them, before a call is sent (docs/ARCHITECTURE.md).

The barrier asks `admit()` for each call after the turn's own cap; it returns once the tool's
fleet-wide limits let the call go (a max_concurrency permit held, a rate-limit start recorded),
or None when the call's deadline passed first. A call that must wait is reported throttled once
(`on_wait`) and is never failed for the limit. Waiting never polls hard: this process's waiters
for a tool queue in order behind one lock, the first one retries when a permit is released (one
pub/sub subscription per process, opened when something first waits) or after a backoff capped
at a second (a lease that lapsed publishes nothing); a rate limit says how long to wait.

`Limits` (no fleet limits) serves the in-memory transport; `FleetLimits` is Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from toolq.core import keys
from toolq.core.calls import ToolInvocation
from toolq.core.catalog import ToolSpec
from toolq.core.permits import ACQUIRE, RATE, RELEASE, RENEW, Permit
from toolq.core.tool_limits import UNLIMITED, Rate, ToolLimit
from toolq.telemetry import metrics

log = logging.getLogger("toolq.limits")

#: A waiter's first retry without a release message, doubling to the cap.
FIRST_RETRY, MAX_RETRY = 0.05, 1.0

OnWait = Callable[[str], None]


@dataclass
class Admission:
    """What `admit` let through: the invocation to send (carrying its permit, if any)."""

    invocation: ToolInvocation
    release: Callable[[], None] = lambda: None
    """Give back what was taken (idempotent; the worker releases the permit too)."""


def _noting(on_wait: OnWait, held: list[float]) -> OnWait:
    """`on_wait`, noting when it was first called (a call held back, from then)."""
    def noted(why: str) -> None:
        if not held:
            held.append(time.monotonic())
        on_wait(why)
    return noted


class TurnSlots:
    """The turn's cap on calls in flight (TOOLQ_MAX_PARALLEL_CALLS; a turn's steps run one after
    another, so one step's cap is the turn's), taken in call order."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._slots = asyncio.Semaphore(cap) if cap else None

    async def take(self, deadline: float, on_wait: OnWait, tool: str = "unknown") -> bool:
        """One slot; False: the deadline passed while waiting (`on_wait` heard why it waits).
        `tool`: the call's (declared) tool, for the limit-wait metric."""
        if self._slots is None:
            return True
        if not self._slots.locked():
            await self._slots.acquire()  # taken at once, with no suspension: the next call sees it taken
            return True
        on_wait(f"the turn's cap of {self.cap} calls in flight (TOOLQ_MAX_PARALLEL_CALLS)")
        held = time.monotonic()
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=max(deadline - time.time(), 0.0))
        except TimeoutError:
            return False
        finally:
            metrics.limit_wait("parallel", tool, time.monotonic() - held)
        return True

    def give_back(self) -> None:
        if self._slots is not None:
            self._slots.release()


class Limits:
    """No fleet-wide limits: only the per-turn cap (the in-memory transport, `toolq.testing`)."""

    def __init__(self, max_parallel_calls: int | None = None) -> None:
        self.max_parallel_calls = max_parallel_calls

    def limit_for(self, spec: ToolSpec) -> ToolLimit:
        return UNLIMITED

    async def admit(self, inv: ToolInvocation, spec: ToolSpec, deadline: float, on_wait: OnWait) -> Admission | None:
        return Admission(inv)

    async def aclose(self) -> None:
        pass


class FleetLimits(Limits):
    """max_concurrency and rate limits across the fleet, in Redis (toolq/core/permits.py)."""

    def __init__(self, r: aioredis.Redis, *, max_parallel_calls: int | None, overrides: dict[str, ToolLimit],
                 lease: float) -> None:
        super().__init__(max_parallel_calls)
        self.r = r
        self.overrides = overrides
        self.lease = lease
        self._acquire = r.register_script(ACQUIRE)
        self._renew = r.register_script(RENEW)
        self._release = r.register_script(RELEASE)
        self._rate = r.register_script(RATE)
        self._queues: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        """Per tool (and per tool's rate): this process's waiters, first come first served."""
        self._released: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._waiting: set[str] = set()
        """Limits (a tool, or `rate:` and a tool) a caller here waits for, holding their lock: the
        fleet's permits are taken, or the rate window is full."""
        self._behind: defaultdict[str, list[OnWait]] = defaultdict(list)
        """Per tool, callers queued behind a try still under way: told if that try fails."""
        self._held: dict[str, Permit] = {}
        """Task id -> the permit this process holds for it (renewed until released)."""
        self._keeper: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    def limit_for(self, spec: ToolSpec) -> ToolLimit:
        """The tool's declared limits with the settings' override (TOOLQ_TOOL_LIMITS) applied."""
        return spec.limit.over(self.overrides.get(str(spec.tool_name)))

    async def admit(self, inv: ToolInvocation, spec: ToolSpec, deadline: float, on_wait: OnWait) -> Admission | None:
        limit = self.limit_for(spec)
        if not limit.limited:
            return Admission(inv)
        tool = str(spec.tool_name)
        permit = None
        if limit.max_concurrency is not None:
            permit = Permit(tool=tool, limit=limit.max_concurrency, lease=self.lease)
            if not await self._take(permit, inv.task_id, deadline, on_wait):
                return None
            inv = inv.model_copy(update={"permit": permit})
        release = (lambda: self.release(inv.task_id)) if permit else (lambda: None)
        try:
            if limit.rate_limit is not None and not await self._start(tool, limit.rate_limit, inv.task_id, deadline,
                                                                      on_wait):
                release()
                return None
        except BaseException:
            release()
            raise
        return Admission(inv, release)

    # --- max_concurrency ---------------------------------------------------------------------------

    async def _take(self, permit: Permit, task_id: str, deadline: float, on_wait: OnWait) -> bool:
        return await self._in_order(permit.tool, f"max_concurrency={permit.limit} of {permit.tool}", on_wait,
                                    lambda: self._try(permit, task_id),
                                    lambda: self._wait_for_permit(permit, task_id, deadline))

    async def _in_order(self, key: str, why: str, on_wait: OnWait, first: Callable[[], Awaitable[bool]],
                        wait: Callable[[], Awaitable[bool]]) -> bool:
        """This process's callers of one limit go one at a time, in arrival order (a step's calls in
        call order): tries made at once could reach Redis in either order and let a later call go
        first. `first` is the quick try; when it fails the caller is throttled and `wait` decides.
        One that finds a waiter ahead is held back at once; one behind a quick try, if that try fails."""
        queue, behind = self._queues[key], self._behind[key]
        held: list[float] = []  # when it was first held back (the limit-wait metric)
        if metrics.on():
            on_wait = _noting(on_wait, held)
        if queue.locked():
            if key in self._waiting:
                on_wait(why)
            else:
                behind.append(on_wait)
        try:
            async with queue:
                if on_wait in behind:
                    behind.remove(on_wait)
                if await first():
                    return True
                on_wait(why)
                for held_back in behind:
                    held_back(why)
                behind.clear()
                self._waiting.add(key)
                try:
                    return await wait()
                finally:
                    self._waiting.discard(key)
        finally:
            if on_wait in behind:
                behind.remove(on_wait)
            if held:
                limit, tool = ("rate", key.removeprefix("rate:")) if key.startswith("rate:") else ("concurrency", key)
                metrics.limit_wait(limit, tool, time.monotonic() - held[0])

    async def _wait_for_permit(self, permit: Permit, task_id: str, deadline: float) -> bool:
        self._listen()
        delay = FIRST_RETRY
        released = self._released[permit.tool]
        while True:
            released.clear()  # before trying: a release from here on wakes the wait below
            if await self._try(permit, task_id):
                return True
            remaining = deadline - time.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(released.wait(), timeout=min(delay, remaining))
            except TimeoutError:
                delay = min(delay * 2, MAX_RETRY)

    async def _try(self, permit: Permit, task_id: str) -> bool:
        try:
            got = bool(await self._acquire(keys=[permit.key], args=[task_id, permit.limit, permit.lease_ms]))
        except asyncio.CancelledError:
            # Redis may have granted it as the cancel came: give back our own (never another's).
            self._spawn(self._give_back(permit, task_id))
            raise
        if got:
            self._held[task_id] = permit
            self._keep()
        return got

    def release(self, task_id: str) -> None:
        """Give back the permit held for this call, if any (in the background: never in the way of
        an output). Only this call's own permit can go: the member is its task id."""
        permit = self._held.pop(task_id, None)
        if permit is not None:
            self._released[permit.tool].set()  # this process's next waiter need not hear it from Redis
            self._spawn(self._give_back(permit, task_id))

    async def _give_back(self, permit: Permit, task_id: str) -> None:
        try:
            await self._release(keys=[permit.key], args=[task_id, keys.LIMIT_RELEASED, permit.tool])
        except Exception as e:  # Redis away: the lease lapses by itself
            log.warning("could not release %s's permit for %s: %s", permit.tool, task_id, e)

    def _keep(self) -> None:
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._renew_held(), name="toolq-limits-renew")

    async def _renew_held(self) -> None:
        """Renew every permit this process holds, a third of a lease apart, while it holds any."""
        while self._held:
            await asyncio.sleep(self.lease / 3)
            held = list(self._held.items())
            try:
                async with self.r.pipeline(transaction=False) as p:
                    for task_id, permit in held:
                        await self._renew(keys=[permit.key], args=[task_id, permit.lease_ms], client=p)
                    renewed = await p.execute()
            except Exception as e:  # the lease may lapse meanwhile; the next beat tries again
                log.warning("renewing %d permit(s) failed: %s", len(held), e)
                continue
            for (task_id, permit), ok in zip(held, renewed, strict=True):
                if not ok and self._held.get(task_id) is permit:  # the worker released it, or it lapsed
                    del self._held[task_id]

    def _listen(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.create_task(self._hear_releases(), name="toolq-limits-listen")

    async def _hear_releases(self) -> None:
        """One subscription per process: each release anywhere wakes this process's waiters for that tool."""
        pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.LIMIT_RELEASED)
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None:
                    tool = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
                    if tool in self._released:
                        self._released[tool].set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the waiters fall back on their backoff
            log.info("release listener stopped: %s", e)
        finally:
            await pubsub.aclose()

    # --- rate limits -------------------------------------------------------------------------------

    async def _start(self, tool: str, rate: Rate, task_id: str, deadline: float, on_wait: OnWait) -> bool:
        """Record the call's start in the tool's window, waiting as long as the window says."""
        async def started() -> bool:
            return not await self._count(tool, rate, task_id)

        async def wait() -> bool:
            while wait_ms := await self._count(tool, rate, task_id):
                remaining = deadline - time.time()
                if remaining <= wait_ms / 1000:
                    await asyncio.sleep(max(remaining, 0.0))
                    return False
                await asyncio.sleep(wait_ms / 1000)
            return True

        return await self._in_order("rate:" + tool, f"rate_limit={rate} of {tool}", on_wait, started, wait)

    async def _count(self, tool: str, rate: Rate, task_id: str) -> int:
        """0: the start is recorded in the window; else milliseconds until the window has room."""
        window_ms = int(rate.window * 1000)
        return int(await self._rate(keys=[keys.limit_starts(tool)], args=[task_id, rate.calls, window_ms]))

    # --- lifetime ----------------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in (self._keeper, self._listener):
            if task is not None:
                task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for task in (self._keeper, self._listener):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
