"""MCP servers' tools on real workers (issue 16): `toolq worker --mcp ...` with the official
`mcp-server-git` and `mcp-server-time`, and `tests/mcp_servers/edges.py` (FastMCP) for the edges.

The orchestrator learns the tools from the fleet catalog the workers advertise in (each turn's
start, `Fleet.follow_fleet_tools`); every request the fake model receives must pair.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import examples.search_tools  # noqa: F401  (the orchestrator loads the user's `search` too)
from tests.integration.conftest import ROOT, SIGNING_KEY, TEST_TOOLS, WORKER_ENV, catalog_of, run_session, settings_for
from toolq.core.calls import ToolName
from toolq.core.catalog import Catalog
from toolq.dev.bench.mcp import McpWorkerProcess
from toolq.dev.fake_model import builders as b
from toolq.dev.fake_model.server import FakeModel
from toolq.orchestrator.history import pairing_problems
from toolq.orchestrator.mcp_tools import FleetMcpTools, mcp_namespaces

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
EDGES = ROOT / "tests" / "mcp_servers" / "edges.py"
#: The README's user tools: a plain `search` (and `workspace.search`) on the queue `search`.
MCP_TOOLS = "examples.search_tools"
NAME = "mcp1@test"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A git repository with one commit and one untracked file."""
    repo = tmp_path_factory.mktemp("repo")
    git = ["git", "-C", str(repo), "-c", "user.name=Test", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", "-b", "trunk", str(repo)], check=True)
    (repo / "a.txt").write_text("one\n")
    subprocess.run(git + ["add", "a.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "the first commit of the test repo"], check=True)
    (repo / "untracked.txt").write_text("new\n")
    return repo


@pytest.fixture(scope="module")
def evidence(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("evidence")


@pytest.fixture(scope="module")
def mcp_worker(redis_server, repo, evidence, tmp_path_factory):
    edges = f"{sys.executable} {EDGES}"
    w = McpWorkerProcess(redis_server.url, name=NAME, queues=["search"], concurrency=2, tools=[TEST_TOOLS, MCP_TOOLS],
                  env={**WORKER_ENV, "OPENAI_API_KEY": "sk-secret", "FLOWER_PASSWORD": "secret"},
                  logdir=tmp_path_factory.mktemp("mcp"),
                  mcp=[f"git={BIN / 'mcp-server-git'} --repository {repo}", f"time={BIN / 'mcp-server-time'}",
                       f"edges={edges} edges {evidence}", f"other={edges} other {evidence}"])
    w.start()
    yield w
    w.stop(grace=3)


def fleet_mcp_tools(redis_url: str) -> dict[str, dict[str, Any]]:
    """What the fleet catalog offers now: each MCP server's tools, by name, as specs."""
    import redis.asyncio as aioredis

    from toolq.orchestrator.transport.catalog_reader import FleetCatalog

    async def read():
        r = aioredis.Redis.from_url(redis_url)
        try:
            return await FleetCatalog(r).declarations(max_age=0)
        finally:
            await r.aclose()

    specs = [s for a in asyncio.run(read()) if (s := a.to_spec()) is not None]
    return {server: {t.name: t for t in tools} for server, tools in mcp_namespaces(specs).items()}


def wait_until_the_fleet_offers(redis_url: str, check, what: str) -> None:
    """A change on a worker reaches the fleet catalog at its next heartbeat (2 s)."""
    end = time.monotonic() + 10
    while not check(fleet_mcp_tools(redis_url)):
        assert time.monotonic() < end, f"the fleet never offered {what}"
        time.sleep(0.1)


async def _run(settings, prompts, during=None, feed=None):
    async def hold_a_declaration_of_its_own(runtime):
        """`feed(registry)` after each turn's start: an orchestrator whose copy differs from the fleet's."""
        follow = runtime.fleet.follow_fleet_tools

        async def followed_then_fed():
            n = await follow()
            feed(runtime.fleet.registry)
            return n

        runtime.fleet.follow_fleet_tools = followed_then_fed

    events: list[dict] = []
    outcomes, _ = await run_session(settings, prompts, events, during,
                                    prepare=hold_a_declaration_of_its_own if feed else None,
                                    catalog=catalog_of([TEST_TOOLS, MCP_TOOLS]))
    return outcomes, events


def drive(redis_server, workspace: Path, script: list, *, prompts=("go",), during=None, feed=None):
    with FakeModel(script) as fake:
        settings = settings_for(redis_server.url, fake, workspace, tools=[TEST_TOOLS, MCP_TOOLS])
        outcomes, events = asyncio.run(asyncio.wait_for(_run(settings, list(prompts), during, feed), 90))
        for body in fake.requests:
            assert pairing_problems(body["input"]) == [], body["input"]
        return outcomes, fake.requests, events


def outputs(request: dict) -> dict[str, Any]:
    return {i["call_id"]: i["output"] for i in request["input"] if i.get("type") == "function_call_output"}


def wait_for_cancel_on_the_server(marker: Path) -> None:
    end = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < end, "the server never saw notifications/cancelled"
        time.sleep(0.05)


async def in_the_servers_hands(session, runtime) -> None:
    """Returns once the turn's (slow) call is running, and a little more: it reached the server."""
    end = time.monotonic() + 20
    while not (session.turn_id and any(c.get("state") == "running"
                                       for c in await runtime.fleet.ledger.calls(session.turn_id))):
        assert time.monotonic() < end, "the slow call never started"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)


def completed(events: list[dict]) -> dict[str, dict]:
    return {e["item"]["id"]: e["item"] for e in events if e["type"] == "item.completed"}


def namespace(request: dict, name: str) -> dict:
    return next(t for t in request["tools"] if t.get("type") == "namespace" and t["name"] == name)


def test_the_worker_lists_its_servers_and_their_tool_counts_at_start(mcp_worker):
    log = mcp_worker.log.read_text()
    assert re.search(r"mcp server git \(stdio: \S*mcp-server-git --repository \S+\): 12 tools\n", log)
    assert re.search(r"mcp server time \(stdio: \S*mcp-server-time\): 2 tools\n", log)
    assert re.search(r"mcp server edges \(stdio: .*edges\.py edges \S+\): 10 tools\n", log)


def test_git_and_time_tools_reach_the_model_and_answer_through_the_fleet(mcp_worker, redis_server, repo, tmp_path):
    script = [
        [b.function_call("git_status", {"repo_path": str(repo)}, "call_status", namespace="git"),
         b.function_call("git_log", {"repo_path": str(repo), "max_count": 5}, "call_log", namespace="git"),
         b.function_call("get_current_time", {"timezone": "Europe/Oslo"}, "call_time", namespace="time")],
        [b.message("done")],
    ]
    (outcome,), requests, events = drive(redis_server, tmp_path, script)
    assert outcome.status == "completed"
    git = namespace(requests[0], "git")
    assert {"git_status", "git_log", "git_diff", "git_commit"} <= {t["name"] for t in git["tools"]}
    status = next(t for t in git["tools"] if t["name"] == "git_status")
    assert status["parameters"]["properties"]["repo_path"]["type"] == "string"  # the schema as the server lists it
    assert [t["name"] for t in namespace(requests[0], "time")["tools"]] == ["get_current_time", "convert_time"]

    out = outputs(requests[1])
    assert "On branch trunk" in out["call_status"] and "untracked.txt" in out["call_status"]
    assert "the first commit of the test repo" in out["call_log"]
    assert json.loads(out["call_time"])["timezone"] == "Europe/Oslo"
    assert completed(events)["call_status"]["worker"] == NAME
    assert "Task tool:git.git_status[" in mcp_worker.log.read_text()  # the name Flower shows
    from toolq.cli.status import status_cmd
    from toolq.core.settings import Settings

    table = io.StringIO()
    status_cmd(Settings(redis_url=redis_server.url), outcome.turn_id, as_json=True, out=table)
    rows = {r["call_id"]: r for r in map(json.loads, table.getvalue().splitlines())}
    assert rows["call_status"]["tool"] == "git.git_status" and rows["call_time"]["tool"] == "time.get_current_time"


def test_error_image_and_structured_results_map_to_outputs(mcp_worker, redis_server, tmp_path):
    script = [
        [b.function_call("fail", {"reason": "no way"}, "call_fail", namespace="edges"),
         b.function_call("picture", {}, "call_picture", namespace="edges"),
         b.function_call("forecast", {"city": "Oslo"}, "call_forecast", namespace="edges")],
        [b.message("done")],
    ]
    (outcome,), requests, events = drive(redis_server, tmp_path, script)
    assert outcome.status == "completed"
    out = outputs(requests[1])
    assert "refused: no way" in out["call_fail"]
    [image] = out["call_picture"]
    assert image["type"] == "input_image" and image["image_url"].startswith("data:image/png;base64,iVBORw0KGgo")
    assert json.loads(out["call_forecast"]) == {"city": "Oslo", "celsius": 21.5}
    assert completed(events)["call_fail"]["status"] == "failed"


def test_two_servers_and_a_user_tool_named_search_stay_three_tools(mcp_worker, redis_server, tmp_path):
    script = [
        [b.function_call("search", {"query": "q1"}, "call_edges", namespace="edges"),
         b.function_call("search", {"query": "q2"}, "call_other", namespace="other"),
         b.function_call("search", {"query": "q3", "limit": None}, "call_user")],
        [b.message("done")],
    ]
    (tmp_path / "q3.txt").write_text("")
    (outcome,), requests, _ = drive(redis_server, tmp_path, script)
    assert outcome.status == "completed"
    assert "search" in {t["name"] for t in namespace(requests[0], "edges")["tools"]}
    assert "search" in {t["name"] for t in namespace(requests[0], "other")["tools"]}
    out = outputs(requests[1])
    assert "edges found q1" in out["call_edges"]
    assert "other found q2" in out["call_other"]
    assert out["call_user"] == "q3.txt"


def test_a_server_never_sees_the_workers_secrets(mcp_worker, redis_server, tmp_path):
    script = [[b.function_call("environment", {}, "call_env", namespace="edges")], [b.message("done")]]
    _, requests, _ = drive(redis_server, tmp_path, script)
    names = json.loads(json.loads(outputs(requests[1])["call_env"])["result"])
    leaked = [n for n in names if n.startswith(("TOOLQ_", "REDIS", "CELERY", "OPENAI", "FLOWER"))]
    assert leaked == [] and "PATH" in names


def test_two_fleets_in_one_process_each_learn_the_servers_tools_for_themselves(mcp_worker, redis_server):
    """What a fleet learns from the fleet catalog goes into its own registry: the catalog it was
    given (the process-wide one, by default) stays what was loaded, so a second fleet in the same
    process does not take a server's tools as its own loaded ones, never to follow them again."""
    from toolq.core.settings import Settings
    from toolq.orchestrator.fleet import Fleet

    loaded = catalog_of([TEST_TOOLS])
    before = {s.tool_name for s in loaded}

    async def open_twice():
        settings = Settings(redis_url=redis_server.url, signing_key=SIGNING_KEY, tools=[TEST_TOOLS])
        first = await Fleet.open(settings, catalog=loaded)
        second = await Fleet.open(settings, catalog=loaded)
        try:
            return [f.registry.lookup(ToolName.namespaced("edges", "search")) for f in (first, second)], \
                second.mcp_tools.local
        finally:
            await first.aclose()
            await second.aclose()

    found, second_local = asyncio.run(open_twice())
    assert all(spec is not None for spec in found)
    assert {s.tool_name for s in loaded} == before
    assert "edges" not in second_local


def test_a_cancelled_call_is_cancelled_on_the_server(mcp_worker, redis_server, evidence, tmp_path):
    marker = evidence / "edges.cancelled"
    marker.unlink(missing_ok=True)

    async def during(session, runtime):
        await in_the_servers_hands(session, runtime)
        session.cancel()

    script = [[b.function_call("slow", {"seconds": 30}, "call_slow", namespace="edges")], [b.message("done")]]
    t0 = time.monotonic()
    (outcome,), requests, _ = drive(redis_server, tmp_path, script, during=during)
    assert outcome.status == "cancelled"
    assert time.monotonic() - t0 < 20
    wait_for_cancel_on_the_server(marker)


def test_a_crashed_server_is_restarted_and_its_in_flight_call_is_told(mcp_worker, redis_server, evidence, tmp_path):
    pid = (evidence / "other.pid").read_text()
    script = [
        [b.function_call("crash", {}, "call_crash", namespace="other")],
        [b.function_call("search", {"query": "again"}, "call_again", namespace="other")],
        [b.message("done")],
    ]
    (outcome,), requests, _ = drive(redis_server, tmp_path, script)
    assert outcome.status == "completed"
    assert "exited during the call and is being restarted" in outputs(requests[1])["call_crash"]
    assert "other found again" in outputs(requests[2])["call_again"]  # waited for the restart
    assert (evidence / "other.pid").read_text() != pid


def test_a_changed_tool_list_reaches_the_fleet_and_a_stale_declaration_is_refused(mcp_worker, redis_server, tmp_path):
    script = [[b.function_call("grow", {}, "call_grow", namespace="edges")], [b.message("grown")]]
    drive(redis_server, tmp_path, script)

    wait_until_the_fleet_offers(redis_server.url, lambda t: "added" in t.get("edges", {}), "edges.added")

    # A new turn sees it and calls it; a declaration the orchestrator holds that differs from
    # the server's listing is refused by the worker.
    def stale(registry):
        spec = registry.lookup(ToolName.namespaced("edges", "search"))
        registry.replace_namespace("edges", [dataclasses.replace(s, description="an older description")
                                             if s == spec else s for s in registry.catalog if s.namespace == "edges"])

    script = [[b.function_call("added", {}, "call_added", namespace="edges"),
               b.function_call("search", {"query": "x"}, "call_stale", namespace="edges")], [b.message("done")]]
    _, requests, _ = drive(redis_server, tmp_path, script, feed=stale)
    out = outputs(requests[1])
    assert "added says hi" in out["call_added"]
    assert "added" in {t["name"] for t in namespace(requests[0], "edges")["tools"]}  # offered to the model
    # dispatch refuses it: no live worker serves that declaration, one serves another
    assert "no live worker serves tool `edges.search`" in out["call_stale"]
    assert "serve another declaration of it" in out["call_stale"]


def test_a_tool_listed_anew_mid_turn_is_refused_as_declared_differently(mcp_worker, redis_server, tmp_path):
    """The orchestrator and the pool child both hold the declaration from before the change; the
    host, which follows the server, refuses the call."""
    script = [
        [b.function_call("reshape", {}, "call_reshape", namespace="other")],
        [b.function_call("search", {"query": "x"}, "call_old", namespace="other")],
        [b.message("done")],
    ]
    _, requests, _ = drive(redis_server, tmp_path, script)
    assert outputs(requests[1])["call_reshape"] == json.dumps({"result": "reshaped"})
    assert "tool other.search is declared differently by its MCP server now" in outputs(requests[2])["call_old"]
    # the next turn learns the new declaration and the call runs
    wait_until_the_fleet_offers(redis_server.url, lambda t: "limit" in (
        t.get("other", {}).get("search").parameters or {}).get("properties", {}), "other.search's new schema")
    script = [[b.function_call("search", {"query": "y", "limit": 2}, "call_new", namespace="other")],
              [b.message("done")]]
    _, requests, _ = drive(redis_server, tmp_path, script)
    assert "other found y (at most 2)" in outputs(requests[1])["call_new"]


def test_a_server_no_live_worker_hosts_leaves_the_registry(redis_server, evidence, tmp_path):
    import redis.asyncio as aioredis

    from toolq.orchestrator.registry import Registry
    from toolq.orchestrator.transport.catalog_reader import FleetCatalog

    registry = Registry(Catalog())
    tools = FleetMcpTools(registry, None)  # type: ignore[arg-type]  # one per turn's event loop, below

    def follow() -> int:
        async def run():
            r = aioredis.Redis.from_url(redis_server.url)
            try:
                tools.fleet = FleetCatalog(r)
                return await tools.follow()
            finally:
                await r.aclose()
        return asyncio.run(run())

    w = McpWorkerProcess(redis_server.url, name="mcp5@test", queues=["mcp-idle"], concurrency=1,
                         tools=[TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path,
                         mcp=[f"solo={sys.executable} {EDGES} solo {evidence}"])
    w.start()
    try:
        follow()
        assert registry.lookup(ToolName.namespaced("solo", "search")) is not None
        assert "solo" in {s["name"] for s in registry.model_visible_specs() if s["type"] == "namespace"}
    finally:
        w.stop(grace=3)
    follow()
    assert registry.lookup(ToolName.namespaced("solo", "search")) is None
    assert "solo" not in {s.get("name") for s in registry.model_visible_specs()}


def test_bad_mcp_config_is_one_line_at_worker_start(redis_server, tmp_path):
    env = {**os.environ, **WORKER_ENV, "REDIS_URL": redis_server.url}
    proc = subprocess.run([sys.executable, "-m", "toolq.cli.main", "worker", "--mcp", "bad name=x"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "server name" in proc.stderr


def test_a_codex_toml_config_with_a_tool_timeout_cancels_the_call_on_the_server(redis_server, evidence, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f"""
[mcp_servers.slowpoke]
command = "{sys.executable}"
args = ["{EDGES}", "slowpoke", "{evidence}"]
tool_timeout_sec = 1
enabled_tools = ["slow", "search"]

[mcp_servers.off]
command = "no-such-command"
enabled = false
""")
    w = McpWorkerProcess(redis_server.url, name="mcp2@test", queues=["mcp-idle"], concurrency=1,
                         tools=[TEST_TOOLS, MCP_TOOLS], env={**WORKER_ENV, "TOOLQ_MCP_CONFIG": str(config)},
                         logdir=tmp_path, mcp=[])
    w.start()
    first_pid = int((evidence / "slowpoke.pid").read_text())
    try:
        script = [[b.function_call("slow", {"seconds": 30}, "call_slow", namespace="slowpoke"),
                   # not in enabled_tools: the model cannot reach it, whatever it sends
                   b.function_call("crash", {}, "call_crash", namespace="slowpoke")], [b.message("done")]]
        (outcome,), requests, events = drive(redis_server, tmp_path, script)
    finally:
        w.stop(grace=3)
    assert sorted(t["name"] for t in namespace(requests[0], "slowpoke")["tools"]) == ["search", "slow"]
    assert not any(t.get("name") == "off" for t in requests[0]["tools"])
    # Timed out like any call that hits its limit: the state, and the usual output.
    assert outputs(requests[1])["call_slow"] == "call timed out after 1s and was stopped"
    assert completed(events)["call_slow"]["state"] == "timed_out"
    assert outputs(requests[1])["call_crash"] == "unsupported call: slowpokecrash"
    assert (evidence / "slowpoke.pid").read_text() == str(first_pid)  # never crashed
    wait_for_cancel_on_the_server(evidence / "slowpoke.cancelled")


def test_a_streamable_http_server_by_url(redis_server, evidence, tmp_path):
    from toolq.local.embedded import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, str(EDGES), "web", str(evidence), str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    w = McpWorkerProcess(redis_server.url, name="mcp3@test", queues=["mcp-idle"], concurrency=1,
                         tools=[TEST_TOOLS, MCP_TOOLS], env=WORKER_ENV, logdir=tmp_path,
                         mcp=[f"web=http://127.0.0.1:{port}/mcp"])
    try:
        end = time.monotonic() + 20
        while not (evidence / "web.pid").exists():
            assert time.monotonic() < end
            time.sleep(0.05)
        time.sleep(0.5)  # listening
        w.start()
        assert "mcp server web (http: http://127.0.0.1:" in w.log.read_text()
        script = [[b.function_call("forecast", {"city": "Bergen"}, "call_web", namespace="web")], [b.message("done")]]
        _, requests, _ = drive(redis_server, tmp_path, script)
    finally:
        w.stop(grace=3)
        server.terminate()
        server.wait(5)
    assert json.loads(outputs(requests[1])["call_web"]) == {"city": "Bergen", "celsius": 21.5}


def test_a_worker_killed_outright_leaves_no_mcp_server_behind(redis_server, evidence, tmp_path):
    import signal

    pid_file = evidence / "orphan.pid"
    w = McpWorkerProcess(redis_server.url, name="mcp4@test", queues=["mcp-idle"], concurrency=1,
                         tools=[TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path,
                         mcp=[f"orphan={sys.executable} {EDGES} orphan {evidence}"])
    w.start()
    server_pid = int(pid_file.read_text())
    assert w.proc is not None
    os.kill(w.proc.pid, signal.SIGKILL)  # the main process only: the host must notice on its own
    try:
        end = time.monotonic() + 15
        while _alive(server_pid):
            assert time.monotonic() < end, "the MCP server outlived its worker"
            time.sleep(0.1)
    finally:
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)  # the pool children Celery left
        except ProcessLookupError:
            pass
        w.proc.wait(5)
        w.proc = None


def _mcp_host_of(worker_pid: int) -> int:
    """The worker's MCP host process: the child running `toolq.workers.mcp.host`."""
    for task in Path(f"/proc/{worker_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"toolq.workers.mcp.host" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError(f"worker {worker_pid} has no MCP host")


def test_a_killed_mcp_host_is_restarted_and_its_in_flight_call_is_told(redis_server, evidence, tmp_path):
    """The host holds every server's session: SIGKILLed mid-call, the call's output says so, the
    worker starts the host again (and so its servers), and the next call waits for it and runs."""
    import signal

    pid_file = evidence / "phoenix.pid"
    w = McpWorkerProcess(redis_server.url, name="mcp6@test", queues=["mcp-idle"], concurrency=1,
                         tools=[TEST_TOOLS], env=WORKER_ENV, logdir=tmp_path,
                         mcp=[f"phoenix={sys.executable} {EDGES} phoenix {evidence}"])
    w.start()
    try:
        assert w.proc is not None
        host, server = _mcp_host_of(w.proc.pid), int(pid_file.read_text())

        async def during(session, runtime):
            await in_the_servers_hands(session, runtime)
            os.kill(host, signal.SIGKILL)

        script = [[b.function_call("slow", {"seconds": 30}, "call_slow", namespace="phoenix")],
                  [b.function_call("search", {"query": "again"}, "call_again", namespace="phoenix")],
                  [b.message("done")]]
        (outcome,), requests, events = drive(redis_server, tmp_path, script, during=during)
        restarted = _mcp_host_of(w.proc.pid)
    finally:
        w.stop(grace=3)
    assert outcome.status == "completed"
    assert outputs(requests[1])["call_slow"] == ("phoenix.slow was interrupted and its outcome is unknown: the "
                                                 "worker's MCP host exited during the call and is being restarted; "
                                                 "it may have run, partly or fully")
    assert completed(events)["call_slow"]["state"] == "lost"
    assert "phoenix found again" in outputs(requests[2])["call_again"]  # waited for the restart
    assert restarted != host and int(pid_file.read_text()) != server
    assert "the MCP host exited with -9" in w.log.read_text()
    end = time.monotonic() + 10
    while _alive(server):  # the old host's server read EOF on its stdin, as MCP's stdio shutdown says
        assert time.monotonic() < end, "the killed host's server outlived it"
        time.sleep(0.1)
    while _alive(restarted):  # in a session of its own, the new host still goes with its worker
        assert time.monotonic() < end, "the restarted MCP host outlived its worker"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_toolq_run_offers_the_fleets_mcp_tools_and_runs_a_call(mcp_worker, redis_server, tmp_path):
    """The CLI, as a user runs it against a fleet with an MCP worker: the servers' namespaces are in
    its first request's `tools`, and a call to one answers through the fleet."""
    from tests.integration.conftest import SIGNING_KEY

    script = [[b.function_call("get_current_time", {"timezone": "Asia/Tokyo"}, "call_time", namespace="time")],
              [b.message("it is late in Tokyo")]]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "TOOLQ_", "REDIS_", "CELERY_"))}
    base["TOOLQ_TOOLS_PATH"] = os.environ["TOOLQ_TOOLS_PATH"]  # the tests' tool modules (tests/conftest.py)
    with FakeModel(script) as fake:
        proc = subprocess.run([sys.executable, "-m", "toolq.cli.main", "run", "--json", "what time is it?"],
                              env={**base, "REDIS_URL": redis_server.url, "TOOLQ_SIGNING_KEY": SIGNING_KEY,
                                   "TOOLQ_WORKSPACE": str(tmp_path), "OPENAI_BASE_URL": fake.base_url},
                              capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    requests = fake.requests
    for body in requests:
        assert pairing_problems(body["input"]) == [], body["input"]
    assert [t["name"] for t in namespace(requests[0], "time")["tools"]] == ["get_current_time", "convert_time"]
    assert {"git", "edges", "other"} <= {t["name"] for t in requests[0]["tools"] if t["type"] == "namespace"}
    assert json.loads(outputs(requests[1])["call_time"])["timezone"] == "Asia/Tokyo"
    said = [json.loads(line) for line in proc.stdout.splitlines()]
    assert completed(said)["call_time"]["worker"] == NAME and said[-1]["type"] == "turn.completed"
