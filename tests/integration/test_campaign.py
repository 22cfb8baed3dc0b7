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
