"""Faults across hosts (issue 27 item 2): Redis, the orchestrator and two workers, each its own
network namespace on one machine (`toolq/dev/hosts.py`), partitioned mid-call and healed.

The orchestrator is a real `toolq run --json` on its host, against the fake model on the same
host; the workers are real `toolq worker`s. A call's evidence is the command's own: each run of
it appends a line to a file in the workspace, the one folder the hosts share.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from tests.responses_schema import schema_errors
from toolq.core import import_path
from toolq.core.honest import honest, known_form
from toolq.dev.fake_model import builders as b
from toolq.dev.hosts import HostRedis, Hosts, HostWorker, cannot_run, harness_namespaces, netem_available, sweep_stale
from toolq.orchestrator.history import pairing_problems

pytestmark = pytest.mark.integration

ROLES = ["redis", "orch", "w1", "w2"]
WORKERS = ("w1", "w2")
FAKE_PORT = 18080
#: The fleet catalog's record TTL (toolq/workers/presence.py: 8 s, three heartbeats missed), which
#: the watchdog waits out before it counts a silent worker lost; the visibility timeout is longer.
CATALOG_TTL = 8.0
#: Each turn's deadline: a call no worker takes ends the turn instead of hanging the test.
TURN_TIMEOUT = 60


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    reason = cannot_run()
    if reason:
        pytest.skip(reason)
    failed = request.session.testsfailed
    with Hosts(ROLES, workers=set(WORKERS)) as h:
        yield h
    left = set(h.names()) & set(harness_namespaces())
    assert not left, f"namespaces left behind: {sorted(left)}"
    if request.session.testsfailed == failed:
        h.remove_dir()
    else:  # shown with the failure (teardown output)
        print(f"the hosts harness's logs are kept in {h.dir}")


@dataclass
class Fleet:
    """Redis, two workers and a workspace on the harness; turns run on the orchestrator's host."""

    hosts: Hosts
    redis: HostRedis
    workers: dict[str, HostWorker]
    workspace: Path
    turns: int = 0
    env: dict[str, str] = field(default_factory=dict)
    cut_worker: str = ""
    """The worker host a partition test cut (set during the turn)."""

    def converse(self, script: dict[str, Any], prompts: list[str], during: Callable[[int], None] | None = None,
                 before: Callable[[int], None] | None = None, timeout: float = 90) -> Conversation:
        """Each prompt a `toolq run --json --session` on the orchestrator's host, in turn, against a
        fake model serving `script`; `before(k)` runs before turn k starts, `during(k)` while it runs."""
        self.turns += 1
        run_dir = self.hosts.host_dir("orch") / f"conversation-{self.turns}"
        run_dir.mkdir()
        (run_dir / "script.json").write_text(json.dumps(script))
        record = run_dir / "requests.json"
        fake = self.hosts.process("orch", import_path.python_argv(
            "-m", "toolq.dev.hosts", "fake-model", "--script", str(run_dir / "script.json"),
            "--port", str(FAKE_PORT), "--record", str(record)), env=WORKER_ENV, log=f"fake-{self.turns}.log")
        conversation = Conversation()
        try:
            wait_until(lambda: "http://" in fake.log.read_text(), 10, "the fake model's start")
            for k, prompt in enumerate(prompts):
                if before is not None:
                    before(k)
                conversation.turns.append(self._turn(prompt, run_dir / "session.json", k, during, timeout))
        finally:
            fake.stop()
        conversation.requests = json.loads(record.read_text()) if record.exists() else []
        for k, body in enumerate(conversation.requests):  # as conftest checks the in-process fake model's
            assert schema_errors(body) == [], f"request {k + 1} is not a valid CreateResponse"
        return conversation

    def _turn(self, prompt: str, session: Path, k: int, during: Callable[[int], None] | None,
              timeout: float) -> list[dict[str, Any]]:
        argv = import_path.python_argv("-m", "toolq.cli.main", "run", "--json", "--workspace", str(self.workspace),
                                       "--tools", TEST_TOOLS, "--session", str(session), prompt)
        env = {**WORKER_ENV, "REDIS_URL": self.redis.url, "OPENAI_API_KEY": "test",
               "OPENAI_BASE_URL": f"http://127.0.0.1:{FAKE_PORT}/v1", "TOOLQ_TURN_TIMEOUT": str(TURN_TIMEOUT),
               **self.env}
        proc = self.hosts.popen("orch", argv, env=env)
        try:
            if during is not None:
                during(k)
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert events, f"toolq run printed no events (exit {proc.returncode}):\n{err[-3000:]}"
        return events


@dataclass
class Conversation:
    turns: list[list[dict[str, Any]]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def completed_calls(self, k: int) -> list[dict[str, Any]]:
        return [e["item"] for e in self.turns[k]
                if e.get("type") == "item.completed" and e.get("item", {}).get("type") != "agent_message"]

    def ended(self, k: int) -> str:
        return [e["type"] for e in self.turns[k] if e.get("type", "").startswith("turn.")][-1]

    def unpaired(self) -> list[str]:
        return [p for body in self.requests for p in pairing_problems(body["input"])]

    def outputs(self) -> dict[str, str]:
        """Each call's output as the model saw it, by call_id (from the last request)."""
        items = self.requests[-1]["input"] if self.requests else []
        return {i["call_id"]: _text(i["output"]) for i in items if i.get("type", "").endswith("_output")}


def _text(output: Any) -> str:
    if isinstance(output, str):
        return output
    return "".join(part.get("text", "") for part in output if isinstance(part, dict))


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen in {timeout:.0f}s")


@pytest.fixture
def fleet(hosts: Hosts) -> Fleet:
    redis = hosts.redis()
    workers = {role: hosts.worker(role, redis.url, concurrency=1, tools=[TEST_TOOLS], env=WORKER_ENV)
               for role in WORKERS}
    return Fleet(hosts, redis, workers, hosts.workspace)


def counting(call_id: str, seconds: float) -> dict[str, Any]:
    """An exec_command whose every run appends a line to runs-<call_id>.txt, then sleeps, then
    appends one to ends-<call_id>.txt (a call toolq says it stopped must not get there)."""
    cmd = f"echo ran >> runs-{call_id}.txt; sleep {seconds}; echo end >> ends-{call_id}.txt; echo done"
    return b.function_call("exec_command", {"cmd": cmd, "yield_time_ms": 30000}, call_id)


def runs(fleet: Fleet, call_id: str) -> int:
    path = fleet.workspace / f"runs-{call_id}.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_two_workers_on_separate_hosts_serve_a_turn_and_nothing_is_left(fleet: Fleet) -> None:
    calls = [counting(f"call_{i}", 1) for i in range(6)]
    script = {"by_prompt": {"go": [calls, [b.message("done")]]}}
    conversation = fleet.converse(script, ["go"])
    assert conversation.ended(0) == "turn.completed"
    assert conversation.unpaired() == []
    items = conversation.completed_calls(0)
    assert len(items) == 6
    assert {i.get("worker", "").split("@")[0] for i in items} == set(WORKERS), items
    assert [runs(fleet, f"call_{i}") for i in range(6)] == [1] * 6, conversation.outputs()
    seen = {role: Path(f"/proc/{w.pid}/root") for role, w in fleet.workers.items()}  # as each worker sees files
    tmps = {os.stat(root / "tmp").st_dev for root in seen.values()}
    assert len(tmps) == 2 and os.stat("/tmp").st_dev not in tmps, "each worker host has a /tmp of its own"
    for role, root in seen.items():
        assert sorted(p.name for p in (root / str(fleet.hosts.dir).lstrip("/")).iterdir()) == sorted([role, "workspace"])


def runner(fleet: Fleet) -> str:
    """The worker host that took the (one) call so far: the other has received nothing."""
    took = [role for role, w in fleet.workers.items() if not w.ran_nothing()]
    assert len(took) == 1, took
    return took[0]


def partition_during_call(fleet: Fleet, call_id: str, seconds: float, cut: list[str]) -> Callable[[int], None]:
    """`during` for turn 0: once the call has started, cut its worker from each host of `cut` for
    `seconds`, then heal."""

    def during(k: int) -> None:
        if k != 0:
            return
        wait_until(lambda: runs(fleet, call_id) > 0, 30, f"{call_id} starting")
        role = runner(fleet)
        for other in cut:
            fleet.hosts.cut(role, other)
        time.sleep(seconds)
        fleet.hosts.heal()
        fleet.cut_worker = role

    return during


def assert_honest(output: str, own: str) -> None:
    assert honest(output, own), output


def advertised(fleet: Fleet, role: str) -> bool:
    """Whether the worker's record is in the fleet catalog (its heartbeats reach Redis)."""
    found = fleet.redis.cli("--scan", "--pattern", "toolq:fleet:worker:*").split()
    return bool(found) and fleet.workers[role].name in fleet.redis.cli("mget", *found)


def serve_alone(fleet: Fleet, k: int) -> None:
    """Before turn 1: the cut worker is back in the catalog (within a bound), and the other worker
    is stopped, so the turn's calls can only be served by the worker that was cut."""
    if k != 1:
        return
    wait_until(lambda: advertised(fleet, fleet.cut_worker), 3 * CATALOG_TTL, f"{fleet.cut_worker} advertising again")
    for role, w in fleet.workers.items():
        if role != fleet.cut_worker:
            w.stop(grace=5)


def still_running(worker: HostWorker) -> bool:
    """The same process the test started: never restarted."""
    return worker.proc is not None and worker.proc.poll() is None


def served_by(conversation: Conversation, k: int) -> set[str]:
    return {i.get("worker", "").split("@")[0] for i in conversation.completed_calls(k)}


def after_the_heal(n: int) -> list[Any]:
    """The next turn: `n` one-second calls, so each worker (one pool process) takes some."""
    return [[counting(f"call_next_{i}", 1) for i in range(n)], [b.message("served")]]


def test_a_worker_cut_from_redis_shorter_than_its_windows_finishes_the_call(fleet: Fleet) -> None:
    script = {"by_prompt": {"cut": [[counting("call_cut", 5)], [b.message("done")]], "again": after_the_heal(4)}}
    conversation = fleet.converse(script, ["cut", "again"],
                                  during=partition_during_call(fleet, "call_cut", CATALOG_TTL / 3, ["redis"]),
                                  before=lambda k: serve_alone(fleet, k))
    assert conversation.ended(0) == "turn.completed" and conversation.ended(1) == "turn.completed"
    assert conversation.unpaired() == []
    outputs = conversation.outputs()
    assert runs(fleet, "call_cut") == 1
    assert "done" in outputs["call_cut"] and known_form(outputs["call_cut"]) is None, outputs["call_cut"]
    assert served_by(conversation, 1) == {fleet.cut_worker}
    assert still_running(fleet.workers[fleet.cut_worker])


def test_a_worker_cut_from_redis_longer_than_its_windows_gets_an_honest_output(fleet: Fleet) -> None:
    script = {"by_prompt": {"cut": [[counting("call_cut", 5)], [b.message("done")]], "again": after_the_heal(4)}}
    conversation = fleet.converse(script, ["cut", "again"],
                                  during=partition_during_call(fleet, "call_cut", 2 * CATALOG_TTL, ["redis"]),
                                  before=lambda k: serve_alone(fleet, k))
    assert conversation.ended(0) == "turn.completed" and conversation.ended(1) == "turn.completed"
    assert conversation.unpaired() == []
    outputs = conversation.outputs()
    assert_honest(outputs["call_cut"], "done")
    assert runs(fleet, "call_cut") == 1  # exec_command is not idempotent: never delivered again
    assert served_by(conversation, 1) == {fleet.cut_worker}
    assert still_running(fleet.workers[fleet.cut_worker])


def test_one_way_loss_from_redis_to_a_worker_mid_call_gets_an_honest_output(fleet: Fleet) -> None:
    """The worker's packets reach Redis (its commands run there, its heartbeats renew its record)
    but it hears no reply, for longer than its windows."""
    script = {"by_prompt": {"cut": [[counting("call_cut", 5)], [b.message("done")]], "again": after_the_heal(4)}}

    def during(k: int) -> None:
        if k == 0:
            wait_until(lambda: runs(fleet, "call_cut") > 0, 30, "call_cut starting")
            fleet.cut_worker = runner(fleet)
            fleet.hosts.drop("redis", fleet.cut_worker)
            time.sleep(2 * CATALOG_TTL)
            fleet.hosts.heal()

    conversation = fleet.converse(script, ["cut", "again"], during=during, before=lambda k: serve_alone(fleet, k))
    assert conversation.ended(0) == "turn.completed" and conversation.ended(1) == "turn.completed"
    assert conversation.unpaired() == []
    assert_honest(conversation.outputs()["call_cut"], "done")
    assert runs(fleet, "call_cut") == 1
    assert served_by(conversation, 1) == {fleet.cut_worker}
    assert still_running(fleet.workers[fleet.cut_worker])


def two_calls_through(fleet: Fleet, fault: Callable[[], None], *, seconds: float = 5,
                      first_turn: str = "turn.completed") -> tuple[dict[str, str], float]:
    """Two calls of `seconds` run while `fault` holds for twice the catalog window, then it heals:
    the first turn ends `first_turn`, the next completes, each call ran once with its real or
    honest output. Returns the outputs and when the fault began."""
    calls = [counting(f"call_{i}", seconds) for i in range(2)]
    script = {"by_prompt": {"cut": [calls, [b.message("done")]], "again": after_the_heal(2)}}
    started: list[float] = []

    def during(k: int) -> None:
        if k == 0:
            wait_until(lambda: runs(fleet, "call_0") > 0 and runs(fleet, "call_1") > 0, 30, "both calls starting")
            started.append(time.time())
            fault()
            time.sleep(2 * CATALOG_TTL)
            fleet.hosts.heal()

    conversation = fleet.converse(script, ["cut", "again"], during=during)
    assert conversation.ended(0) == first_turn and conversation.ended(1) == "turn.completed"
    return each_ran_once(fleet, conversation, 2), started[0]


def each_ran_once(fleet: Fleet, conversation: Conversation, n: int) -> dict[str, str]:
    """Every request paired, and calls call_0..call_<n-1> each ran once with a real or honest output."""
    assert conversation.unpaired() == []
    outputs = conversation.outputs()
    for i in range(n):
        assert runs(fleet, f"call_{i}") == 1
        assert_honest(outputs[f"call_{i}"], "done")
    return outputs


def test_the_orchestrator_cut_from_redis_mid_turn_still_answers_every_call(fleet: Fleet) -> None:
    two_calls_through(fleet, lambda: fleet.hosts.cut("orch", "redis"))
    assert all(still_running(w) for w in fleet.workers.values())


def test_a_namespace_a_dead_harness_left_is_swept(hosts: Hosts) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"toolq-{dead.pid}x{'0' * 6}-w9"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in sweep_stale()
    assert name not in harness_namespaces()
    assert set(hosts.names()) <= set(harness_namespaces())  # a live harness's are kept


@pytest.fixture
def netem() -> None:
    """Skips before any host is made where the kernel has no netem (this VM's has none)."""
    if not netem_available():
        pytest.skip("tc netem is not available in this kernel")


def test_delay_and_loss_on_a_worker_link_keep_every_call_answered_once(netem: None, fleet: Fleet) -> None:
    calls = [counting(f"call_{i}", 1) for i in range(4)]
    script = {"by_prompt": {"slow": [calls, [b.message("done")]]}}

    def during(k: int) -> None:
        for role in WORKERS:
            fleet.hosts.netem(role, ["delay", "100ms", "20ms", "loss", "5%"])

    conversation = fleet.converse(script, ["slow"], during=during)
    fleet.hosts.heal()
    assert conversation.ended(0) == "turn.completed"
    each_ran_once(fleet, conversation, 4)


def test_redis_unreachable_by_every_host_mid_call_gets_honest_outputs(fleet: Fleet) -> None:
    """A frozen Redis host, seen from the network: no host reaches it for longer than the windows."""
    two_calls_through(fleet, lambda: fleet.hosts.isolate("redis"))
    assert all(still_running(w) for w in fleet.workers.values())


def test_the_orchestrator_cut_from_redis_past_the_turns_deadline_gets_honest_outputs(fleet: Fleet) -> None:
    """The turn's deadline passes while the orchestrator cannot reach Redis to stop its calls: the
    turn ends at its deadline, each call is told it timed out, and one said stopped was."""
    fleet.env["TOOLQ_TURN_TIMEOUT"] = "12"
    outputs, started = two_calls_through(fleet, lambda: fleet.hosts.cut("orch", "redis"), seconds=20,
                                         first_turn="turn.failed")
    # By now (the next turn done) a call that was not stopped has ended: one said stopped has not.
    time.sleep(max(0.0, started + 20 + 2 - time.time()))  # 20 s: the calls' sleep
    for i in range(2):
        if "was stopped" in outputs[f"call_{i}"]:
            assert not (fleet.workspace / f"ends-call_{i}.txt").exists(), outputs[f"call_{i}"]


def test_slow_links_from_the_workers_keep_every_call_answered_once(fleet: Fleet) -> None:
    """Each worker sends at 256 kbit/s: its ~60 KB outputs and the rest of its traffic queue."""
    for role in WORKERS:
        fleet.hosts.throttle(role, "256kbit")
    calls = [b.function_call("exec_command", {"cmd": f"echo ran >> runs-call_{i}.txt; seq 1 12000; echo done",
                                              "yield_time_ms": 30000}, f"call_{i}") for i in range(4)]
    conversation = fleet.converse({"by_prompt": {"slow": [calls, [b.message("done")]]}}, ["slow"])
    held = [fleet.hosts.run(role, ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout for role in WORKERS]
    fleet.hosts.heal()
    assert any(not re.search(r"overlimits 0\b", stats) for stats in held), held  # the links did slow it
    assert conversation.ended(0) == "turn.completed"
    each_ran_once(fleet, conversation, 4)
