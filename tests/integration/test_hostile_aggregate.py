"""Issue 24 item 8, as the attacker would: sessions must not multiply the per-call limits.

Each session holds a spawn slot, and each slot had its own process and memory limit: one turn of
32 sessions held 7,682 processes on the host, and a conversation may hold 64. Now every slot's
cgroups sit under one of the session host's, bounding all its commands and sessions together.
Here a worker with a per-call limit of 64 processes and an aggregate of 300 gets a turn that opens
8 sessions of 60 processes each (480 wanted); the worker's tree must stay under the aggregate, and
the next step's command must be served.
"""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from tests.integration.test_builtin_tools import outputs
from tests.integration.test_cancel import wait_until
from tests.integration.test_hostile_exec import hostile_workers, locked_redis  # noqa: F401 - fixtures
from toolq.orchestrator.fake_model import builders as b
from toolq.workers.isolation import limits

pytestmark = pytest.mark.integration

AGGREGATE = 300
SESSIONS, EACH = 8, 60


@pytest.fixture(scope="module")
def bounded_worker(locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    if os.geteuid() != 0 or limits.pids_cgroup_base() is None:
        pytest.skip("the aggregate bound needs a pids cgroup this process may create (root on cgroup v1 here)")
    yield from hostile_workers("bwrap", locked_redis, tmp_path_factory, TOOLQ_SANDBOX_WORKER_PROCESSES=str(AGGREGATE),
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
    assert "CONTROL-OK" in got["call_control"] or "Resource temporarily unavailable" in got["call_control"]
    # The conversation's end kills its sessions: wait until their processes are gone.
    asyncio.run(wait_until(lambda: tree_size(worker_pid) < 64, 60, "the sessions' processes to end"))
    after = drive([[b.function_call("exec_command", {"cmd": "echo CONTROL-OK"}, "call_after")], [b.message("done")]],
                  redis_url=bounded_worker.redis.url, workspace=tmp_path)
    assert "CONTROL-OK" in outputs(after)["call_after"]
