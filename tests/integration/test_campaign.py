"""A short seeded fault campaign (issue 13, item 6), the same one `toolq bench chaos` runs longer
(toolq/dev/bench/chaos.py): turns on a real Redis (AOF for odd seeds, none for even),
a real worker and the fake model, with stream faults (HTTP 500/429, a cut stream, a malformed
frame, a stalled stream), fleet faults (cancels of the turn mid-call, mid-stream and before any
call, a cancel of one call, a SIGKILLed pool child mid-call, a SIGKILLed worker mid-call
restarted under its name, a warm shutdown of the worker mid-call then a new worker, a Redis
restart, a SIGKILLed orchestrator mid-call or mid-stream followed by `toolq resume`), 32-call
steps, 10 MB outputs and duplicate call_ids. Each seed's eleven turns meet every fleet fault of
`FLEET_FAULTS` once (a seeded deck); three seeds take
~2 minutes on a loaded 2-core machine; `./dev bench chaos --turns 24 --seed 1..3` runs longer ones.

Every model request must pair, every call must be answered once, no call may run more often than
it was asked for (the tools' own evidence), no turn may outlive its deadline, nothing may be left
running: the campaign names each broken contract, and there must be none."""

from __future__ import annotations

import os

import pytest

from toolq.dev.bench import chaos

pytestmark = pytest.mark.integration

TURNS = len(chaos.FLEET_FAULTS)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_seeded_fault_campaign_keeps_every_contract(seed, tmp_path):
    tally = chaos.campaign(seed, TURNS, tmp_path, chaos.FLEET_FAULTS)
    assert tally.turns == TURNS
    assert all(tally.faults[f"fleet:{f}"] == 1 for f in chaos.FLEET_FAULTS if f != "none"), tally.faults
    assert tally.violations == [], "\n".join(chaos.report(tally))


#: The hosts campaign's bounded run: every network fault once, and a worker SIGKILLed on its host
#: (the fault that needs the call's host found); ~1.5 minutes on a loaded 2-core machine.
HOSTS_FAULTS = (*chaos.NETWORK_FAULTS, "kill_worker")


def test_a_seeded_fault_campaign_across_hosts_keeps_every_contract():
    """The same campaign on the hosts harness (`toolq bench chaos --hosts`): Redis, the orchestrator
    and two workers in network namespaces of their own, partitioned mid-call and healed; after
    each turn the same checks, and every worker serving again without a restart."""
    from toolq.dev.hosts import cannot_run, harness_namespaces

    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    tally = chaos.campaign(4, len(HOSTS_FAULTS), fleet=HOSTS_FAULTS, hosts=True)
    assert tally.turns == len(HOSTS_FAULTS)
    assert all(tally.faults[f"fleet:{f}"] == 1 for f in HOSTS_FAULTS), tally.faults
    assert tally.violations == [], "\n".join(chaos.report(tally))
    assert not [n for n in harness_namespaces() if n.startswith(f"toolq-{os.getpid()}x")]


#: The Sentinel campaign's bounded run: two failovers (the promoted replica's old primary, back as
#: its replica, is promoted again), an orchestrator killed and resumed, a cancel of one call and a
#: worker cut from Redis past the window, on the new primaries; ~1.5 minutes on a loaded machine.
SENTINEL_FAULTS = ("failover", "failover", "kill_orchestrator", "cancel_call", "cut_worker_long")


def test_a_seeded_fault_campaign_across_hosts_on_sentinel_keeps_every_contract():
    """`toolq bench chaos --sentinel`: Redis is a primary, a replica and three sentinels on the
    Redis host, and the primary is SIGKILLed mid-call: the calls in flight get honest outputs and
    the turns go on on the promoted replica, without a restart of any process."""
    from toolq.dev.hosts import cannot_run

    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    tally = chaos.campaign(5, len(SENTINEL_FAULTS), fleet=SENTINEL_FAULTS, sentinel=True)
    assert tally.turns == len(SENTINEL_FAULTS)
    assert tally.faults["fleet:failover"] == 2, tally.faults
    assert tally.violations == [], "\n".join(chaos.report(tally))
