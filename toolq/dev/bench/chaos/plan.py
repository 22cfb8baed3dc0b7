"""The campaign's plans: the faults it draws from, and each turn's script, seeded (a deck per
round, so a short campaign still meets every fault)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from toolq.dev.fake_model import builders as b

CHAOS_TOOLS = "toolq.dev.bench.chaos_tools"
#: A turn's deadline (TOOLQ_TURN_TIMEOUT); a turn that takes 10 s more has hung.
DEADLINE = 30.0
LATE_BY = 10.0
#: The killed orchestrator's lease: `toolq resume` may take over this long after the kill.
LEASE = 1.0

#: The client's stream idle timeout (TOOLQ_STREAM_IDLE_TIMEOUT); a stalled stream stalls longer.
IDLE_TIMEOUT = 3.0
STALL = IDLE_TIMEOUT + 2
#: How long a warm shutdown may take before the worker is SIGKILLed (the hang call sleeps 6 s).
WARM_GRACE = 15.0

STREAM_FAULTS = ("none", "500", "429", "cut", "malformed", "stall")
FLEET_FAULTS = ("none", "cancel", "cancel_call", "cancel_before_start", "cancel_mid_stream", "kill_child",
                "kill_worker", "warm_shutdown", "redis_restart", "kill_orchestrator", "kill_orchestrator_mid_stream")
#: Fleet faults whose response is held (a gate, a stall before any call): a stream fault at the
#: response's end would never be reached.
HELD = ("kill_orchestrator_mid_stream", "cancel_mid_stream", "cancel_before_start")
#: Fleet faults that cost a worker mid-call: its calls may be answered `lost`, not run.
WORKER_LOST = ("kill_worker", "warm_shutdown")
#: Faults only the hosts harness can make (`hosts.py`), once the hang call runs, then healed:
#: its worker cut from Redis for less and for more than the catalog's 8 s window, Redis's replies
#: to its worker lost (one way), the orchestrator cut from Redis, the workers' links slowed.
NETWORK_FAULTS = ("cut_worker_short", "cut_worker_long", "drop_redis_to_worker", "cut_orchestrator", "slow_link")
HOSTS_FAULTS = (*FLEET_FAULTS, *NETWORK_FAULTS)
#: On a primary, a replica and three sentinels (`--sentinel`): the primary SIGKILLed mid-call and the
#: replica promoted stands for the Redis restart.
SENTINEL_FAULTS = (*(f for f in HOSTS_FAULTS if f != "redis_restart"), "failover")
#: Faults that cost Redis (a restart, a failover): a call may be stopped before it ran.
REDIS_LOST = ("redis_restart", "failover")
#: A partition can cost calls a worker had taken but not started (answered, never run).
CUT = NETWORK_FAULTS[:4]
SHAPES = ("calls", "calls", "wide", "flood")
WIDE = 32
TERMINAL = ("turn.completed", "turn.aborted", "turn.failed")
#: The history items that answer a call.
OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")


@dataclass
class TurnPlan:
    turn: int
    script: list
    counts: dict[str, int]
    """How many calls carry each call_id (a duplicate call_id runs, and is answered, twice)."""
    shape: str
    stream: str
    fleet: str

    @property
    def hang_id(self) -> str:
        return f"call_{self.turn}_hang"

    @property
    def calls(self) -> int:
        return sum(self.counts.values())


class Deck:
    """Draws from `choices` so each comes up once per round, in a seeded order: a short campaign
    still meets every fault."""

    def __init__(self, rng: random.Random, choices: tuple[str, ...]) -> None:
        self.rng, self.choices = rng, choices
        self.left: list[str] = []

    def draw(self) -> str:
        if not self.left:
            self.left = list(self.choices)
            self.rng.shuffle(self.left)
        return self.left.pop()


class Planner:
    def __init__(self, seed: int, fleet: tuple[str, ...] = FLEET_FAULTS) -> None:
        self.rng = random.Random(seed)
        self.shapes, self.fleet = Deck(self.rng, SHAPES), Deck(self.rng, fleet)

    def plan(self, turn: int) -> TurnPlan:
        rng = self.rng
        shape, fleet = self.shapes.draw(), self.fleet.draw()
        if fleet == "slow_link" and shape == "flood":  # 10 MB on a slowed link outlasts any deadline
            shape = "calls"
        # mid-stream, the response stops before its end: a cut or malformed end would never be sent
        stream = rng.choice(STREAM_FAULTS[:3] if fleet in HELD else STREAM_FAULTS)
        n = WIDE if shape == "wide" else rng.randint(1, 8)
        ids = [f"call_{turn}_{i}" for i in range(n)]
        if n > 1 and rng.random() < 0.3:
            ids[-1] = ids[0]  # a duplicate call_id: both calls run, both are answered
        calls = [b.function_call("chaos_count", {}, i) for i in ids]
        if shape == "flood":
            ids.append(f"call_{turn}_flood")
            calls.insert(rng.randint(0, len(calls)), b.function_call("chaos_flood", {"mib": 10}, ids[-1]))
        if fleet != "none":  # something running long enough to cancel or kill (or to outlive its orchestrator)
            ids.append(f"call_{turn}_hang")
            seconds = 3 if fleet.startswith("kill_orchestrator") else 6
            calls.append(b.function_call("chaos_hang", {"seconds": seconds}, ids[-1]))
        script: list = []
        if stream == "500":
            script.append([b.http_error(500)])
        elif stream == "429":
            script.append([b.http_error(429, headers={"retry-after-ms": "50"})])
        if fleet in ("kill_orchestrator_mid_stream", "cancel_mid_stream"):
            script.append(b.response(*calls, b.gate()))  # the calls are committed; response.completed never comes
        elif fleet == "cancel_before_start":  # cancelled while the response has sent no call yet
            script.append(b.response(b.stall(IDLE_TIMEOUT / 2), *calls))
        elif stream == "stall":  # the client's idle timeout turns the silence into a retried request
            script.append(b.response(*calls, b.stall(STALL)))
        elif stream == "cut":
            script.append(b.response(*calls, b.cut_after(clean=False)))
        elif stream == "malformed":
            script.append(b.response(*calls, b.malformed_frame()))
        else:
            script.append(calls)
        script.append([b.message(f"turn {turn} done")])
        return TurnPlan(turn, script, dict(Counter(ids)), shape, stream, fleet)
