"""`toolq bench chaos --hosts`: the seeded fault campaign (this package) on the hosts harness
(`toolq/dev/hosts.py`, issue 27 item 4).

Redis, the orchestrator and two workers are separate hosts, each a network namespace of its own,
joined by a bridge. The turns run in this process as in the single-host campaign, but on the
orchestrator's network (`Hosts.inside`): the fake model listens on that host's loopback, Redis
and the workers are reached over the harness's links, and a killed orchestrator's `toolq run` is
started there too. Every fault of `FLEET_FAULTS` is made as there (a killed or warm-stopped worker
is the one running the hang call, restarted on its own host), and `NETWORK_FAULTS` beside them,
once the hang call runs: its worker cut from Redis for less (`SHORT`) and for more (`LONG`) than
the fleet catalog's 8 s window, Redis's replies to its worker dropped (one way) for `LONG`, the
orchestrator cut from Redis for `LONG`, or both workers' links slowed to `RATE` for the rest of
the turn; then healed. After each, the checks of `campaign.py`, and every worker serving again: the
same process as before (never restarted), back in the fleet catalog within `3 * CATALOG_TTL`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from toolq.dev.bench.chaos.campaign import Campaign
from toolq.dev.bench.chaos.plan import CHAOS_TOOLS, TurnPlan
from toolq.dev.hosts import Hosts, HostSentinels

ROLES = ["redis", "orch", "w1", "w2"]
WORKERS = ("w1", "w2")
#: The fleet catalog's record TTL (toolq/workers/presence.py): a worker silent this long is lost.
CATALOG_TTL = 8.0
SHORT = CATALOG_TTL / 3
LONG = 2 * CATALOG_TTL
RATE = "256kbit"


class HostsCampaign(Campaign):
    """The campaign with Redis, the orchestrator and two workers on hosts a network joins."""

    def __init__(self, seed: int, *, concurrency: int = 2, sentinel: bool = False) -> None:
        super().__init__(seed, Path(), concurrency=concurrency)  # the harness's directory, set by stack()
        self.tally.hosts, self.tally.sentinel = True, sentinel
        self.sentinel_master = HostSentinels.MASTER if sentinel else None
        self.hosts: Hosts | None = None
        self.touched: dict[str, int] = {}
        """The workers a network fault of this turn touched: role, and the process that must still serve."""

    @property
    def h(self) -> Hosts:
        assert self.hosts is not None, "the harness runs only inside stack()"
        return self.hosts

    @contextmanager
    def stack(self) -> Iterator[None]:
        with Hosts(ROLES, workers=set(WORKERS)) as self.hosts:
            self.workdir, self.workspace = self.h.dir, self.h.workspace
            self.server = self.h.sentinels(args=self.redis_args) if self.sentinel_master else \
                self.h.redis(args=self.redis_args)
            for role in WORKERS:
                self.workers[role] = self.new_worker(role, f"chaos{self.seed}-{role}@{self.h.netns(role)}")
                self.workers[role].start(wait=False)
            for w in self.workers.values():
                w.wait_ready()
            try:
                with self.h.inside("orch"):
                    yield
            finally:
                self.h.heal()
                self.stop_workers()
                self.server.stop()
                self.count_leftovers()  # before the harness's close kills whatever is left
        if self.tally.violations:
            self.tally.kept = self.h.dir
        else:
            self.h.remove_dir()

    def new_worker(self, role: str, name: str) -> Any:
        return self.h.worker(role, self.server.url, start=False, name=name, concurrency=self.concurrency,
                             tools=[CHAOS_TOOLS], env={"TOOLQ_SIGNING_KEY": self.signing_key,
                                  **({"TOOLQ_SENTINEL_MASTER": self.sentinel_master} if self.sentinel_master else {})})

    def role_of(self, pid: int) -> str:
        role = self.h.host_of(pid)
        return role if role in self.workers else WORKERS[0]

    async def network_fault(self, plan: TurnPlan, pid: int) -> None:
        await asyncio.to_thread(self._partition, plan.fleet, self.role_of(pid))

    def _partition(self, fault: str, role: str) -> None:
        h = self.h
        self.touched = {r: w.pid for r, w in self.workers.items()}
        if fault == "slow_link":  # healed after the turn
            for r in WORKERS:
                h.throttle(r, RATE)
            return
        try:
            if fault in ("cut_worker_short", "cut_worker_long"):
                h.cut(role, "redis")
            elif fault == "drop_redis_to_worker":
                h.drop("redis", role)
            elif fault == "cut_orchestrator":
                h.cut("orch", "redis")
            time.sleep(SHORT if fault == "cut_worker_short" else LONG)
        finally:
            h.heal()

    def after_turn(self, plan: TurnPlan, what: str) -> None:
        """After a network fault, healed: each worker is the process it was, and advertises again."""
        self.h.heal()
        touched, self.touched = self.touched, {}
        for role, pid in touched.items():
            w = self.workers[role]
            if w.pid != pid or w.proc is None or w.proc.poll() is not None:
                self.tally.broken.append(f"{what}: worker {role} was restarted or died after the heal "
                                         f"(pid {pid}, now {w.pid})")
            elif not self._advertised_within(w.name, 3 * CATALOG_TTL):
                self.tally.broken.append(f"{what}: worker {role} is not in the fleet catalog "
                                         f"{3 * CATALOG_TTL:g}s after the heal")

    def _advertised_within(self, name: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while True:
            found = self.server.cli("--scan", "--pattern", "toolq:fleet:worker:*").split()
            if found and name in self.server.cli("mget", *found):
                return True
            if time.monotonic() > end:
                return False
            time.sleep(0.5)
