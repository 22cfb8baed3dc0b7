"""The barrier: every call of a model response gets exactly one output, in call order.

A `Step` is one model response's calls. The stream layer binds each call the moment its item is
done (contract 2, `binding.bind_item`) and adds the `BoundCall` here; the step queues it (parallel
tools at once, a serial tool only when the calls before it are done, holding later ones back:
Codex's read/write lock, contract 9), admits it through the limits and tracks it to an outcome
through a `Transport` (`watchdog.py`). `wait()` returns when every call has an output; it never
waits forever. A call's state changes in one place (`call_entry.CallEntry`): the first outcome
wins, whether it is the worker's, the watchdog's or a cancel's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from toolq.core.calls import ToolInvocation, ToolResult, task_id_for
from toolq.core.errors import Fatal
from toolq.core.items import OutputItem
from toolq.core.states import CallState
from toolq.orchestrator import spans
from toolq.orchestrator.binding import BoundCall
from toolq.orchestrator.call_entry import CallEntry, startable
from toolq.orchestrator.call_items import entry_view
from toolq.orchestrator.limits import Limits, TurnSlots
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.transport import CallRecords, CallWatch, DispatchError, Transport
from toolq.orchestrator.transport.dispatch import call_queue
from toolq.orchestrator.turn_events import (
    Emit,
    ItemCompleted,
    ItemStarted,
    ItemUpdated,
    ToolCallView,
    TurnEvent,
    ignore,
)
from toolq.orchestrator.watchdog import Watchdog
from toolq.telemetry import tracing

__all__ = ["CallEntry", "Step", "flush_background", "startable"]

log = logging.getLogger("toolq.barrier")


class Step:
    def __init__(self, ctx: StepContext, transport: Transport, records: CallRecords, emit: Emit = ignore,
                 limits: Limits | None = None, *, stream_output: bool = False) -> None:
        self.ctx = ctx
        self.transport = transport
        self.records = records
        self._emit = emit
        self.stream_output = stream_output and emit is not ignore
        """Ask the workers for running commands' output (`TOOLQ_STREAM_OUTPUT`, and someone watches)."""
        self.limits = limits or Limits()
        self._slots = TurnSlots(self.limits.max_parallel_calls)
        self._watchdog = Watchdog(transport, records, self._background)
        self.entries: list[CallEntry] = []
        self.fatal: Fatal | None = None
        self.aborted = False
        self.trace_parent: Any = None
        """The turn's span (spans.py), the parent of each call's `execute_tool` span; None: the
        caller's current context (a library user's own span, a front door's client)."""
        tracing.setup(tracing.ORCHESTRATOR)  # once per process (a library's `Fleet.run_calls` too); off unless OTEL_*

    # --- adding calls (at response.output_item.done) -------------------------------------------

    def add(self, call: BoundCall) -> CallEntry:
        """Take a bound call; it is answered at once or queued when it may start. Never raises."""
        entry = CallEntry(call, span=spans.start_tool(self.trace_parent, call))
        self.entries.append(entry)
        if call.fatal is not None:
            # A runtime bug: the turn ends after this step, but the history stays paired.
            self.fatal = self.fatal or call.fatal
        if call.answer is not None:  # answered here, with no task; still listed in the ledger and the view
            self._settle(entry, call.answer)
            if call.answer.status is not CallState.COMPLETED:
                log.info("! %s %s %s: %s", entry.call_id, entry.tool, call.answer.status, call.answer.output_text())
            task_id = task_id_for(self.ctx.turn_id, self.ctx.step, call.output_index, entry.call_id)
            self._background(self.records.record_unqueued(self.ctx.turn_id, self.ctx.step, call.output_index,
                                                          entry.call_id, entry.tool, call.answer.status.value,
                                                          task_id))
            return entry
        self._pump()
        self.emit(ItemStarted(item=self._view(entry)))
        return entry

    def _pump(self) -> None:
        """Start what may start now (see `startable`)."""
        if self.aborted:
            return
        for i in startable([(e.state, e.call.serial) for e in self.entries]):
            entry = self.entries[i]
            entry.begin()
            entry.task = asyncio.create_task(self._run(entry), name=f"toolq-call-{entry.call_id}")

    def _settle(self, entry: CallEntry, result: ToolResult) -> None:
        """Give the call its outcome, unless another came first; then start what may start."""
        if entry.settle(result):
            self.emit(ItemCompleted(item=self._view(entry)))
            self._pump()

    # --- running one call ------------------------------------------------------------------------

    async def _run(self, entry: CallEntry) -> None:
        try:
            result = await self._admit_and_run(entry)
        except asyncio.CancelledError:
            if not entry.done.is_set():  # abort and cancel_unsent settle first; anything else is a bug worth seeing
                raise
            return
        except Exception as e:  # never leave a call without an output
            log.exception("tracking %s failed", entry.call_id)
            result = ToolResult(call_id=entry.call_id, output=f"toolq failed to run this call: {e}",
                                status=CallState.FAILED, success=False)
        self._settle(entry, result)

    async def _admit_and_run(self, entry: CallEntry) -> ToolResult:
        """The turn's cap first (in call order), then the tool's fleet-wide limits, then the queue.
        A call held back waits as THROTTLED, never fails for it (toolq/orchestrator/limits.py)."""
        inv, spec = entry.inv, entry.spec
        assert inv is not None and spec is not None
        if not await self._slots.take(inv.deadline, lambda why: self._throttle(entry, why), str(spec.tool_name)):
            return self._expired_throttled(entry)
        try:
            admission = None if entry.done.is_set() else await self.limits.admit(
                inv, spec, inv.deadline, lambda why: self._throttle(entry, why))
            if entry.done.is_set():  # cancelled as a wait ended (3.11's wait_for keeps a result over a cancel)
                if admission is not None:
                    admission.release()
                assert entry.result is not None
                return entry.result
            if admission is None:
                return self._expired_throttled(entry)
            try:
                if entry.send():
                    self.emit(ItemUpdated(item=self._view(entry)))
                return await self._dispatch_and_track(entry, admission.invocation)
            finally:
                admission.release()
        finally:
            self._slots.give_back()

    def _throttle(self, entry: CallEntry, why: str) -> None:
        if entry.throttle(why):
            log.info("‖ %s %s throttled: %s", entry.call_id, entry.tool, why)
            self.emit(ItemUpdated(item=self._view(entry)))
            assert entry.inv is not None
            self._background(self.records.mark_throttled(entry.inv, why))

    def _expired_throttled(self, entry: CallEntry) -> ToolResult:
        return self._watchdog.synthesize(entry, CallState.TIMED_OUT,
                                         f"call stopped: the turn's deadline passed after "
                                         f"{time.time() - entry.added_at:.1f}s while it waited for "
                                         f"{entry.throttled_by or 'a limit'}; it was never sent")

    async def _dispatch_and_track(self, entry: CallEntry, inv: ToolInvocation) -> ToolResult:
        spec = entry.spec
        assert spec is not None

        def started(w: CallWatch) -> None:
            entry.run(w)
            self.emit(ItemUpdated(item=self._view(entry)))

        def printed(text: str) -> None:
            if entry.printed(text):
                self.emit(ItemUpdated(item=self._view(entry)))

        watch = entry.watch = self.transport.watch(inv.task_id, on_started=started)
        if self.stream_output and spec.streams_output:
            inv = inv.model_copy(update={"stream_output": True})
            watch.on_output = printed
        if entry.span is not None:  # the worker's spans are children of the call's (signed with it)
            inv = spans.sent(entry.span, inv, None if spec.route == "session" else call_queue(inv, spec))
        try:
            try:
                await self.transport.send(inv, spec)
            except DispatchError as e:
                return ToolResult(call_id=inv.call_id, output=e.output or f"{spec.tool_name} was not run: {e}",
                                  status=e.state, success=False)
            return await self._watchdog.track(entry, watch)
        finally:
            self.transport.forget(inv.task_id)

    # --- the barrier -----------------------------------------------------------------------------

    async def wait(self) -> list[OutputItem]:
        """Every call's output, in call order (not completion order), once all have one."""
        for entry in list(self.entries):
            await entry.done.wait()
        return [e.output() for e in self.entries]

    async def abort(self) -> list[OutputItem]:
        """Cancel: finished calls keep their real outputs; the rest are aborted and revoked."""
        self.aborted = True
        unfinished = [e for e in self.entries if not e.done.is_set()]
        # Pending and throttled calls were never sent: nothing to revoke (a permit a throttled call
        # already took goes back as its task is cancelled; one it waits for was never its own).
        revoke = [e.task_id for e in unfinished if e.task_id and not e.unsent]
        for entry in unfinished:
            self._settle(entry, entry.aborted(entry.worker))
            if entry.task is not None:
                entry.task.cancel()
        if revoke:
            try:
                await self.transport.revoke(revoke)
            except Exception as e:  # the broker away: the calls are aborted here all the same, and a
                # worker finds the turn's durable cancel (or its deadline) before it starts one
                log.warning("could not revoke %d cancelled call(s): %s", len(revoke), e)
        for entry in unfinished:
            if entry.inv is not None:
                self._background(self.records.set_state(entry.inv.task_id, CallState.CANCELLED.value,
                                                        finished_at=time.time()))
        return [e.output() for e in self.entries]

    def cancel_unsent(self, task_id: str) -> None:
        """One call cancelled (`toolq cancel --call`) while it is still held here, pending or
        throttled: it is never sent, and its aborted output is given now, not once a limit lets it
        go. A permit its task took goes back as the task is cancelled, as in `abort`."""
        for entry in self.entries:
            if entry.task_id != task_id or not entry.unsent:
                continue
            self._settle(entry, entry.aborted())
            if entry.task is not None:
                entry.task.cancel()
            self._background(self.records.set_state(task_id, CallState.CANCELLED.value, finished_at=time.time()))
            log.info("⊘ %s %s cancelled before it was sent", entry.call_id, entry.tool)

    def detach(self) -> None:
        """Stop tracking the calls and leave them running: another orchestrator drives the turn now
        and awaits them under the same task ids (nothing is revoked, nothing recorded)."""
        self.aborted = True
        for entry in self.entries:
            if entry.task is not None:
                entry.task.cancel()

    # --- helpers ---------------------------------------------------------------------------------

    def emit(self, event: TurnEvent) -> None:
        """Tell the live view; a failing view never costs a call its output."""
        try:
            self._emit(event)
        except Exception:
            log.exception("the live view failed on %s", event.type)

    def _view(self, entry: CallEntry) -> ToolCallView:
        return entry_view(entry, self.ctx.step)

    def _background(self, coro: Any) -> None:
        """Ledger bookkeeping: best effort, never in the way of an output."""

        async def guarded() -> None:
            try:
                await coro
            except Exception as e:  # Redis down: the ledger misses a line, the call does not
                log.warning("ledger update failed: %s", e)

        task = asyncio.create_task(guarded())
        _background_tasks.add(task)
        task.add_done_callback(_background_tasks.discard)


_background_tasks: set[asyncio.Task] = set()


async def flush_background() -> None:
    """Wait for pending ledger bookkeeping (before the ledger's connection closes)."""
    while _background_tasks:
        await asyncio.gather(*list(_background_tasks), return_exceptions=True)
