"""One call's progress through its step, and the only place its state changes.

A call is PENDING until its turn in call order comes (`startable`), QUEUED once it is on its way
to the fleet, THROTTLED while a limit holds it back, RUNNING once a worker reports starting it,
and then settled: its `result` and terminal state are set once, by whoever gets there first
(the worker's result, the watchdog, a deadline, a cancel), and every later settle is a no-op.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from toolq.core.calls import ToolInvocation, ToolResult, aborted_text, output_item
from toolq.core.catalog import ToolSpec
from toolq.core.contracts import STREAM_BYTES
from toolq.core.items import OutputItem
from toolq.core.states import CallState
from toolq.core.truncate import bound_output
from toolq.orchestrator import spans
from toolq.orchestrator.binding import BoundCall
from toolq.orchestrator.transport import CallWatch
from toolq.telemetry import metrics

#: Held by this process, never sent: nothing to revoke, and a cancel answers them here.
UNSENT = (CallState.PENDING, CallState.THROTTLED)


def startable(calls: list[tuple[CallState, bool]]) -> list[int]:
    """Which pending calls may start, given each call's (state, serial) in call order.

    Codex's read/write lock (contract 9): parallel calls start at once; a serial call starts
    only when every call before it is done, and nothing after it starts until it is done."""
    ready: list[int] = []
    for i, (state, serial) in enumerate(calls):
        if state.terminal:
            continue
        if serial:
            if state is CallState.PENDING and all(s.terminal for s, _ in calls[:i]):
                ready.append(i)
            break
        if state is CallState.PENDING:
            ready.append(i)
    return ready


@dataclass(eq=False)
class CallEntry:
    """One call's progress through the step."""

    call: BoundCall
    state: CallState = CallState.PENDING
    result: ToolResult | None = None
    added_at: float = field(default_factory=time.time)
    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: str | None = None
    throttled_by: str | None = None
    """The limit that held the call back, if one did."""
    task: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    live_output: str = ""
    """What the worker streamed while the call runs (bounded; shown only, never the output)."""
    watch: CallWatch | None = None
    span: Any = None
    """Its `execute_tool` span (spans.py) when tracing is on: ended where its final state is decided."""

    @property
    def call_id(self) -> str:
        return self.call.call_id

    @property
    def tool(self) -> str:
        return self.call.tool

    @property
    def inv(self) -> ToolInvocation | None:
        return self.call.invocation

    @property
    def spec(self) -> ToolSpec | None:
        return self.call.spec

    @property
    def task_id(self) -> str | None:
        return self.inv.task_id if self.inv else None

    @property
    def unsent(self) -> bool:
        return not self.done.is_set() and self.state in UNSENT

    # --- transitions: each says whether it changed anything (watchers hear only real changes) ---

    def begin(self) -> None:
        """Its turn in call order came: on its way (THROTTLED instead if a limit holds it back)."""
        self.state = CallState.QUEUED

    def throttle(self, why: str) -> bool:
        """Held back by a limit. A call answered already (cancelled) is not held back again by a
        late notice, nor is one held for the same reason twice."""
        if self.done.is_set() or (self.state is CallState.THROTTLED and self.throttled_by == why):
            return False
        self.state, self.throttled_by = CallState.THROTTLED, why
        return True

    def send(self) -> bool:
        """The limits let it go: it is sent now. True if it had been throttled."""
        throttled = self.state is CallState.THROTTLED
        self.state, self.queued_at = CallState.QUEUED, time.time()
        return throttled

    def run(self, watch: CallWatch) -> None:
        """A worker reported starting it."""
        self.state, self.worker, self.started_at = CallState.RUNNING, watch.hostname, watch.started_at

    def printed(self, text: str) -> bool:
        """Output streamed while it runs, kept up to STREAM_BYTES (shown, never the output)."""
        if self.done.is_set() or len(self.live_output) >= STREAM_BYTES:
            return False
        self.live_output += text[:STREAM_BYTES - len(self.live_output)]
        return True

    def settle(self, result: ToolResult) -> bool:
        """The call's one outcome: the first settle wins, and False says another came first."""
        if self.done.is_set():
            return False
        self.result, self.state, self.finished_at = result, result.status, time.time()
        self.done.set()
        metrics.call_settled(str(self.spec.tool_name) if self.spec is not None else None, result.status.value,
                             result.output, self.finished_at - self.added_at)
        if self.span is not None:
            spans.end_tool(self.span, result, self.worker)
        return True

    def aborted(self, worker: str | None = None) -> ToolResult:
        """The outcome of a call stopped before it ended (Codex's words for a shell call)."""
        return ToolResult(call_id=self.call_id, output=aborted_text(self.call.shell_like, time.time() - self.added_at),
                          status=CallState.CANCELLED, success=False, worker=worker)

    def output(self) -> OutputItem:
        assert self.result is not None
        # Workers bound their outputs already (then this changes nothing); what the orchestrator made,
        # or an older worker sent, is bounded here. A `whole_output` tool's is not (a front door reads it).
        whole = self.call.spec is not None and self.call.spec.whole_output
        body = self.result.output if whole else bound_output(self.result.output)
        return output_item(self.call.kind, self.call_id, body, tools=self.result.tools)
