"""Metrics scraped over HTTP from a real worker (`toolq worker` with TOOLQ_METRICS_PORT, prefork,
concurrency 2, its own Redis) and from an orchestrator during a turn on it (the fake model over
real SSE): names, labels and values, the calls counted as the ledger records them, and the pool
children's samples merged in the worker's one endpoint. No timing is asserted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
import urllib.request
from collections import Counter
from typing import Any

import pytest
import redis

from tests import markers
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV, catalog_of, run_session, settings_for
from toolq.core import metrics as declared
from toolq.core.advert import broker_lists, tool_queue
from toolq.core.catalog import Catalog
from toolq.core.environments import host_queue
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.local.embedded import RedisServer, WorkerProcess, free_port
from toolq.orchestrator.transport.ledger import Ledger
from toolq.telemetry import metrics

pytestmark = pytest.mark.integration

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((dict(s.labels), s.value))
    return found


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def by(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for lab, v in samples.get(name, []):
        if v:
            k = tuple(lab[x] for x in keys)
            out[k] = out.get(k, 0) + v
    return out


def labels_declared(samples: Samples) -> None:
    for name, rows in samples.items():
        metric = next((m for m in declared.METRICS if name in declared.scraped_names(m)), None)
        if metric is None:
            continue
        for lab, _ in rows:
            assert set(lab) - {"le"} == set(metric.labels), (name, lab)


@pytest.fixture(scope="module")
def own_redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def metrics_worker(own_redis, tmp_path_factory):
    port = free_port()
    w = WorkerProcess(own_redis.url, queues=["toolq"], concurrency=2, tools=[TEST_TOOLS],
                      env={**WORKER_ENV, "TOOLQ_METRICS_PORT": str(port)}, logdir=tmp_path_factory.mktemp("mw"),
                      name="metrics@test")
    w.start()
    yield w, port
    w.stop()


def test_a_turn_is_counted_by_the_orchestrator_and_the_worker(metrics_worker, own_redis, tmp_path) -> None:
    worker, wport = metrics_worker
    before = scrape(wport)
    assert value(before, "toolq_queue_depth", queue="toolq") == 0  # sampled at scrape from the broker
    script = [
        [b.function_call("sleep_echo", {"ms": 300, "text": f"p{i}"}, f"call_p{i}") for i in range(4)]
        + [b.function_call("no_such_tool", {}, "call_unknown")],
        [b.function_call("exec_command", {"cmd": "sleep 60", "yield_time_ms": 300}, "call_session")],
        b.response(b.message("done"), gate=True),
    ]
    seen: dict[str, Any] = {}
    with FakeModel(script) as fake:
        settings = settings_for(own_redis.url, fake, tmp_path, metrics_port=0)

        async def during(session, runtime) -> None:
            # the last request is held at its gate: the turn runs, its calls are settled
            while len(fake.requests) < 3:
                await asyncio.sleep(0.05)
            port = metrics.port()
            assert port is not None
            seen["orchestrator"] = await asyncio.to_thread(scrape, port)
            seen["worker"] = await asyncio.to_thread(scrape, wport)
            fake.release()

        events: list[dict[str, Any]] = []
        try:
            (outcome,), _ = asyncio.run(asyncio.wait_for(run_session(settings, ["go"], events, during), 120))
            after = scrape(metrics.port() or 0)
        finally:
            metrics.stop()
    assert outcome.status == "completed", outcome.error

    # --- the orchestrator, during the turn and after it
    during_o = seen["orchestrator"]
    assert value(during_o, "toolq_turns_in_flight") == 1
    assert value(after, "toolq_turns_in_flight") == 0
    assert value(after, "toolq_turns_total", state="completed") == 1
    assert value(after, "toolq_model_requests_total", outcome="completed") == 3
    labels_declared(after)
    ledger = asyncio.run(_ledger_calls(own_redis.url, outcome.turn_id))
    # the calls the ledger records for the turn, by tool and final state, are the counter's
    counted = by(after, "toolq_calls_total", "tool", "state")
    loaded = {str(spec.tool_name) for spec in catalog_of([TEST_TOOLS])}
    recorded = Counter((c["tool"] if c["tool"] in loaded else declared.UNKNOWN_TOOL, c["state"]) for c in ledger)
    assert counted == dict(recorded)
    assert counted[("sleep_echo", "completed")] == 4
    assert counted[(declared.UNKNOWN_TOOL, "rejected")] == 1  # an undeclared name is no label
    assert value(after, "toolq_calls_total", tool="sleep_echo", reason="") == 4
    assert value(after, "gen_ai_execute_tool_duration_seconds_count", tool="sleep_echo", state="completed") == 4
    assert not any("no_such_tool" in json.dumps(rows) for rows in after.values())

    # --- the worker: its pool children's tasks, counted in its one endpoint
    w = scrape(wport)
    labels_declared(w)
    outputs = [i for i in fake.requests[1]["input"] if i.get("type") == "function_call_output"
               and i["call_id"].startswith("call_p")]
    pids = {json.loads(i["output"])["pid"] for i in outputs}
    assert len(pids) == 2, pids  # both pool children ran calls...
    assert value(w, "toolq_worker_tasks_total", tool="sleep_echo", outcome="completed") == 4  # ...all counted
    tasks = by(w, "toolq_worker_tasks_total", "tool", "outcome")
    assert tasks == {("sleep_echo", "completed"): 4, ("exec_command", "completed"): 1}
    assert value(w, "toolq_queue_wait_seconds_count", queue=_queue(ledger, "sleep_echo"), tool="sleep_echo") == 4
    assert value(w, "toolq_tool_run_seconds_count", tool="sleep_echo") == 4
    assert value(w, "toolq_tool_run_seconds_sum", tool="sleep_echo") >= 4 * 0.3
    assert value(seen["worker"], "toolq_sessions_in_flight") == 1  # the session host's, while it lives
    if value(w, "toolq_sandbox_start_seconds_count"):
        assert {lab["backend"] for lab, _ in w["toolq_sandbox_start_seconds_count"]} <= {"bwrap", "landlock"}
    assert value(w, "toolq_queue_depth", queue="toolq") == 0
    # the session ended with its conversation: the gauge falls back once the host has forgotten it
    deadline = time.monotonic() + 60
    while value(scrape(wport), "toolq_sessions_in_flight") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert value(scrape(wport), "toolq_sessions_in_flight") == 0


def test_queue_depth_is_the_brokers_list_lengths_by_declared_queue(own_redis) -> None:
    # Calls wait in their tool's own list (`toolq.t.<tool>.<digest>`) or its host's, never in the
    # declared queue's: each declared queue counts every list behind it (the worker's broker_lists).
    # A declaration on a queue of its own: the module's worker, on `toolq`, takes nothing from it.
    probe = dataclasses.replace(next(s for s in catalog_of([TEST_TOOLS]) if s.name == "exec_command"),
                                queue="toolq.probe")
    lists = broker_lists(["toolq.probe", "toolq.none"], Catalog([probe]), "probe-host")
    exec_list = tool_queue(probe)
    assert exec_list in lists["toolq.probe"] and host_queue("probe-host", exec_list) in lists["toolq.probe"]
    r = redis.Redis.from_url(own_redis.url)
    try:
        r.lpush(exec_list, "a", "b")
        r.lpush(exec_list + "\x06\x163", "c")  # kombu's list for priority step 3
        r.lpush(host_queue("probe-host", exec_list), "d")
        depth = metrics.queue_depth_source(own_redis.url, lists)()
        assert depth == {("toolq.probe",): 4.0, ("toolq.none",): 0.0}
    finally:
        r.delete(exec_list, exec_list + "\x06\x163", host_queue("probe-host", exec_list))
        r.close()
    gone = metrics.queue_depth_source(f"redis://127.0.0.1:{free_port()}/0", {"toolq": ["toolq"]})
    with pytest.raises(redis.ConnectionError):  # the collector turns this into no sample
        gone()


async def _ledger_calls(url: str, turn_id: str) -> list[dict[str, str]]:
    ledger = Ledger.from_url(url)
    try:
        return await ledger.calls(turn_id)
    finally:
        await ledger.aclose()


def _queue(ledger: list[dict[str, str]], tool: str) -> str:
    return next(c["queue"] for c in ledger if c["tool"] == tool)


def test_a_cancelled_command_is_timed_until_its_process_is_gone(metrics_worker, own_redis, tmp_path) -> None:
    _, wport = metrics_worker
    before = value(scrape(wport), "toolq_cancel_to_dead_seconds_count", tool="exec_command")
    marker = f"sleep 120.{markers.PROCESS}5"
    script = [[b.function_call("exec_command", {"cmd": marker, "yield_time_ms": 60000}, "call_long")],
              [b.message("done")]]
    with FakeModel(script) as fake:
        settings = settings_for(own_redis.url, fake, tmp_path)

        async def during(session, runtime) -> None:
            while not _running(marker):  # the command runs on the worker: then the turn is cancelled
                await asyncio.sleep(0.05)
            session.cancel()

        (outcome,), _ = asyncio.run(asyncio.wait_for(run_session(settings, ["go"], [], during), 120))
    assert outcome.status == "cancelled"
    deadline = time.monotonic() + 30
    while (value(scrape(wport), "toolq_cancel_to_dead_seconds_count", tool="exec_command") == before
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert value(scrape(wport), "toolq_cancel_to_dead_seconds_count", tool="exec_command") == before + 1


def _running(command: str) -> bool:
    return subprocess.run(["pgrep", "-f", command], capture_output=True).returncode == 0
