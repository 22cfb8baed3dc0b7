"""Issue 24 item 10, as a hostile model server would: what it streams must not grow Redis without bound.

toolq keeps a running turn in Redis (so `toolq resume` can finish it): every item, and for each
call its ledger record, its task message and its output (twice: the turn's list and the worker's
result). A server streaming big items without end grew Redis from 41 to 257 MB in one turn. Now
what one turn may make toolq keep is bounded (TOOLQ_TURN_STORE_MB, durable.py's `StoreBudget`),
counted where toolq writes it and never short (tests/unit/test_turn_store.py): past it the turn
stops with one line that names the setting, and every call of the turn still has exactly one
output. Each test has a Redis of its own, so its memory is the attack's alone:
- 32 reasoning items of 1 MiB against a bound of 4 MiB;
- calls whose arguments are raw UTF-8 `é` (each byte the server sends costs Celery's escaped,
  base64 task message four), and one whose call_id is 60 KB of them;
- 20,000 tiny items;
- tools' outputs past the bound (exec_command, 40 KB each): kept as a line saying so;
- the conversation a turn starts from counts too.
No test asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from tests.integration.conftest import pairing_problems, run_session, settings_for
from toolq.core.settings import _with_db
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
#: Beside what toolq keeps, Redis's memory holds the workers' heartbeats and events, and its
#: clients' buffers; at its peak, for a moment, also each command being written (a big item, a call's
#: task message in the claim script's arguments, several at once) and a message a worker holds.
SLACK = 2 * MIB


def peak_allowed(bound_mb: int) -> int:
    """A loose ceiling on Redis's peak: the bound, and as much again of buffers passing through."""
    return 2 * bound_mb * MIB + 2 * SLACK


@pytest.fixture
def own_redis():
    """A Redis of this test's own: its memory is the attack's, and no other test's worker takes its calls."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_fleet(own_redis, worker):
    return worker(["toolq"], concurrency=2, redis_url=own_redis.url, name="storage@test")


def memory(url: str) -> dict[str, int]:
    info = redis.Redis.from_url(url).info("memory")
    return {"used": int(info["used_memory"]), "peak": int(info["used_memory_peak"])}


def turn_keys_memory(url: str, turn_id: str) -> int:
    """MEMORY USAGE of every key of the turn: toolq's (database 0) and the workers' results (1)."""
    total = 0
    for db in (0, 1):
        client = redis.Redis.from_url(_with_db(url, db))
        total += sum(client.memory_usage(k, samples=0) or 0 for k in client.scan_iter(match=f"*{turn_id}*", count=1000))
    return total


def attack(own_redis, script: list, bound_mb: int, **settings_kw):
    """Drive `script` on the test's own Redis; returns (run, growth of used_memory, of its peak)."""
    from tests.integration.conftest import Driven

    before = memory(own_redis.url)
    with FakeModel(script) as fake:
        settings = settings_for(own_redis.url, fake, settings_kw.pop("workspace"), turn_store_mb=bound_mb,
                                **settings_kw)
        events: list = []
        (outcome,), session = asyncio.run(asyncio.wait_for(run_session(settings, ["go"], events), 120))
        run = Driven(outcome, fake, events, session)
    after = memory(own_redis.url)
    grown, peak = after["used"] - before["used"], max(0, after["peak"] - before["used"])
    kept = turn_keys_memory(own_redis.url, outcome.turn_id)
    print(f"Redis used_memory {before['used'] / MIB:.1f} -> {after['used'] / MIB:.1f} MiB "
          f"(peak +{peak / MIB:.1f} MiB), the turn's keys {kept / MIB:.1f} MiB, bound {bound_mb} MiB")
    return run, grown, peak, kept


def assert_stopped_at_the_bound(run, bound_mb: int) -> None:
    assert run.outcome.status == "failed", run.outcome
    error = run.outcome.error or ""
    assert "\n" not in error and "TOOLQ_TURN_STORE_MB" in error and f"{bound_mb} MiB" in error, error
    assert error.startswith("turn stopped: ") and "Traceback" not in error, error
    failed = [e for e in run.events if e["type"] == "turn.failed"]
    assert len(failed) == 1 and failed[0]["error"]["message"] == error, failed
    history = run.session.history.to_json()
    assert pairing_problems(history) == [], history[:3]


def call_outputs(run) -> dict[str, list]:
    outs: dict[str, list] = {}
    for item in run.session.history.to_json():
        if item.get("type") == "function_call_output":
            outs.setdefault(item["call_id"], []).append(item["output"])
    return outs


def calls_made(run) -> list[str]:
    return [i["call_id"] for i in run.session.history.to_json() if i.get("type") == "function_call"]


def raw_item(item: dict) -> dict:
    """The item's `response.output_item.done` as raw UTF-8 (the fake's own frames escape it)."""
    data = json.dumps({"type": "response.output_item.done", "item": item}, ensure_ascii=False, separators=(",", ":"))
    return b.raw_frame(f"event: response.output_item.done\ndata: {data}\n\n")


def test_big_items_stop_the_turn_at_the_bound(own_redis, own_fleet, tmp_path):
    bound = 4
    big = [b.reasoning("padding", encrypted_content="x" * MIB, id=f"rs_{k}") for k in range(32)]
    run, grown, peak, kept = attack(own_redis, [[b.function_call("noop", {}, "call_first"), *big],
                                                [b.message("never asked for")]], bound, workspace=tmp_path)
    assert_stopped_at_the_bound(run, bound)
    assert len(run.requests) == 1, "a stop at the bound is not retried, and the model is not asked again"
    assert kept <= bound * MIB, f"the turn's keys hold {kept / MIB:.1f} MiB"
    assert grown <= bound * MIB + SLACK, f"Redis grew by {grown / MIB:.1f} MiB"
    assert peak <= peak_allowed(bound), f"Redis grew by {peak / MIB:.1f} MiB at its peak"
    assert call_outputs(run) == {"call_first": ["ok"]}  # its own output, not an abort
    kept_items = [i for i in run.session.history.to_json() if i.get("type") == "reasoning"]
    assert 0 < len(kept_items) < bound, len(kept_items)


def test_escaped_arguments_and_call_ids_are_counted_as_redis_holds_them(own_redis, own_fleet, tmp_path):
    """Raw `é` costs the server 2 bytes and Celery's task message 8: each call is counted so."""
    bound = 8
    pad = "é" * 150_000  # 300 KB on the wire; 1.2 MB in its task message
    calls = [raw_item({"type": "function_call", "id": f"fc_{k}", "status": "completed", "name": "sleep_echo",
                       "arguments": json.dumps({"text": pad}, ensure_ascii=False), "call_id": f"call_{k}"})
             for k in range(24)]
    long_id = raw_item({"type": "function_call", "id": "fc_id", "status": "completed", "name": "noop",
                        "arguments": "{}", "call_id": "call_" + "é" * 30_000})
    run, grown, peak, kept = attack(own_redis, [[long_id, *calls], [b.message("never asked for")]], bound,
                                    workspace=tmp_path)
    assert_stopped_at_the_bound(run, bound)
    assert kept <= bound * MIB, f"the turn's keys hold {kept / MIB:.1f} MiB"
    assert grown <= bound * MIB + SLACK, f"Redis grew by {grown / MIB:.1f} MiB"
    assert peak <= peak_allowed(bound), f"Redis grew by {peak / MIB:.1f} MiB at its peak"
    made = calls_made(run)
    assert 0 < len(made) < 24, len(made)
    outs = call_outputs(run)
    assert sorted(outs) == sorted(made) and all(len(v) == 1 for v in outs.values()), outs.keys()
    assert outs[made[0]] == ["ok"], outs[made[0]]
    echoed = [k for k, (v,) in outs.items() if k != made[0] and v.startswith('{"text": "\\u00e9')]
    refused = [k for k, (v,) in outs.items() if v.startswith("[toolq kept no output for this call")]
    assert echoed and len(echoed) + len(refused) == len(made) - 1, {k[:12]: str(v)[:100] for k, v in outs.items()}


def test_many_tiny_items_are_bounded_too(own_redis, own_fleet, tmp_path):
    bound = 1
    tiny = [b.reasoning(id=f"rs_{k}") for k in range(20_000)]
    run, grown, peak, kept = attack(own_redis, [[*tiny], [b.message("never asked for")]], bound, workspace=tmp_path)
    assert_stopped_at_the_bound(run, bound)
    assert kept <= bound * MIB, f"the turn's keys hold {kept / MIB:.1f} MiB"
    assert grown <= bound * MIB + SLACK, f"Redis grew by {grown / MIB:.1f} MiB"
    kept_items = [i for i in run.session.history.to_json() if i.get("type") == "reasoning"]
    assert 1000 < len(kept_items) < 20_000, len(kept_items)


def test_outputs_past_the_bound_are_kept_as_a_line_and_every_call_has_one(own_redis, own_fleet, tmp_path):
    bound = 1
    cmd = "head -c 40000 /dev/zero | tr '\\0' x"
    calls = [b.function_call("exec_command", {"cmd": cmd}, f"call_{k}") for k in range(20)]
    run, grown, peak, kept = attack(own_redis, [calls, [b.message("never asked for")]], bound, workspace=tmp_path)
    assert_stopped_at_the_bound(run, bound)
    assert len(run.requests) == 1, "the model is not asked again once outputs filled the bound"
    assert kept <= bound * MIB, f"the turn's keys hold {kept / MIB:.1f} MiB"
    assert grown <= bound * MIB + SLACK, f"Redis grew by {grown / MIB:.1f} MiB"
    outs = call_outputs(run)
    assert sorted(outs) == sorted(f"call_{k}" for k in range(20)), sorted(outs)
    assert all(len(v) == 1 for v in outs.values()), outs
    full = [k for k, (v,) in outs.items() if "x" * 1000 in v]
    refused = [k for k, (v,) in outs.items() if v.startswith("[toolq kept no output for this call")]
    assert full and refused and len(full) + len(refused) == 20, (len(full), len(refused))
    line = outs[refused[0]][0]
    assert "TOOLQ_TURN_STORE_MB" in line and "\n" not in line, line


def test_the_conversation_a_turn_starts_from_counts(own_redis, own_fleet, tmp_path):
    """The turn's item list starts with the conversation so far: a second turn of 0.6 of the
    bound on top of a first of 0.6 stops, where either alone completes."""
    bound = 2
    half = int(0.6 * bound * MIB / 1.25)
    script = {"by_prompt": {"first": [[b.reasoning("a", encrypted_content="x" * half, id="rs_a"), b.message("one")]],
                            "second": [[b.reasoning("b", encrypted_content="y" * half, id="rs_b"),
                                        b.message("two")]]}}
    with FakeModel(script) as fake:
        settings = settings_for(own_redis.url, fake, tmp_path, turn_store_mb=bound)
        events: list = []
        (first, second), _ = asyncio.run(asyncio.wait_for(run_session(settings, ["first", "second"], events), 120))
    assert first.status == "completed", first.error
    assert second.status == "failed" and "TOOLQ_TURN_STORE_MB" in (second.error or ""), second
