"""Issue 24 item 8, as the attacker would: sessions must not multiply the per-call limits.

Each session holds a spawn slot, and each slot had its own process and memory limit: one turn of
32 sessions held 7,682 processes on the host, and a conversation may hold 64. Now every slot's
cgroups sit under one of the session host's, bounding all its commands and sessions together
(pids, memory, and a CPU group with an optional quota), one conversation's share of them is
bounded too, and a worker that may not create cgroups (one running as `nobody`) caps
RLIMIT_NPROC, which counts every process of its uid, at the same aggregate. On bubblewrap and
Landlock workers, as root and as `nobody`:
- the issue's own attack on a worker with the default bounds: one turn opens 32 sessions of 240
  processes each (7,680 wanted); the worker's tree stays under TOOLQ_SANDBOX_WORKER_PROCESSES,
  another conversation gets its answer meanwhile, and once the turn's conversation ends the
  worker serves the next call;
- a worker with a per-call limit of 64 processes and an aggregate of 300 gets a turn that opens 8
  sessions of 60 processes each (480 wanted): the worker's tree stays under the aggregate, a
  command that cannot start is told so in one line, and once the conversation ends it serves;
- (root: cgroups) a conversation bounded to 150 processes opens 4 sessions of 60: toolq kills its
  newest sessions until it is within the bound (each poll of one says why), while another
  conversation is served;
- (root: cgroups) a spinning command on a worker whose commands may use 0.1 CPU together is
  throttled by the kernel (the cgroup's own `nr_throttled` counter, not a clock).
No test asserts how long anything took.
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
from toolq.dev.fake_model import builders as b
from toolq.workers.isolation import limits

pytestmark = pytest.mark.integration

BACKENDS = ("bwrap", "landlock")
#: Root workers (cgroups) and workers running as `nobody` (RLIMIT_NPROC), on each backend.
WORKERS = [pytest.param((backend, user), id=f"{backend}-{'nobody' if user else 'root'}")
           for backend in BACKENDS for user in (False, True)]
#: The worker's own processes (itself, pool children, session host, cells) beside its commands'.
OWN = 64
#: Processes that prove an attack is under way (the per-call limit alone would allow one session's).
UNDER_WAY = 480


def worker_of_its_own(tmp_path_factory, backend: str, user: bool = False, **settings: str):
    """A worker on a Redis of its own (another test's worker must not take its calls)."""
    if os.geteuid() != 0:
        pytest.skip("the aggregate bounds are tried on root and nobody workers, which needs root")
    if not user and limits.pids_cgroup_base() is None:
        pytest.skip("a root worker's aggregate bound needs a pids cgroup this process may create (cgroup v1 here)")
    for redis_server in locked_redis_server(tmp_path_factory):
        yield from hostile_workers(backend, redis_server, tmp_path_factory, user=user, **settings)


def tree_size(pid: int) -> int:
    return 1 + len(psutil.Process(pid).children(recursive=True))


def sleepers(worker_pid: int) -> int:
    """The attacker's `sleep 120` processes among the worker's."""
    count = 0
    for child in psutil.Process(worker_pid).children(recursive=True):
        try:
            count += child.cmdline() == ["sleep", "120"]
        except psutil.Error:
            pass
    return count


def answered(session, call_id: str) -> bool:
    return any(item.get("type") == "function_call_output" and item.get("call_id") == call_id
               for item in session.history.to_json())


def opening(sessions: int, each: int) -> list:
    spawn = f"for i in $(seq {each}); do sleep 120 & done; echo started; wait"
    return [b.function_call("exec_command", {"cmd": spawn, "yield_time_ms": 1500}, f"call_s{k}")
            for k in range(sessions)]


# --- the attack, against the default bounds ----------------------------------------------

DEFAULT_WORKER_PROCESSES = 2048  # TOOLQ_SANDBOX_WORKER_PROCESSES's default


@pytest.fixture(scope="module", params=WORKERS)
def default_worker(request, tmp_path_factory):
    backend, user = request.param
    # The defaults but for the CPU time the hostile workers' LIMITS lower (forking 240 sleeps takes some).
    yield from worker_of_its_own(tmp_path_factory, backend, user, TOOLQ_SANDBOX_PROCESSES="256",
                                 TOOLQ_SANDBOX_CPU_SECONDS="120")


def test_32_sessions_of_240_processes_hold_the_default_bounds(drive, default_worker, tmp_path):
    worker = default_worker
    worker_pid = worker.proc.proc.pid
    ws = worker.workspace(tmp_path)
    script = [opening(32, 240), [b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_control")],
              [b.message("done")]]
    peak: list[int] = []
    other: dict[str, str] = {}

    async def during(session, runtime) -> None:
        async def sample() -> None:
            while True:
                peak.append(tree_size(worker_pid))
                await asyncio.sleep(0.2)

        sampler = asyncio.create_task(sample())
        try:
            await wait_until(lambda: sleepers(worker_pid) >= UNDER_WAY, 180, "the attack to be under way")
            # The host stays responsive: another conversation's command gets its answer meanwhile.
            other_ws = worker.workspace(Path(tmp_path) / "other") if worker.user else Path(tmp_path) / "other"
            other_ws.mkdir(exist_ok=True)
            run_b = await asyncio.to_thread(
                drive, [[b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_other")],
                        [b.message("done")]], redis_url=worker.redis.url, workspace=other_ws, timeout=120)
            other.update(outputs(run_b))
            await wait_until(lambda: answered(session, "call_control"), 240, "the attacking turn to end")
        finally:
            sampler.cancel()

    run = drive(script, redis_url=worker.redis.url, workspace=ws, during=during, timeout=300)
    got = {**outputs(run, 1), **outputs(run, 2)}
    assert set(got) == {f"call_s{k}" for k in range(32)} | {"call_control"}  # one output each
    assert max(peak) < DEFAULT_WORKER_PROCESSES + OWN, max(peak)  # not 7,680
    if worker.user:  # RLIMIT_NPROC bounds the uid's processes: a command that cannot fork may be refused
        assert "CONTROL-OK" in other["call_other"] or "TOOLQ_SANDBOX_WORKER_PROCESSES" in other["call_other"], other
    else:  # the conversation's bound leaves room under the worker's for another conversation
        assert "CONTROL-OK" in other["call_other"], other
    asyncio.run(wait_until(lambda: tree_size(worker_pid) < OWN, 120, "the sessions' processes to end"))
    after = drive([[b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_after")], [b.message("done")]],
                  redis_url=worker.redis.url, workspace=ws)
    assert "CONTROL-OK" in outputs(after)["call_after"]


# --- a small aggregate, every path ---------------------------------------------------------------

AGGREGATE = 300
SESSIONS, EACH = 8, 60


@pytest.fixture(scope="module", params=WORKERS)
def bounded_worker(request, tmp_path_factory):
    backend, user = request.param
    yield from worker_of_its_own(tmp_path_factory, backend, user, TOOLQ_SANDBOX_WORKER_PROCESSES=str(AGGREGATE),
                                 TOOLQ_SANDBOX_CPU_SECONDS="30")


def test_sessions_cannot_multiply_the_process_limit(drive, bounded_worker, tmp_path):
    worker_pid = bounded_worker.proc.proc.pid
    ws = bounded_worker.workspace(tmp_path)
    peak = []

    async def during(session, runtime) -> None:  # while the sessions run: how many processes the worker holds
        while not answered(session, "call_control"):
            peak.append(tree_size(worker_pid))
            await asyncio.sleep(0.1)

    script = [opening(SESSIONS, EACH), [b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_control")],
              [b.message("done")]]
    run = drive(script, redis_url=bounded_worker.redis.url, workspace=ws, during=during, timeout=120)
    got = {**outputs(run, 1), **outputs(run, 2)}
    assert set(got) == {f"call_s{k}" for k in range(SESSIONS)} | {"call_control"}  # one output each
    assert max(peak) < AGGREGATE + OWN, peak
    assert any("Resource temporarily unavailable" in text or "processes" in text for text in got.values()), got
    # While the conversation's sessions hold the bound, its next command is refused in one line
    # (within one conversation that is the bound doing its job); once they end, the worker serves.
    assert "CONTROL-OK" in got["call_control"] or "TOOLQ_SANDBOX_WORKER_PROCESSES" in got["call_control"], got
    # The conversation's end kills its sessions: wait until their processes are gone.
    asyncio.run(wait_until(lambda: tree_size(worker_pid) < OWN, 60, "the sessions' processes to end"))
    after = drive([[b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_after")], [b.message("done")]],
                  redis_url=bounded_worker.redis.url, workspace=ws)
    assert "CONTROL-OK" in outputs(after)["call_after"]


# --- one conversation's share (root: the slots' cgroups count it) --------------------------------

CONVERSATION_BOUND = 150


@pytest.fixture(scope="module", params=BACKENDS)
def conversation_bounded_worker(request, tmp_path_factory):
    yield from worker_of_its_own(tmp_path_factory, request.param, TOOLQ_SANDBOX_CPU_SECONDS="30",
                                 TOOLQ_SANDBOX_CONVERSATION_PROCESSES=str(CONVERSATION_BOUND))


def test_one_conversation_cannot_hold_the_whole_worker(drive, conversation_bounded_worker, tmp_path):
    worker = conversation_bounded_worker
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

    run = drive([opening(4, EACH), polls, [b.message("done")]], redis_url=worker.redis.url, workspace=tmp_path,
                during=during, timeout=120)
    assert "CONTROL-OK" in other["call_other"], other
    polled = {call: text for call, text in outputs(run, 2).items() if call.startswith("call_p")}
    assert set(polled) == {f"call_p{k}" for k in range(1, 5)}  # one output each
    killed = [text for text in polled.values() if "toolq killed this session" in text]
    assert killed and all("TOOLQ_SANDBOX_CONVERSATION_PROCESSES" in text for text in killed), polled
    assert len(killed) < 4, "only as many sessions as the bound needs are killed"


# --- a CPU quota over all of a worker's commands (root: a cpu cgroup) -----------------------------

@pytest.fixture(scope="module", params=BACKENDS)
def cpu_bounded_worker(request, tmp_path_factory):
    if os.geteuid() == 0 and limits.cgroup_base("cpu") is None:
        pytest.skip("the CPU quota needs a cpu cgroup this process may create (cgroup v1 here)")
    yield from worker_of_its_own(tmp_path_factory, request.param, TOOLQ_SANDBOX_WORKER_CPUS="0.1")


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
