"""Every tool's output is cut on the worker, before it travels (issue 14 item 7): a user tool's
10 MB output crosses Redis bounded, and the model still sees its head and tail."""

from __future__ import annotations

import asyncio

import redis

from tests.integration.conftest import TEST_TOOLS, run_session, settings_for
from toolq.core import keys
from toolq.core.calls import task_id_for
from toolq.core.settings import Settings
from toolq.core.truncate import HISTORY_POLICY, MARKER_SLACK
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems
from toolq.workers.loader import load_catalog

BIG_TOOLS = "tests.integration.big_tools"
#: What a bounded output may take in the backend: the cut text, JSON-escaped, and the result's fields.
STORED_MAX = 2 * HISTORY_POLICY.byte_budget


def test_a_user_tools_10mb_output_is_cut_on_the_worker(redis_server, worker, tmp_path):
    worker(["big"], concurrency=1, tools=[BIG_TOOLS], name="big@test")
    script = [[b.function_call("big_output", {}, "call_big"), b.function_call("big_parts", {}, "call_parts")],
              [b.message("done")]]
    tools = [TEST_TOOLS, BIG_TOOLS]
    with FakeModel(script) as fake:
        (outcome,), _ = asyncio.run(asyncio.wait_for(run_session(
            settings_for(redis_server.url, fake, tmp_path, tools=tools), ["go"], [], catalog=load_catalog(tools)), 60))
    assert outcome.status == "completed", outcome.error
    assert all(pairing_problems(body["input"]) == [] for body in fake.requests)
    outputs = {o["call_id"]: o["output"] for o in fake.requests[1]["input"] if o["type"] == "function_call_output"}
    text = outputs["call_big"]
    assert text.startswith("FIRST LINE\n") and text.endswith("\nLAST LINE") and "tokens truncated" in text
    assert len(text.encode()) <= HISTORY_POLICY.byte_budget + MARKER_SLACK
    part = outputs["call_parts"][0]["text"]
    assert part.startswith("HEAD ") and part.endswith(" TAIL") and len(part) <= HISTORY_POLICY.byte_budget + MARKER_SLACK

    # What travelled: the result Celery stored for each call, read from the backend itself.
    backend = redis.Redis.from_url(Settings(redis_url=redis_server.url).result_backend_url())
    try:
        for index, call_id in enumerate(("call_big", "call_parts")):
            stored = backend.get(keys.CELERY_META + task_id_for(outcome.turn_id, 0, index, call_id))
            assert stored is not None, f"no stored result for {call_id}"
            assert len(stored) < STORED_MAX, f"{call_id}: {len(stored)} bytes in the backend"
    finally:
        backend.close()
