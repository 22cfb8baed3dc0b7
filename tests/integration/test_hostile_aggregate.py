"""Issue 24 item 8, as the attacker would: sessions must not multiply the per-call limits.

Each session holds a spawn slot, and each slot had its own process and memory limit: one turn of
32 sessions held 7,682 processes on the host, and a conversation may hold 64. Now every slot's
cgroups sit under one of the session host's, bounding all its commands and sessions together
(pids, memory, and a CPU group with an optional quota), and one conversation's share of them is
bounded too:
- a worker with a per-call limit of 64 processes and an aggregate of 300 gets a turn that opens 8
  sessions of 60 processes each (480 wanted): the worker's tree stays under the aggregate, a
  command that cannot start is told so in one line, and once the conversation ends it serves;
- a conversation bounded to 150 processes opens 4 sessions of 60: toolq kills its newest sessions
  until it is within the bound (each poll of one says why), while another conversation is served;
- a spinning command on a worker whose commands may use 0.1 CPU together is throttled by the
  kernel (the cgroup's own counter, not a clock).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from tests.integration.test_builtin_tools import outputs
from tests.integration.test_cancel import wait_until
from tests.integration.test_hostile_exec import hostile_workers, locked_redis_server
from toolq.orchestrator.fake_model import builders as b
from toolq.workers.isolation import limits

pytestmark = pytest.mark.integration

AGGREGATE = 300
SESSIONS, EACH = 8, 60


def worker_of_its_own(tmp_path_factory, **settings: str):
    """A bwrap worker on a Redis of its own: another test's worker must not take its calls."""
    for redis_server in locked_redis_server(tmp_path_factory):
        yield from hostile_workers("bwrap", redis_server, tmp_path_factory, **settings)


@pytest.fixture(scope="module")
def bounded_worker(tmp_path_factory):
    if os.geteuid() != 0 or limits.pids_cgroup_base() is None:
        pytest.skip("the aggregate bound needs a pids cgroup this process may create (root on cgroup v1 here)")
    yield from worker_of_its_own(tmp_path_factory, TOOLQ_SANDBOX_WORKER_PROCESSES=str(AGGREGATE),
                               TOOLQ_SANDBOX_CPU_SECONDS="30")


def tree_size(pid: int) -> int:
    return 1 + len(psutil.Process(pid).children(recursive=True))


def test_sessions_cannot_multiply_the_process_limit(drive, bounded_worker, tmp_path):
    spawn = f"for i in $(seq {EACH}); do sleep 120 & done; echo started; wait"
    opened = [b.function_call("exec_command", {"cmd": spawn, "yield_time_ms": 1500}, f"call_s{k}")
              for k in range(SESSIONS)]
    worker_pid = bounded_worker.proc.proc.pid
    peak = []

    async def during(session, runtime) -> None:  # while the sessions run: how many processes the worker holds
        for _ in range(40):
            peak.append(tree_size(worker_pid))
            await asyncio.sleep(0.1)

    script = [opened, [b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_control")],
              [b.message("done")]]
    run = drive(script, redis_url=bounded_worker.redis.url, workspace=tmp_path, during=during)
    got = {**outputs(run, 1), **outputs(run, 2)}
    assert set(got) == {f"call_s{k}" for k in range(SESSIONS)} | {"call_control"}  # one output each
    # The worker's own processes (itself, pool children, session host, cells) on top of the bound.
    assert max(peak) < AGGREGATE + 64, peak
    assert any("Resource temporarily unavailable" in text or "processes" in text for text in got.values()), got
    # While the conversation's sessions hold the bound, its next command is refused in one line
    # (within one conversation that is the bound doing its job); once they end, the worker serves.
    assert "CONTROL-OK" in got["call_control"] or "TOOLQ_SANDBOX_WORKER_PROCESSES" in got["call_control"], got
    # The conversation's end kills its sessions: wait until their processes are gone.
    asyncio.run(wait_until(lambda: tree_size(worker_pid) < 64, 60, "the sessions' processes to end"))
    after = drive([[b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_after")], [b.message("done")]],
                  redis_url=bounded_worker.redis.url, workspace=tmp_path)
    assert "CONTROL-OK" in outputs(after)["call_after"]


CONVERSATION_BOUND = 150


@pytest.fixture(scope="module")
def conversation_bounded_worker(tmp_path_factory):
    if os.geteuid() != 0 or limits.pids_cgroup_base() is None:
        pytest.skip("the conversation bound needs a pids cgroup this process may create (root on cgroup v1 here)")
    yield from worker_of_its_own(tmp_path_factory, TOOLQ_SANDBOX_CPU_SECONDS="30",
                               TOOLQ_SANDBOX_CONVERSATION_PROCESSES=str(CONVERSATION_BOUND))


def sleepers(worker_pid: int) -> int:
    """The attacker's `sleep 120` processes among the worker's."""
    count = 0
    for child in psutil.Process(worker_pid).children(recursive=True):
        try:
            count += child.cmdline() == ["sleep", "120"]
        except psutil.Error:
            pass
    return count


def test_one_conversation_cannot_hold_the_whole_worker(drive, conversation_bounded_worker, tmp_path):
    worker = conversation_bounded_worker
    spawn = f"for i in $(seq {EACH}); do sleep 120 & done; echo started; wait"
    opened = [b.function_call("exec_command", {"cmd": spawn, "yield_time_ms": 1500}, f"call_s{k}") for k in range(4)]
    polls = [b.function_call("write_stdin", {"session_id": k, "chars": "", "yield_time_ms": 20000}, f"call_p{k}")
             for k in range(1, 5)]
    other: dict[str, str] = {}

    async def during(session, runtime) -> None:
        # The reaper cuts the conversation back within its bound; meanwhile (the conversation's
        # sessions live until this returns) another conversation is served on the same worker.
        await wait_until(lambda: 0 < sleepers(worker.proc.proc.pid) <= CONVERSATION_BOUND, 60,
                         "the conversation to be cut back within its bound")
        b_space = Path(tmp_path) / "other"
        b_space.mkdir()
        run_b = await asyncio.to_thread(
            drive, [[b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_other")], [b.message("done")]],
            redis_url=worker.redis.url, workspace=b_space)
        other.update(outputs(run_b))

    run = drive([opened, polls, [b.message("done")]], redis_url=worker.redis.url, workspace=tmp_path, during=during,
                timeout=120)
    assert "CONTROL-OK" in other["call_other"], other
    polled = {call: text for call, text in outputs(run, 2).items() if call.startswith("call_p")}
    assert set(polled) == {f"call_p{k}" for k in range(1, 5)}  # one output each
    killed = [text for text in polled.values() if "toolq killed this session" in text]
    assert killed and all("TOOLQ_SANDBOX_CONVERSATION_PROCESSES" in text for text in killed), polled
    assert len(killed) < 4, "only as many sessions as the bound needs are killed"


@pytest.fixture(scope="module")
def cpu_bounded_worker(tmp_path_factory):
    if os.geteuid() != 0 or limits.cgroup_base("cpu") is None:
        pytest.skip("the CPU quota needs a cpu cgroup this process may create (root on cgroup v1 here)")
    yield from worker_of_its_own(tmp_path_factory, TOOLQ_SANDBOX_WORKER_CPUS="0.1")


def host_cpu_cgroups(worker_pid: int) -> list[Path]:
    """The CPU groups of the worker's session hosts (named after each host's pid)."""
    base = limits.cgroup_base("cpu")
    assert base is not None
    pids = {p.pid for p in psutil.Process(worker_pid).children(recursive=True)}
    return [cg for cg in base.glob("toolq-pool-sessions-*") if int(cg.name.rpartition("-")[2]) in pids]


def throttled(cg: Path) -> int:
    stat = dict(line.split() for line in (cg / "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


def test_the_commands_of_a_worker_share_a_cpu_quota(drive, cpu_bounded_worker, tmp_path):
    worker_pid = cpu_bounded_worker.proc.proc.pid
    spin = "end=$(( $(date +%s) + 3 )); while [ $(date +%s) -lt $end ]; do :; done; echo SPUN"
    before = {cg: throttled(cg) for cg in host_cpu_cgroups(worker_pid)}
    run = drive([[b.function_call("exec_command", {"cmd": spin, "yield_time_ms": 30000}, "call_spin")],
                 [b.message("done")]], redis_url=cpu_bounded_worker.redis.url, workspace=tmp_path)
    assert "SPUN" in outputs(run)["call_spin"]
    groups = host_cpu_cgroups(worker_pid)
    assert groups, "the session host has a CPU group of its own"
    assert all((cg / "cpu.cfs_quota_us").read_text().strip() == "10000" for cg in groups)
    assert any(throttled(cg) > before.get(cg, 0) for cg in groups), "the spinning command was throttled"
