"""Issue 24 item 8 where the worker may not create cgroups (a worker that is not root): every
command's RLIMIT_NPROC is capped at one ceiling for the whole session host, so sessions cannot
multiply the per-call limit (each got "what the uid runs + the limit"), and bubblewrap, whose user
namespace the kernel bounds by its creator's RLIMIT_NPROC, starts under that ceiling too. The
real kernel's side is in tests/integration/test_hostile_aggregate.py (workers as `nobody`)."""

from __future__ import annotations

import resource

import pytest

from toolq.workers.isolation import limits
from toolq.workers.isolation.policy import Limits
from toolq.workers.sessions import slots

LIM = Limits(2048, 256, 300, 1024, worker_processes=300)


@pytest.fixture
def not_root(monkeypatch):
    monkeypatch.setattr(limits.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(limits, "pids_cgroup_base", lambda: None)
    monkeypatch.setattr(limits, "_pool_cgroup", None)
    monkeypatch.setattr(limits, "_uid_ceiling", None)


def test_a_worker_without_cgroups_caps_every_commands_nproc_at_one_ceiling(not_root, monkeypatch):
    monkeypatch.setattr(limits, "_tasks_of_uid", lambda uid: 40)  # the worker's own processes and threads
    assert limits.bound_uid_processes(LIM.worker_processes) == 340
    monkeypatch.setattr(limits, "_processes_of_uid", lambda uid: 20)  # the first command: the per-call limit
    assert limits.CallLimits(LIM).nproc == 20 + 256
    monkeypatch.setattr(limits, "_processes_of_uid", lambda uid: 250)  # sessions hold 230: no more than the ceiling
    call = limits.CallLimits(LIM)
    assert call.nproc == 340
    assert (resource.RLIMIT_NPROC, (340, 340)) in call.rlimits()
    assert "--nproc=340" in (call.prlimit_prefix() or ["--nproc=340"])


def test_bubblewrap_starts_under_the_ceiling_and_the_host_says_when_it_is_held(not_root, monkeypatch):
    monkeypatch.setattr(limits, "_prlimit", lambda: "/usr/bin/prlimit")
    assert limits.uid_ceiling_prefix() == []  # no ceiling yet
    monkeypatch.setattr(limits, "_tasks_of_uid", lambda uid: 40)
    limits.bound_uid_processes(LIM.worker_processes)
    assert limits.uid_ceiling_prefix() == ["/usr/bin/prlimit", "--nproc=340", "--"]
    held = slots.Slots.__new__(slots.Slots)  # only the bound's words: no slot, thread or cgroup
    held.lim, held.parents = LIM, {}
    monkeypatch.setattr(limits, "_tasks_of_uid", lambda uid: 100)
    assert held.full() is None
    monkeypatch.setattr(limits, "_tasks_of_uid", lambda uid: 340)
    assert "TOOLQ_SANDBOX_WORKER_PROCESSES" in (held.full() or "")


def test_root_and_workers_with_a_pids_cgroup_need_no_ceiling(monkeypatch):
    monkeypatch.setattr(limits, "_uid_ceiling", None)
    monkeypatch.setattr(limits.os, "geteuid", lambda: 0)
    assert limits.bound_uid_processes(300) is None  # RLIMIT_NPROC binds no root: the pids cgroup does
    monkeypatch.setattr(limits.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(limits, "pids_cgroup_base", lambda: "/sys/fs/cgroup/pids")
    assert limits.bound_uid_processes(300) is None
    assert limits.bound_uid_processes(0) is None and limits.uid_ceiling_prefix() == []
