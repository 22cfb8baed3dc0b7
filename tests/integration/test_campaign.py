"""A short seeded fault campaign (issue 13, item 6), the same one `toolq bench chaos` runs longer
(toolq/orchestrator/bench/chaos.py): turns on a real Redis (AOF for odd seeds, none for even),
a real worker and the fake model, with stream faults (HTTP 500/429, a cut stream, a malformed
frame), fleet faults (a cancel or a SIGKILLed pool child mid-call, a Redis restart, a SIGKILLed
orchestrator mid-call or mid-stream followed by `toolq resume`), 32-call steps, 10 MB outputs and
duplicate call_ids. Each seed's six turns meet every fleet fault once (a seeded deck); three seeds
(Redis with AOF for odd ones) take about as long as the older campaign of 3 x 8 simpler turns
(~70 s); `./dev bench chaos --turns 24 --seed 1..3` runs longer ones.

Every model request must pair, every call must be answered once, no call may run more often than
it was asked for (the tools' own evidence), no turn may outlive its deadline, nothing may be left
running: the campaign names each broken contract, and there must be none."""

from __future__ import annotations

import pytest

from toolq.orchestrator.bench import chaos

pytestmark = pytest.mark.integration

TURNS = len(chaos.SUITE_FLEET_FAULTS)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_seeded_fault_campaign_keeps_every_contract(seed, tmp_path):
    tally = chaos.campaign(seed, TURNS, tmp_path, chaos.SUITE_FLEET_FAULTS)
    assert tally.turns == TURNS
    assert all(tally.faults[f"fleet:{f}"] == 1 for f in chaos.SUITE_FLEET_FAULTS if f != "none"), tally.faults
    assert tally.violations == [], "\n".join(chaos.report(tally))
