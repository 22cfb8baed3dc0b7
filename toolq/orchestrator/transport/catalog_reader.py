"""The orchestrator's view of the fleet catalog: which live worker instances serve which tool
declarations (written by `toolq.workers.presence`, shaped by `toolq.core.advert`).

Dispatch asks it, per call, whether any live worker serves the call's exact declaration; a cached
snapshot (at most `CACHE_AGE` old) answers, so a step of 32 calls costs one read. A call nobody
serves is not queued to wait for the turn's deadline: after `UNSERVED_GRACE` seconds of re-reading
(a worker may be booting) it is answered with what to start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError

from toolq.core import keys
from toolq.core.advert import ToolAdvert, WorkerAdvert
from toolq.core.catalog import DEFAULT_QUEUE, ToolSpec
from toolq.local.starting import WorkersStarting
from toolq.orchestrator.transport.indexed import read_indexed

log = logging.getLogger("toolq.fleet")

#: How old a snapshot may be when it says a tool is served.
CACHE_AGE = 1.0
#: How long a call waits for a worker that serves it before it is answered "no live worker".
UNSERVED_GRACE = 3.0
#: How often the catalog is re-read while a call waits.
POLL = 0.25
#: ... and while workers this process started are still booting (the first call waits on them).
BOOT_POLL = 0.05
#: A call waiting this long for a worker says so, in one line on stderr (`toolq run`).
NOTICE_AFTER = 1.5

BUILTIN_MODULES = "toolq.workers.tools"


@dataclass(frozen=True)
class FleetSnapshot:
    workers: tuple[WorkerAdvert, ...]
    read_at: float
    """`time.monotonic()` when it was read."""

    def servers(self, spec: ToolSpec, host: str | None = None) -> list[WorkerAdvert]:
        """Live workers serving the declaration; with `host`, only those on that environment host."""
        return [w for w in self.workers if w.serves(spec.tool_name, spec.digest())
                and (host is None or w.env_host == host)]

    def other_declarations(self, spec: ToolSpec) -> list[WorkerAdvert]:
        """Live workers that serve a tool of this name with another declaration (another version)."""
        return [w for w in self.workers if not w.draining and not w.serves(spec.tool_name, spec.digest())
                and any(t.tool_name == spec.tool_name for t in w.tools)]


def unserved_message(spec: ToolSpec, snapshot: FleetSnapshot) -> str:
    """What the model (and the user reading the turn) is told about a call nobody can run."""
    module = getattr(spec.handler, "__module__", None) if spec.handler is not None else None
    builtin = module is not None and module.startswith(BUILTIN_MODULES)
    text = f"no live worker serves tool `{spec.tool_name}`"
    if module and not builtin:
        text += f" (declared in module `{module}`)"
    others = snapshot.other_declarations(spec)
    if others:
        text += (f"; {len(others)} live worker(s) serve another declaration of it (another version of its module), "
                 "and a call only goes to a worker whose declaration is the caller's")
    # A worker consumes its tools' queues, or only its --queues: one with the module loaded may
    # still not take this one's.
    queue = (f" (its queue is `{spec.queue}`, which a worker started with --queues must list)"
             if spec.queue != DEFAULT_QUEUE else "")
    if builtin:
        return text + f": start one with `toolq worker`{queue}"
    if module:
        return text + f": start one with `toolq worker --tools {module}`{queue}"
    return text + f": start a worker that serves it{queue}"


def host_gone_message(spec: ToolSpec, host: str) -> str:
    """A call of an environment whose host has no live worker serving it (the host is gone)."""
    return (f"no live worker on host `{host}`, where this conversation's environment lives, serves tool "
            f"`{spec.tool_name}`: the host may be gone, and the environment with it (it is recreated from its "
            "last checkpoint at the next turn)")


class FleetCatalog:
    """Reads the fleet catalog from the broker's Redis (the ledger's connection)."""

    def __init__(self, r: aioredis.Redis, *, cache_age: float = CACHE_AGE, grace: float = UNSERVED_GRACE) -> None:
        self.r = r
        self.cache_age = cache_age
        self.grace = grace
        self.starting: WorkersStarting | None = None
        """Set by whoever started workers that are still booting (`toolq run`'s embedded stack)."""
        self._snapshot: FleetSnapshot | None = None
        self._lock = asyncio.Lock()
        self._serving: set[str] = set()
        self._noticed: set[str] = set()
        """Tools whose wait for a worker was said: once for all the calls waiting, not once each."""
        self._waiting: Counter[str] = Counter()
        """Calls waiting for a worker, per tool: the notice is news again once none waits."""
        self.departed_at = float("-inf")
        """`time.time()` when a read last found an instance gone that was serving (not draining) at
        the read before: a worker that died without a clean exit (`stranded.py` looks for its calls)."""

    async def read(self) -> FleetSnapshot:
        """Every live instance, now. Ids whose record has expired (a worker killed without a clean
        exit) are pruned from the index; a live worker's heartbeat re-adds its id if a race pruned it."""
        workers = []
        for instance, raw in await read_indexed(self.r, keys.FLEET_WORKERS, keys.fleet_worker):
            try:
                workers.append(WorkerAdvert.model_validate_json(raw))
            except ValidationError as e:
                log.warning("unreadable fleet catalog record %s: %s", instance, e.errors()[0]["msg"])
        workers.sort(key=lambda w: (w.hostname, w.started_at))
        if workers:  # an empty catalog (Redis restarted empty) is no news of a death
            if self._serving - {w.instance for w in workers}:
                self.departed_at = time.time()
            self._serving = {w.instance for w in workers if not w.draining}
        return FleetSnapshot(tuple(workers), time.monotonic())

    async def snapshot(self, max_age: float | None = None) -> FleetSnapshot:
        """A snapshot at most `max_age` (default `cache_age`) seconds old; concurrent callers share one read."""
        max_age = self.cache_age if max_age is None else max_age
        async with self._lock:
            if self._snapshot is None or time.monotonic() - self._snapshot.read_at > max_age:
                self._snapshot = await self.read()
            return self._snapshot

    async def workers(self) -> list[WorkerAdvert]:
        return list((await self.snapshot(max_age=0)).workers)

    async def declarations(self, max_age: float | None = None) -> list[ToolAdvert]:
        """The full declaration of every tool some live worker offers, one per digest: what an
        orchestrator needs to build a model-visible spec it has no module for (`ToolAdvert.to_spec`).
        A declaration only retiring everywhere (still routed, no longer listed) is left out."""
        workers = (await self.snapshot(max_age)).workers
        digests = sorted({t.digest for w in workers for t in w.tools if not t.retiring})
        raws = await self.r.mget([keys.fleet_tool(d) for d in digests]) if digests else []
        out = []
        for raw in raws:
            if raw is not None:
                try:
                    out.append(ToolAdvert.model_validate_json(raw))
                except ValidationError:
                    continue
        return out

    async def serves(self, spec: ToolSpec, host: str | None = None) -> bool:
        """Whether a live worker (on `host`, for a call of an environment there) serves the
        declaration by the cached snapshot (no waiting)."""
        return bool((await self.snapshot()).servers(spec, host))

    async def unserved(self, spec: ToolSpec, host: str | None = None) -> str | None:
        """None as soon as a live worker (on `host`, when given) serves the call's declaration;
        otherwise, after the grace (counted from the end of the boot of workers this process is
        starting), the output that tells the model which worker to start. A wait past
        `NOTICE_AFTER` is said once per tool, however many of its calls wait."""
        began = time.monotonic()
        end = began + self.grace
        tool = str(spec.tool_name)
        self._waiting[tool] += 1
        try:
            snapshot = await self.snapshot()
            while not snapshot.servers(spec, host):
                now = time.monotonic()
                starting = self.starting
                booting = starting is not None and starting.booting
                if booting:
                    end = now + self.grace
                elif starting is not None and starting.error:
                    return (f"no worker could run tool `{spec.tool_name}`: the workers toolq started for this run "
                            f"failed to start ({starting.error})")
                if now >= end:
                    return unserved_message(spec, snapshot) if host is None else host_gone_message(spec, host)
                if now - began >= NOTICE_AFTER and tool not in self._noticed:
                    self._noticed.add(tool)
                    log.warning("waiting for a worker to serve %s%s", spec.tool_name,
                                f" ({starting.what})" if booting and starting is not None else "")
                poll = BOOT_POLL if booting else POLL
                await asyncio.sleep(poll)
                snapshot = await self.snapshot(max_age=poll)
            return None
        finally:
            self._waiting[tool] -= 1
            if not self._waiting[tool]:  # no call waits for it any more: a later wait is news again
                del self._waiting[tool]
                self._noticed.discard(tool)
