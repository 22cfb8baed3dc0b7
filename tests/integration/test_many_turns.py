"""Many turns at once from one process, on one `Runtime` (issue 14, item 5).

Before: at 128 turns the ledger's pool of 100 connections raised `Too many connections` /
`MaxConnectionsError` (each running turn's cancel listener held one), and on a fresh runtime
turns starting together each opened their own result subscription, of which only one was read,
so most calls hung until the turn deadline.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

import tests.integration.conftest as c
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.turn import Runtime, Session
from toolq.workers.loader import load_catalog

pytestmark = pytest.mark.integration

TURNS = 128
CALLS = 4


def script() -> dict:
    calls = [b.function_call("sleep_echo", {"text": f"c{i}"}, f"call_{i}") for i in range(CALLS)]
    return {"by_prompt": {"*": [calls, [b.message("done")]]}}


def test_128_turns_at_once_on_a_fresh_runtime_answer_every_call(fleet, redis_server, tmp_path):
    seen: list[dict] = []

    async def main():
        with FakeModel(script()) as fake:
            settings = c.settings_for(redis_server.url, fake, tmp_path, turn_timeout=90)
            rt = await Runtime.create(settings, catalog=load_catalog([c.TEST_TOOLS]))  # fresh: no subscription yet
            sessions = [Session(rt) for _ in range(TURNS)]
            events: list[list] = [[] for _ in range(TURNS)]
            started = time.monotonic()
            try:
                turns = [asyncio.create_task(s.run_turn(f"turn {k}", events[k].append))
                         for k, s in enumerate(sessions)]
                await asyncio.sleep(1.0)  # all of them running: what does the runtime hold?
                seen.extend(redis.Redis.from_url(redis_server.url).client_list())
                outcomes = await asyncio.wait_for(asyncio.gather(*turns), 120)
            finally:
                await asyncio.gather(*(s.close() for s in sessions))
                await rt.aclose()
            return outcomes, fake.requests, time.monotonic() - started

    outcomes, requests, took = asyncio.run(main())
    failed = [(o.turn_id, o.status, o.error) for o in outcomes if o.status != "completed"]
    assert failed == [], failed[:5]
    answers = [body["input"] for body in requests if any(i.get("type") == "function_call_output"
                                                         for i in body["input"])]
    assert len(answers) == TURNS
    outputs = [i["output"] for inp in answers for i in inp if i.get("type") == "function_call_output"]
    assert len(outputs) == TURNS * CALLS
    bad = [o for o in outputs if '"text": "c' not in o]
    assert bad == [], bad[:5]  # no "Too many connections", no "not run", no deadline
    assert took < 60, f"{took:.1f}s: calls waited (hung subscriptions?)"
    # One result subscription and one cancel subscription for the whole runtime, not one per turn.
    mine = [x for x in seen if x.get("name") in ("toolq-results", "toolq-ledger", "toolq-cancels")]
    subscribed = sorted((x["name"], int(x["sub"]), int(x["psub"])) for x in mine if int(x["sub"]) or int(x["psub"]))
    assert [(n, s) for n, s, _ in subscribed] == [("toolq-cancels", 0), ("toolq-results", 0)], subscribed


def test_turns_starting_at_once_on_a_fresh_router_share_its_one_subscription(redis_server):
    """Without the lock each `watch_turn` opened its own connection and all but one went unread."""
    from toolq.core.signing import Signer
    from toolq.orchestrator.transport.results import ResultRouter

    async def main():
        router = ResultRouter(redis_server.url, Signer(c.SIGNING_KEY))
        await router.start()
        try:
            await asyncio.gather(*(router.watch_turn(f"turn-race{k:02d}") for k in range(32)))
            clients = redis.Redis.from_url(redis_server.url).client_list()
        finally:
            await router.aclose()
        return [(int(x["sub"]), int(x["psub"])) for x in clients
                if x.get("name") == "toolq-results" and (int(x["sub"]) or int(x["psub"]))]

    held = asyncio.run(main())
    assert len(held) == 1 and held[0][0] == 0 and held[0][1] >= 32, held  # every turn's pattern(s), one connection


def test_the_one_cancel_subscription_comes_back_after_a_redis_restart(worker, tmp_path):
    """Three turns on one runtime, Redis restarted under them; then one is cancelled from
    another client: that one ends cancelled (heard on the re-taken subscription, or found in
    its durable record), the others complete."""
    from toolq.local.embedded import RedisServer
    from toolq.orchestrator.transport.ledger import Ledger

    hang = {"by_prompt": {"*": [[b.function_call("hang", {"seconds": 4}, "call_h")], [b.message("done")]]}}

    async def main(server):
        with FakeModel(hang) as fake:
            settings = c.settings_for(server.url, fake, tmp_path, turn_timeout=60)
            rt = await Runtime.create(settings, catalog=load_catalog([c.TEST_TOOLS]))
            sessions = [Session(rt) for _ in range(3)]
            try:
                turns = [asyncio.create_task(s.run_turn(f"turn {k}")) for k, s in enumerate(sessions)]
                while len(list(tmp_path.glob("hang-*.pid"))) < 1:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(server.restart)
                probe = redis.Redis.from_url(server.url)
                end = time.monotonic() + 20
                while not any(x.get("name") == "toolq-cancels" and x["psub"] == "1" for x in probe.client_list()):
                    assert time.monotonic() < end, "the cancel subscription never came back"
                    await asyncio.sleep(0.1)
                other = Ledger.from_url(server.url)
                await other.cancel_turn(sessions[1].turn_id)
                await other.aclose()
                return await asyncio.wait_for(asyncio.gather(*turns), 45)
            finally:
                await asyncio.gather(*(s.close() for s in sessions))
                await rt.aclose()

    with RedisServer() as server:
        worker(["faults"], concurrency=3, redis_url=server.url)
        outcomes = asyncio.run(main(server))
    assert [o.status for o in outcomes] == ["completed", "cancelled", "completed"], [o.error for o in outcomes]


def test_step_numbers_come_in_blocks_and_never_collide_across_processes(redis_server):
    """`Fleet.run_calls` numbers its steps from the ledger: one round trip per block, and two
    orchestrators driving one turn never get the same number."""
    from toolq.orchestrator.transport.ledger import STEP_BLOCK, Ledger

    async def main():
        a, b_ = Ledger.from_url(redis_server.url), Ledger.from_url(redis_server.url)
        try:
            turn = f"turn-steps{time.time_ns()}"
            first = [await a.next_step(turn) for _ in range(3)]
            mixed = await asyncio.gather(*(ledger.next_step(turn) for _ in range(STEP_BLOCK) for ledger in (a, b_)))
            return first, mixed
        finally:
            await a.aclose()
            await b_.aclose()

    first, mixed = asyncio.run(main())
    assert first == [0, 1, 2]
    assert len(set(first + mixed)) == len(first) + len(mixed)
