"""Issue 24 item 10, as a hostile model server would: big items must not grow Redis without bound.

toolq keeps every item of a running turn in Redis (so `toolq resume` can finish it), and a server
streaming big items without end grew Redis from 41 to 257 MB in one turn. Now what the model's
items of one turn may make toolq keep is bounded (TOOLQ_TURN_STORE_MB): past it the turn stops
with one line, and the calls already queued still get their outputs.
"""

from __future__ import annotations

import redis

from tests.integration.conftest import pairing_problems
from toolq.orchestrator.fake_model import builders as b

MIB = 1024 * 1024
BOUND_MB = 4
ITEMS = 32  # of 1 MiB each: 32 MiB kept without the bound


def used_memory(url: str) -> int:
    return int(redis.Redis.from_url(url).info("memory")["used_memory"])


def test_a_model_streaming_big_items_is_stopped_at_the_turn_bound(redis_server, fleet, drive):
    big = [b.reasoning("padding", encrypted_content="x" * MIB, id=f"rs_{k}") for k in range(ITEMS)]
    before = used_memory(redis_server.url)
    run = drive([[b.function_call("noop", {}, "call_first"), *big], [b.message("never asked for")]],
                turn_store_mb=BOUND_MB)
    grown = used_memory(redis_server.url) - before
    print(f"Redis grew by {grown / MIB:.1f} MiB")
    assert run.outcome.status == "failed"
    error = run.outcome.error or ""
    assert "TOOLQ_TURN_STORE_MB" in error and f"{BOUND_MB} MiB" in error and "\n" not in error, error
    assert len(run.requests) == 1, "a stop at the bound is not retried"
    # Kept: at most the bound and the item that passed it (each event is bounded), not 32 MiB.
    assert grown < (BOUND_MB + 2) * MIB * 2, f"Redis grew by {grown / MIB:.1f} MiB"
    history = run.session.history.to_json()
    assert pairing_problems(history) == [], history[:3]
    outputs = [i for i in history if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == ["call_first"], outputs  # its own output, not an abort
    assert outputs[0]["output"] == "ok", outputs[0]
    kept = [i for i in history if i.get("type") == "reasoning"]
    assert 0 < len(kept) <= BOUND_MB, len(kept)


def test_a_turn_under_the_bound_is_untouched(redis_server, fleet, drive):
    run = drive([[b.reasoning("small", encrypted_content="x" * 1024), b.function_call("noop", {}, "call_a")],
                 [b.message("done")]], turn_store_mb=1)
    assert run.outcome.status == "completed", run.outcome.error
