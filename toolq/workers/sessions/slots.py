"""Spawn slots: where the session host starts commands, one running command per slot.

A slot is a thread that lives as long as the host, sitting alone in a pids and a memory cgroup of
its own (cgroup v1 moves single threads, through `tasks`). What it spawns starts in those cgroups,
so each command gets the per-call process and memory limits a pool child gives its call
(`isolation/limits.py`; the thread shares the host's memory, which stays charged to the host), and
the thread moves once, at the slot's creation: a move costs ~15 ms here, too much for every call.
A long-lived spawning thread is also what bwrap's --die-with-parent (PR_SET_PDEATHSIG) needs: it
fires when the thread that forked exits. The cgroups are named like the pool children's
(`toolq-pool-<slot>-<host pid>`), so the worker removes those of a dead host at its shutdown.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from toolq.workers.isolation import cell, limits
from toolq.workers.isolation.policy import Limits

#: The slot's own thread and its bubblewrap cell (`isolation/cell.py`), besides the command's processes.
SLOT_TASKS_SLACK = 1 + cell.CELL_TASKS


class Slot:
    def __init__(self, index: int, lim: Limits | None, prepare: Callable[[], object] | None = None,
                 parents: dict[str, Path | None] | None = None) -> None:
        self.index = index
        self._parents = parents or {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"toolq-session-slot{index}")
        self.cgroup: Path | None = None
        self.memory_cgroup: Path | None = None
        self.cpu_cgroup: Path | None = None
        if lim is not None:
            self.cgroup = self._thread.submit(self._enter_cgroup, "pids", {
                "pids.max": str(lim.processes + SLOT_TASKS_SLACK)}).result()
            self.memory_cgroup = self._thread.submit(self._enter_cgroup, "memory", {
                "memory.limit_in_bytes": str((lim.memory_mb + limits.OWN_MEMORY_SLACK_MB) * limits.MIB)}).result()
            if self._parents.get("cpu") is not None:  # a share of the host's: no slot starves another
                self.cpu_cgroup = self._thread.submit(self._enter_cgroup, "cpu", {}).result()
        if prepare is not None:  # after the cgroups, which it may hide (isolation.spawner)
            self._thread.submit(prepare).result()
        self.busy = False
        self.idle_since = time.monotonic()
        self.may_hold_cell = False
        """Its thread may keep a bubblewrap cell (`isolation/cell.py`) since it last ran a command."""

    def _enter_cgroup(self, controller: str, settings: dict[str, str]) -> Path | None:
        """Runs on the slot's thread: move it alone into a new cgroup of `controller`."""
        parent = self._parents.get(controller)
        name = f"s{self.index}" if parent is not None else f"toolq-pool-s{self.index}-{os.getpid()}"
        return limits.enter_cgroup(controller, settings, name=name, thread=True, parent=parent)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.may_hold_cell = True
        return self._thread.submit(fn, *args, **kwargs).result()

    def held(self) -> tuple[int, int]:
        """Processes (its thread and cell included) and bytes of memory its command holds now."""
        return limits.cgroup_number(self.cgroup, "pids.current"), limits.cgroup_number(
            self.memory_cgroup, "memory.usage_in_bytes")

    def remove(self) -> None:
        for cg in (self.cgroup, self.memory_cgroup, self.cpu_cgroup):
            if cg is not None:
                limits.remove_cgroup(cg)


class Slots:
    def __init__(self, lim: Limits | None, most: int, prepare: Callable[[], object] | None = None) -> None:
        self.lim = lim
        self.prepare = prepare
        """Run once on each slot's thread before its first spawn."""
        self.most = most
        """Slots at most: commands running at once on this worker, sessions included. A command
        that reached the host's socket (Landlock leaves pathname unix sockets open) cannot use it
        to run more than this."""
        self._lock = threading.Lock()
        self._all: list[Slot] = []
        self.parents: dict[str, Path | None] = {}
        """Above every slot's cgroups: the bound of all commands and sessions together (sessions each
        hold a slot, and must not multiply the per-call limits)."""
        if lim is not None:
            name = f"toolq-pool-sessions-{os.getpid()}"  # removed with the pool's when this host is gone
            if lim.worker_processes:
                self.parents["pids"] = limits.enter_cgroup("pids", {"pids.max": str(lim.worker_processes)},
                                                           name=name, thread=None)
            if lim.worker_memory_mb:
                self.parents["memory"] = limits.enter_cgroup(
                    "memory", {"memory.limit_in_bytes": str(lim.worker_memory_mb * limits.MIB)}, name=name, thread=None)
            # Always a group, quota or not: the commands then compete for the CPU as one beside the
            # worker's own processes (64 spinning sessions are one share, not 64).
            self.parents["cpu"] = limits.enter_cgroup("cpu", {
                "cpu.cfs_period_us": str(limits.CPU_PERIOD_US),
                "cpu.cfs_quota_us": str(round(lim.worker_cpus * limits.CPU_PERIOD_US) if lim.worker_cpus else -1)},
                name=name, thread=None)
            if self.parents.get("pids") is None:  # a worker that may not create cgroups: RLIMIT_NPROC
                limits.bound_uid_processes(lim.worker_processes)

    def full(self) -> str | None:
        """Which bound of all commands and sessions together is (nearly) reached, in words; None if none.
        A command that could not start is told this instead of what failed because of it."""
        lim = self.lim
        if lim is None:
            return None
        pids, memory = self.parents.get("pids"), self.parents.get("memory")
        if (limits.cgroup_number(pids, "pids.current") + SLOT_TASKS_SLACK >= lim.worker_processes if pids is not None
                else limits.uid_ceiling_reached(SLOT_TASKS_SLACK)):
            return (f"this worker's commands and sessions together hold its limit of {lim.worker_processes} "
                    "processes (TOOLQ_SANDBOX_WORKER_PROCESSES); end a session first")
        used = limits.cgroup_number(memory, "memory.usage_in_bytes")
        if memory is not None and used + limits.OWN_MEMORY_SLACK_MB * limits.MIB >= lim.worker_memory_mb * limits.MIB:
            return (f"this worker's commands and sessions together hold its limit of {lim.worker_memory_mb} MiB "
                    "(TOOLQ_SANDBOX_WORKER_MEMORY_MB); end a session first")
        return None

    def take(self) -> Slot:
        with self._lock:
            for slot in self._all:
                if not slot.busy:
                    slot.busy = True
                    return slot
            if len(self._all) >= self.most:
                raise OSError(errno.EAGAIN, f"this worker already runs {self.most} commands and sessions")
            slot = Slot(len(self._all), self.lim, self.prepare, self.parents)
            slot.busy = True
            self._all.append(slot)
            return slot

    def give_back(self, slot: Slot) -> None:
        with self._lock:
            slot.busy = False
            slot.idle_since = time.monotonic()

    def close_idle_cells(self, idle: float) -> None:
        """Stop the cells of slots idle this long (each holds a sandbox, ~12 MB, and its workspace's
        bind). On the slot's own thread, queued: a command taken meanwhile runs after, in a new cell."""
        now = time.monotonic()
        with self._lock:
            for slot in self._all:
                if slot.may_hold_cell and not slot.busy and now - slot.idle_since >= idle:
                    slot.may_hold_cell = False
                    slot._thread.submit(cell.close_slot_cell)

    def remove_all(self) -> None:
        with self._lock:
            for slot in self._all:
                slot.remove()
            for parent in self.parents.values():
                if parent is not None:
                    limits.remove_cgroup(parent)
