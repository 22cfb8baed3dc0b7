"""`toolq bench chaos --turns N --seed S`: the seeded fault campaign of issue 13, also run (short)
by tests/integration/test_campaign.py.

Each campaign owns its stack (a private Redis, AOF on for odd seeds and off for even ones, a real
prefork worker loading `chaos_tools`) and the fake model. Every turn draws a shape (a few calls, a
32-call step, a 10 MB output, duplicate call_ids), a stream fault (HTTP 500/429, a cut stream, a
malformed frame, a stall longer than the client's idle timeout) and a fleet fault (a cancel of the
turn mid-call, mid-stream before `response.completed` or before any call came, a cancel of one
call as `toolq cancel TURN --call` does, a SIGKILLed pool child or whole worker mid-call, a warm
shutdown mid-call (each followed by a new worker), a Redis restart, or a SIGKILLed orchestrator,
mid-call or mid-stream, followed by `toolq resume`). Nothing raises on a broken contract: each is
counted as a violation and named, so the bench prints the whole table and the test asserts it is
empty.

Checked on every turn: every model request's input is paired, the final history answers every
call exactly once, no call ran more often than it was asked for (the tools' own evidence), a
completed turn ran every call, one terminal event, a cancel ends `cancelled`, the turn ended within
its deadline, the calls' processes are gone, every output is the tool's own or one of toolq's
statements and never an infrastructure exception's text (`toolq/core/honest.py`; the report counts
outputs by form); after the campaign, nothing it started is running.
The call a fault hit is told the truth: a cancelled call `cancelled`, a call on a SIGKILLed worker
`lost` (it may have run), a call on a worker shut down warm `completed` only if it finished; no
call is answered `completed` without having run; a stalled stream is retried after the idle timeout.

With `--hosts` (`hosts.py`) the same campaign runs on the hosts harness: Redis, the orchestrator
and two workers each in a network namespace of its own, with `NETWORK_FAULTS` beside the others
(a worker cut from Redis for less and for more than the catalog's window, one-way loss from Redis
to a worker, the orchestrator cut from Redis, slow links), healed after each; and after each, every
worker serves again without a restart.

The package: `plan.py` draws the turns, `campaign.py` runs and checks them, `procs.py` looks at
processes, `hosts.py` is the hosts harness's stack; here, the bench and its report.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from toolq.dev.bench.chaos.campaign import Campaign, Tally, TurnRun
from toolq.dev.bench.chaos.plan import (
    CHAOS_TOOLS,
    FLEET_FAULTS,
    HELD,
    HOSTS_FAULTS,
    IDLE_TIMEOUT,
    NETWORK_FAULTS,
    SENTINEL_FAULTS,
    SHAPES,
    WIDE,
    Deck,
    Planner,
    TurnPlan,
)

__all__ = ["CHAOS_TOOLS", "FLEET_FAULTS", "HELD", "HOSTS_FAULTS", "IDLE_TIMEOUT", "NETWORK_FAULTS", "SENTINEL_FAULTS",
           "SHAPES", "WIDE", "Campaign", "Deck", "Planner", "Tally", "TurnPlan", "TurnRun", "campaign", "parse_seeds",
           "report", "run"]

# --- the bench -----------------------------------------------------------------------------------


def campaign(seed: int, turns: int, workdir: Path | None = None, fleet: tuple[str, ...] = FLEET_FAULTS,
             hosts: bool = False, sentinel: bool = False) -> Tally:
    """Run one seeded campaign of `turns` turns in `workdir`, else in a temporary directory that
    is removed unless a contract broke (then `Tally.kept` names it: workers' and orchestrators' logs).
    With `hosts`, on the hosts harness (`hosts.py`), in the harness's own directory; with
    `sentinel` too, on a primary, a replica and three sentinels there."""
    if hosts or sentinel:
        from toolq.dev.bench.chaos.hosts import HostsCampaign

        return HostsCampaign(seed, sentinel=sentinel).run(turns, fleet)
    if workdir is not None:
        return Campaign(seed, workdir).run(turns, fleet)
    tmp = Path(tempfile.mkdtemp(prefix=f"toolq-chaos-{seed}-"))
    tally = Campaign(seed, tmp).run(turns, fleet)
    if tally.violations:
        tally.kept = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return tally


def report(t: Tally) -> list[str]:
    def counts(c: Counter) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"

    rows = [("faults injected", counts(t.faults)), ("turns ended", counts(t.outcomes)),
            ("calls answered", counts(t.answered)), ("pairing violations", len(t.pairing)),
            ("double executions", len(t.double)), ("past their deadline", f"{len(t.late)}   (slowest: {slowest(t)})"),
            ("leftover processes", len(t.leftovers)), ("infrastructure output", len(t.guessed)),
            ("outputs by form", counts(t.forms)), ("other broken contracts", len(t.broken)),
            ("requeued, dead worker", t.requeued)]
    kind = "chaos --hosts --sentinel" if t.sentinel else "chaos --hosts" if t.hosts else "chaos"
    lines = [f"{kind} seed {t.seed} (Redis {'with AOF' if t.aof else 'without persistence'}): {t.turns} turns, "
             f"{t.calls} calls in {t.seconds:.0f} s", *(f"  {label:<22} : {value}" for label, value in rows)]
    if t.why:  # what the calls that did not complete were told (the commonest)
        lines += ["  calls not completed, as told:", *(f"    {n:>4} x {why}" for why, n in t.why.most_common(6))]
    lines += [f"  VIOLATION {v}" for v in t.violations]
    return lines + ([f"  logs kept in {t.kept}"] if t.kept else [])


def slowest(t: Tally) -> str:
    if not t.turn_seconds:
        return "none"
    what, took = max(t.turn_seconds.items(), key=lambda kv: kv[1])
    return f"{took:.1f}s, {what.split(' ', 2)[-1]}"


def parse_seeds(text: str) -> list[int]:
    """`3` or a range `1..3`."""
    lo, sep, hi = text.partition("..")
    return list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]


def run(out: IO[str] = sys.stdout, turns: int = 24, seeds: Sequence[int] = (1,), hosts: bool = False,
        sentinel: bool = False) -> dict[str, Any]:
    # Faults make toolq warn by design (lost results, reconnects); the table says what matters.
    logging.getLogger("toolq").setLevel(logging.ERROR)
    hosts = hosts or sentinel
    if hosts:
        from toolq.dev.hosts import cannot_run

        reason = cannot_run()
        if reason:
            print(f"chaos --hosts: {reason}", file=out, flush=True)
            return {"turns": 0, "calls": 0, "violations": 1}
    tallies = []
    for seed in seeds:
        fleet = SENTINEL_FAULTS if sentinel else HOSTS_FAULTS if hosts else FLEET_FAULTS
        tallies.append(campaign(seed, turns, fleet=fleet, hosts=hosts, sentinel=sentinel))
        print("\n".join(report(tallies[-1])), file=out, flush=True)
    violations = sum(len(t.violations) for t in tallies)
    print(f"chaos: {len(tallies)} campaign(s), {violations} violation(s)", file=out, flush=True)
    return {"turns": sum(t.turns for t in tallies), "calls": sum(t.calls for t in tallies),
            "violations": violations}


if __name__ == "__main__":
    run()
