"""An in-process fleet behind the `Transport` seam (like httpx's `MockTransport`).

Calls run as asyncio tasks in this process, through the same checks and handler call a worker uses, so
the barrier's contracts get fast tests without Redis or Celery. A test can also steer it: stall a
call, silence a worker, deliver an outcome by hand, make the queue refuse a send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from toolq.core.calls import ToolInvocation, ToolResult
from toolq.core.catalog import Catalog, ToolSpec
from toolq.core.states import CallState
from toolq.orchestrator.transport import DispatchError, TaskOutcome, Watches

#: Runs one call to its result (by default: the tool's handler, as a worker runs it).
Runner = Callable[[ToolInvocation, ToolSpec], Awaitable[ToolResult]]

HOSTNAME = "memory@toolq"


def catalog_runner(catalog: Catalog, hostname: str = HOSTNAME) -> Runner:
    """Run calls with their handlers from `catalog`, exactly as `toolq.workers.execute` would."""
    from toolq.workers.execute import run_in_process

    async def run(inv: ToolInvocation, spec: ToolSpec) -> ToolResult:
        # On this event loop: a sync handler runs inline, so keep test tools quick or async.
        return await run_in_process(inv, catalog.get(inv.tool_name), catalog, hostname)

    return run


class MemoryTransport(Watches):
    """Calls run in-process; every send, revoke and outcome is kept for tests to read."""

    def __init__(self, run: Runner, *, hostname: str = HOSTNAME) -> None:
        super().__init__()
        self.run = run
        self.hostname = hostname
        self.reconnected_at = 0.0
        self.sent: list[str] = []
        """Task ids in the order they were sent (each at most once)."""
        self.revoked: list[str] = []
        self.alive: dict[str, bool] = {}
        """Worker hostname -> whether it answers (default: yes)."""
        self.vanished_tasks: set[str] = set()
        self.probe_error: Exception | None = None
        """When set, the watchdog's questions (and revokes) raise it, as when Redis blinks."""
        self.refuse_sends: str | None = None
        """When set, every send fails with this reason (the queue is down)."""
        self._running: dict[str, asyncio.Task] = {}

    async def send(self, inv: ToolInvocation, spec: ToolSpec) -> None:
        if self.refuse_sends is not None:
            raise DispatchError(self.refuse_sends)
        if inv.task_id in self.sent:
            return  # at most once: never sent twice
        self.sent.append(inv.task_id)
        self._running[inv.task_id] = asyncio.create_task(self._execute(inv, spec))

    async def _execute(self, inv: ToolInvocation, spec: ToolSpec) -> None:
        self.deliver_started(inv.task_id, self.hostname)
        try:
            result = await self.run(inv, spec)
        except asyncio.CancelledError:
            return
        self.deliver(inv.task_id, TaskOutcome(state=result.status, result=result))

    def deliver_started(self, task_id: str, hostname: str) -> None:
        if (w := self._watches.get(task_id)) is not None:
            w.set_started(hostname)

    def deliver(self, task_id: str, outcome: TaskOutcome) -> bool:
        """Report an outcome, as a worker or Celery would; False if one was reported before."""
        w = self._watches.get(task_id)
        return w.finish(outcome) if w is not None else False

    async def revoke(self, task_ids: list[str]) -> None:
        self._maybe_fail()
        for task_id in task_ids:
            self.revoked.append(task_id)
            task = self._running.pop(task_id, None)
            if task is not None:
                task.cancel()
            self.deliver(task_id, TaskOutcome(state=CallState.CANCELLED))

    async def worker_alive(self, hostname: str, task_id: str | None = None) -> bool:
        self._maybe_fail()
        return self.alive.get(hostname, True)

    def _maybe_fail(self) -> None:
        if self.probe_error is not None:
            raise self.probe_error

    async def requeue_if_stranded(self, inv: ToolInvocation, spec: ToolSpec, queued_at: float) -> None:
        """Nothing is taken by a worker that can die here."""

    async def vanished(self, task_id: str) -> bool:
        self._maybe_fail()
        return task_id in self.vanished_tasks

    async def aclose(self) -> None:
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)


class MemoryRecords:
    """The ledger writes the barrier makes, kept in a dict (task id -> fields)."""

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, Any]] = {}

    async def set_state(self, task_id: str, state: str, **fields: Any) -> None:
        self.calls.setdefault(task_id, {}).update(state=state, **fields)

    async def record_unqueued(self, turn_id: str, step: int, output_index: int, call_id: str, tool: str,
                              state: str, task_id: str) -> None:
        self.calls[task_id] = {"call_id": call_id, "tool": tool, "state": state, "step": step,
                               "output_index": output_index, "turn_id": turn_id}

    async def recorded_end(self, task_id: str) -> tuple[CallState, str] | None:
        return None  # the in-memory transport's results never get lost

    async def mark_throttled(self, inv: ToolInvocation, reason: str) -> None:
        self.calls.setdefault(inv.task_id, {"call_id": inv.call_id, "tool": str(inv.tool_name),
                                            "state": CallState.THROTTLED.value, "throttled_by": reason})
