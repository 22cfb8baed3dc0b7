"""The barrier's seam to the fleet: send a call, hear how it ended, ask whether a worker lives.

Like httpx's `BaseTransport`: a small protocol, and one implementation per file. `celery_transport`
is the real fleet (Celery + Redis); `memory` runs handlers in-process, so the barrier's contracts
(call order, serial gating, abort, deadlines, lost workers, first terminal state wins) are tested
without Redis. Nothing here imports Celery or Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from toolq.core.calls import ToolInvocation, ToolResult
from toolq.core.catalog import ToolSpec
from toolq.core.session_records import SessionRecord
from toolq.core.states import CallState


class DispatchError(Exception):
    """The queue could not take the call; the call gets a model-visible "not run" output.
    `state`: FAILED when the queue was unavailable, REJECTED when no live worker serves the tool."""

    def __init__(self, message: str, state: CallState = CallState.FAILED, output: str | None = None) -> None:
        super().__init__(message)
        self.state = state
        self.output = output
        """The exact model-visible output, when the default "<tool> was not run: ..." is not it."""


class TaskOutcome(BaseModel):
    """How a task ended, as the barrier needs it (never Celery's result format)."""

    state: CallState
    result: ToolResult | None = None
    """What the worker returned, model-visible output included; None when it returned nothing
    (its process died, it was revoked, its hard time limit struck)."""
    reason: str | None = None
    """Without a result: the model-visible text saying what happened."""


@dataclass(eq=False)
class CallWatch:
    """What the transport knows of one task: where and when it started, and how it ended."""

    task_id: str
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    hostname: str | None = None
    started_at: float | None = None
    on_started: Callable[[CallWatch], None] | None = None
    on_output: Callable[[str], None] | None = None
    """Hears the call's output while it runs (toolq/workers/streaming.py); shown, never its output."""
    output_seq: int = 0
    """The last output batch heard: an older or replayed one is dropped."""
    session_command: str | None = None
    """A write_stdin's session's command line, from its record when it was routed (for the view)."""
    session: SessionRecord | None = None
    """A write_stdin's session (which worker instance holds it), once the call is routed."""

    def set_started(self, hostname: str | None) -> None:
        if self.hostname is not None or self.done.done():
            return
        self.hostname, self.started_at = hostname, time.time()
        if self.on_started:
            self.on_started(self)

    def output(self, seq: int, text: str) -> None:
        if self.done.done() or seq <= self.output_seq or self.on_output is None:
            return
        self.output_seq = seq
        self.on_output(text)

    def finish(self, outcome: TaskOutcome) -> bool:
        """The first terminal state wins: a late SUCCESS after REVOKED is not applied."""
        if self.done.done():
            return False
        self.done.set_result(outcome)
        return True


class Watches:
    """The calls a transport is listening for, by task id (a base for each implementation)."""

    def __init__(self) -> None:
        self._watches: dict[str, CallWatch] = {}

    def watch(self, task_id: str, on_started: Callable[[CallWatch], None] | None = None) -> CallWatch:
        """Start listening for a task before it is sent, so no report is missed."""
        w = self._watches.get(task_id)
        if w is None:
            w = self._watches[task_id] = CallWatch(task_id=task_id, on_started=on_started)
        return w

    def forget(self, task_id: str) -> None:
        self._watches.pop(task_id, None)


class Transport(Protocol):
    """Dispatch and results, behind one seam."""

    @property
    def reconnected_at(self) -> float:
        """Monotonic time the result channel last came back after a lost connection (0: never)."""
        ...

    def watch(self, task_id: str, on_started: Callable[[CallWatch], None] | None = None) -> CallWatch:
        """Start listening for a task before it is sent, so no report is missed."""

    def forget(self, task_id: str) -> None: ...

    async def send(self, inv: ToolInvocation, spec: ToolSpec) -> None:
        """Queue the call at most once (a call queued before is not sent again, and its stored
        outcome, if any, is delivered). Raises `DispatchError` when the queue is unavailable."""

    async def revoke(self, task_ids: list[str]) -> None:
        """Stop the tasks: never start them, and kill the ones running."""

    async def worker_alive(self, hostname: str, task_id: str | None = None) -> bool:
        """Whether the worker answers, or says it is draining (warm shutdown); with `task_id`, also
        whether it is still the process instance that took that task (not one restarted under its name)."""

    async def requeue_if_stranded(self, inv: ToolInvocation, spec: ToolSpec, queued_at: float) -> None:
        """Asked while a sent call waits to start: if a worker took it and died before starting it,
        put it back on its queue (`toolq.orchestrator.transport.stranded`)."""

    async def vanished(self, task_id: str) -> bool:
        """After the queue restarted: no stored state and no worker holding the task."""


class CallRecords(Protocol):
    """The ledger as the barrier writes it (states the orchestrator decides)."""

    async def set_state(self, task_id: str, state: str, **fields: Any) -> None: ...

    async def record_unqueued(self, turn_id: str, step: int, output_index: int, call_id: str, tool: str,
                              state: str, task_id: str) -> None: ...

    async def mark_throttled(self, inv: ToolInvocation, reason: str) -> None:
        """List a call a limit holds back (not sent yet) as `throttled`."""

    async def recorded_end(self, task_id: str) -> tuple[CallState, str] | None:
        """The end a worker recorded for the call (its state, its name), if one did: a call whose
        result never came back may still have finished."""
