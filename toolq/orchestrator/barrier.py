"""The barrier: every call of a model response gets exactly one output, in call order.

A `Step` is one model response's calls. The stream layer binds each call the moment its item is
done (contract 2, `binding.bind_item`) and adds the `BoundCall` here; the step queues it (parallel
tools at once, a serial tool only when the calls before it are done, holding later ones back:
Codex's read/write lock, contract 9) and tracks it to an outcome through a `Transport`. `wait()`
returns when every call has an output; it never waits forever: per-call deadlines, a watchdog for
lost workers and a check after a queue restart each synthesize an output that says what happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from toolq.orchestrator.binding import BoundCall
from toolq.orchestrator.call_items import call_view
from toolq.orchestrator.calls import ToolInvocation, ToolResult, aborted_text, output_item, task_id_for
from toolq.orchestrator.errors import Fatal
from toolq.orchestrator.limits import Limits
from toolq.orchestrator.protocol.items import OutputItem
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.states import CallState, codex_status
from toolq.orchestrator.transport import CallRecords, CallWatch, DispatchError, TaskOutcome, Transport
from toolq.orchestrator.truncate import bound_output
from toolq.orchestrator.turn_events import (
    Emit,
    ItemCompleted,
    ItemStarted,
    ItemUpdated,
    ToolCallView,
    TurnEvent,
    ignore,
)
from toolq.workers.catalog import ToolSpec
from toolq.workers.contracts import TIME_LIMIT_MARGIN
from toolq.workers.streaming import STREAM_BYTES

log = logging.getLogger("toolq.barrier")

#: How often a waiting call is checked for a lost worker or a passed deadline.
WATCHDOG_INTERVAL = 1.0
#: Unanswered pings before a started call's worker is declared lost.
LOST_AFTER_MISSES = 2
#: After Redis trouble, how long an unanswered worker is not yet counted lost (above the fleet
#: catalog's record TTL, so a restarted-empty Redis has every live worker's heartbeat again).
FAULT_SETTLE = 10.0
#: After the queue comes back, how long a call with no trace may take to show up before it is lost.
RECONNECT_GRACE = 2.0
#: The live view and `--json` show this much of a call's output.
VIEW_OUTPUT_CHARS = 2000
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

    def output(self) -> OutputItem:
        assert self.result is not None
        # Workers bound their outputs already (then this changes nothing); what the orchestrator made,
        # or an older worker sent, is bounded here.
        body = bound_output(self.result.output)
        return output_item(self.call.kind, self.call_id, body, tools=self.result.tools)


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
        cap = self.limits.max_parallel_calls
        # A turn's steps run one after another, so the step's cap is the turn's (TOOLQ_MAX_PARALLEL_CALLS).
        self._in_flight = asyncio.Semaphore(cap) if cap else None
        self.entries: list[CallEntry] = []
        self.fatal: Fatal | None = None
        self.aborted = False

    # --- adding calls (at response.output_item.done) -------------------------------------------

    def add(self, call: BoundCall) -> CallEntry:
        """Take a bound call; it is answered at once or queued when it may start. Never raises."""
        entry = CallEntry(call)
        self.entries.append(entry)
        if call.fatal is not None:
            # A runtime bug: the turn ends after this step, but the history stays paired.
            self.fatal = self.fatal or call.fatal
        if call.answer is not None:
            self._settle_now(entry, call.answer)
            return entry
        self._pump()
        self.emit(ItemStarted(item=self._view(entry)))
        return entry

    def _settle_now(self, entry: CallEntry, result: ToolResult) -> None:
        """Give a call its output here, with no task, and still list it in the ledger and the view."""
        entry.result, entry.state, entry.finished_at = result, result.status, time.time()
        entry.done.set()
        self.emit(ItemCompleted(item=self._view(entry)))
        if result.status is not CallState.COMPLETED:
            log.info("! %s %s %s: %s", entry.call_id, entry.tool, result.status, result.output_text())
        task_id = task_id_for(self.ctx.turn_id, self.ctx.step, entry.call.output_index, entry.call_id)
        self._background(self.records.record_unqueued(self.ctx.turn_id, self.ctx.step, entry.call.output_index,
                                                      entry.call_id, entry.tool, result.status.value, task_id))

    def _pump(self) -> None:
        """Start what may start now (see `startable`)."""
        if self.aborted:
            return
        for i in startable([(e.state, e.call.serial) for e in self.entries]):
            self._start(self.entries[i])

    def _start(self, entry: CallEntry) -> None:
        entry.state = CallState.QUEUED  # THROTTLED instead if a limit holds it back (_admit_and_run)
        entry.task = asyncio.create_task(self._run(entry), name=f"toolq-call-{entry.call_id}")

    # --- running one call ------------------------------------------------------------------------

    async def _run(self, entry: CallEntry) -> None:
        try:
            result = await self._admit_and_run(entry)
            if not entry.done.is_set():  # a cancel may have answered it meanwhile (`cancel_unsent`)
                entry.result = result
        except asyncio.CancelledError:
            if entry.result is None:  # abort() fills it; anything else is a bug worth seeing
                raise
        except Exception as e:  # never leave a call without an output
            log.exception("tracking %s failed", entry.call_id)
            entry.result = ToolResult(call_id=entry.call_id, output=f"toolq failed to run this call: {e}",
                                      status=CallState.FAILED, success=False)
        finally:
            if entry.result is not None and not entry.done.is_set():
                self._finish(entry)
                self._pump()

    def _finish(self, entry: CallEntry) -> None:
        assert entry.result is not None
        entry.state, entry.finished_at = entry.result.status, time.time()
        entry.done.set()
        self.emit(ItemCompleted(item=self._view(entry)))

    # --- limits: held back as THROTTLED, never failed for it (toolq/orchestrator/limits.py) ---------

    async def _admit_and_run(self, entry: CallEntry) -> ToolResult:
        """The turn's cap first (in call order), then the tool's fleet-wide limits, then the queue."""
        inv, spec = entry.inv, entry.call.spec
        assert inv is not None and spec is not None
        if not await self._turn_slot(entry):
            return self._expired_throttled(entry)
        try:
            if entry.done.is_set():  # cancelled as its wait ended: 3.11's wait_for keeps a result over a cancel
                return entry.result  # type: ignore[return-value]
            admission = await self.limits.admit(inv, spec, inv.deadline, lambda why: self._throttle(entry, why))
            if admission is None:
                return self._expired_throttled(entry)
            try:
                if entry.done.is_set():  # the same, at the permit's or the rate window's wait
                    return entry.result  # type: ignore[return-value]
                if entry.state is CallState.THROTTLED:
                    entry.state = CallState.QUEUED
                    self.emit(ItemUpdated(item=self._view(entry)))
                entry.queued_at = time.time()
                return await self._dispatch_and_track(entry, admission.invocation)
            finally:
                admission.release()
        finally:
            if self._in_flight is not None:
                self._in_flight.release()

    async def _turn_slot(self, entry: CallEntry) -> bool:
        """One of the turn's slots for calls in flight; False: the deadline passed while waiting."""
        if self._in_flight is None:
            return True
        if not self._in_flight.locked():
            await self._in_flight.acquire()  # taken at once, with no suspension: the next call sees it taken
            return True
        self._throttle(entry, f"the turn's cap of {self.limits.max_parallel_calls} calls in flight "
                              "(TOOLQ_MAX_PARALLEL_CALLS)")
        assert entry.inv is not None
        try:
            await asyncio.wait_for(self._in_flight.acquire(), timeout=max(entry.inv.deadline - time.time(), 0.0))
        except TimeoutError:
            return False
        return True

    def _throttle(self, entry: CallEntry, why: str) -> None:
        if entry.done.is_set() or (entry.state is CallState.THROTTLED and entry.throttled_by == why):
            return  # a call answered already (cancelled) is not held back again by a late notice
        entry.state, entry.throttled_by = CallState.THROTTLED, why
        log.info("‖ %s %s throttled: %s", entry.call_id, entry.tool, why)
        self.emit(ItemUpdated(item=self._view(entry)))
        assert entry.inv is not None
        self._background(self.records.mark_throttled(entry.inv, why))

    def _expired_throttled(self, entry: CallEntry) -> ToolResult:
        return self._synthesize(entry, CallState.TIMED_OUT,
                                f"call stopped: the turn's deadline passed after {time.time() - entry.added_at:.1f}s "
                                f"while it waited for {entry.throttled_by or 'a limit'}; it was never sent")

    # --- sending and tracking --------------------------------------------------------------------

    async def _dispatch_and_track(self, entry: CallEntry, inv: ToolInvocation) -> ToolResult:
        spec = entry.call.spec
        assert spec is not None

        def started(w: CallWatch) -> None:
            entry.state, entry.worker, entry.started_at = CallState.RUNNING, w.hostname, w.started_at
            self.emit(ItemUpdated(item=self._view(entry)))

        watch = entry.watch = self.transport.watch(inv.task_id, on_started=started)
        if self.stream_output and spec.streams_output:
            inv = inv.model_copy(update={"stream_output": True})
            watch.on_output = lambda text: self._output(entry, text)
        try:
            try:
                await self.transport.send(inv, spec)
            except DispatchError as e:
                return ToolResult(call_id=inv.call_id, output=e.output or f"{spec.tool_name} was not run: {e}",
                                  status=e.state, success=False)
            return await self._track(entry, watch)
        finally:
            self.transport.forget(inv.task_id)

    def _output(self, entry: CallEntry, text: str) -> None:
        if entry.done.is_set() or len(entry.live_output) >= STREAM_BYTES:
            return
        entry.live_output += text[:STREAM_BYTES - len(entry.live_output)]
        self.emit(ItemUpdated(item=self._view(entry)))

    async def _track(self, entry: CallEntry, watch: CallWatch) -> ToolResult:
        inv, spec = entry.inv, entry.call.spec
        assert inv is not None and spec is not None
        misses = 0
        seen_reconnect = self.transport.reconnected_at
        fault_at = float("-inf")
        while True:
            deadline = inv.deadline
            if watch.started_at is not None:
                deadline = min(deadline, watch.started_at + spec.timeout + 2 * TIME_LIMIT_MARGIN)
            try:
                outcome = await asyncio.wait_for(asyncio.shield(watch.done),
                                                 timeout=max(0.05, min(WATCHDOG_INTERVAL, deadline - time.time())))
                return self._from_outcome(entry, outcome)
            except TimeoutError:
                pass
            now = time.time()
            if now >= deadline:
                return await self._expire(entry, now)
            if watch.hostname is not None:
                # A probe that fails (Redis blinked) is no evidence either way: the call may be running,
                # and for a while after a fault the workers' pings and heartbeats are still coming back.
                alive = await _probe(self.transport.worker_alive(watch.hostname, inv.task_id))
                if alive is None:
                    fault_at = time.monotonic()
                settling = time.monotonic() - max(fault_at, self.transport.reconnected_at) < FAULT_SETTLE
                misses = 0 if alive or alive is None or settling else misses + 1
                if misses >= LOST_AFTER_MISSES:
                    return self._synthesize(
                        entry, CallState.LOST, f"worker {watch.hostname} stopped answering while running this "
                        "call (or was restarted); the call may have partially executed")
            elif entry.queued_at is not None:  # not started: taken by a worker that died before starting it?
                await _probe(self.transport.requeue_if_stranded(inv, spec, entry.queued_at))
            reconnected = self.transport.reconnected_at
            if reconnected != seen_reconnect and time.monotonic() - reconnected > RECONNECT_GRACE:
                vanished = False if watch.done.done() else await _probe(self.transport.vanished(inv.task_id))
                if vanished is not None:  # else asked again on the next tick
                    seen_reconnect = reconnected
                if vanished:  # stopped, in case it runs on unseen: its outcome is unknown, not failed
                    await _probe(self.transport.revoke([inv.task_id]))
                    return self._synthesize(
                        entry, CallState.LOST, "the task queue (Redis) restarted and this call's task was lost; "
                        "toolq stopped it, and it may or may not have run")

    async def _expire(self, entry: CallEntry, now: float) -> ToolResult:
        """Past the call's deadline: stop it, and say whether it was stopped."""
        assert entry.inv is not None
        waited = now - entry.added_at
        try:
            await self.transport.revoke([entry.inv.task_id])
        except Exception as e:  # Redis away: nobody could be told to stop it
            return self._synthesize(entry, CallState.TIMED_OUT,
                                    f"call timed out after {waited:.1f}s; toolq could not stop it ({e}), so it "
                                    "may still be running and its outcome is unknown")
        if entry.started_at is None:
            return self._synthesize(entry, CallState.TIMED_OUT,
                                    f"call stopped: the turn's deadline passed after {waited:.1f}s before any "
                                    "worker reported starting it")
        return self._synthesize(entry, CallState.TIMED_OUT, f"call timed out after {waited:.1f}s and was stopped")

    def _synthesize(self, entry: CallEntry, state: CallState, text: str) -> ToolResult:
        """An outcome the orchestrator decided (no worker reported one): recorded in the ledger."""
        assert entry.inv is not None
        self._background(self.records.set_state(entry.inv.task_id, state.value, finished_at=time.time()))
        log.warning("! %s %s %s: %s", entry.call_id, entry.tool, state, text)
        return ToolResult(call_id=entry.call_id, output=text, status=state, success=False, worker=entry.worker)

    def _from_outcome(self, entry: CallEntry, outcome: TaskOutcome) -> ToolResult:
        if outcome.result is not None:  # the worker recorded its own state in the ledger
            return outcome.result
        if outcome.state is CallState.CANCELLED:  # revoked, e.g. from Flower: the turn goes on
            text = aborted_text(entry.call.shell_like, time.time() - entry.added_at)
        else:
            text = outcome.reason or f"the call ended {outcome.state} without a result"
        return self._synthesize(entry, outcome.state, text)

    # --- the barrier -----------------------------------------------------------------------------

    async def wait(self) -> list[OutputItem]:
        """Every call's output, in call order (not completion order), once all have one."""
        for entry in list(self.entries):
            await entry.done.wait()
        return [e.output() for e in self.entries]

    async def abort(self) -> list[OutputItem]:
        """Cancel: finished calls keep their real outputs; the rest are aborted and revoked."""
        self.aborted = True
        now = time.time()
        unfinished = [e for e in self.entries if not e.done.is_set()]
        # Pending and throttled calls were never sent: nothing to revoke (a permit a throttled call
        # already took goes back as its task is cancelled; one it waits for was never its own).
        revoke = [e.task_id for e in unfinished if e.task_id and e.state not in UNSENT]
        for entry in unfinished:
            entry.result = ToolResult(call_id=entry.call_id,
                                      output=aborted_text(entry.call.shell_like, now - entry.added_at),
                                      status=CallState.CANCELLED, success=False, worker=entry.worker)
            if entry.task is not None:
                entry.task.cancel()
            self._finish(entry)
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
            if entry.task_id != task_id or entry.done.is_set() or entry.state not in UNSENT:
                continue
            entry.result = ToolResult(call_id=entry.call_id,
                                      output=aborted_text(entry.call.shell_like, time.time() - entry.added_at),
                                      status=CallState.CANCELLED, success=False)
            if entry.task is not None:
                entry.task.cancel()
            self._finish(entry)
            self._background(self.records.set_state(task_id, CallState.CANCELLED.value, finished_at=time.time()))
            log.info("⊘ %s %s cancelled before it was sent", entry.call_id, entry.tool)
        self._pump()

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
        r = entry.result
        view = call_view(entry.call.spec, entry.tool, entry.inv, entry.live_output, r,
                         session_command=entry.watch.session_command if entry.watch else None, id=entry.call_id,
                         status=codex_status(entry.state), state=entry.state, step=self.ctx.step, worker=entry.worker)
        if entry.queued_at is not None and entry.started_at is not None:
            view.queue_wait = round(max(entry.started_at - entry.queued_at, 0.0), 4)
        if r is None:
            if entry.state is CallState.THROTTLED:
                view.reason = f"waiting for {entry.throttled_by}"
            if entry.live_output and view.type == "tool_call":  # a streaming tool's output so far
                view.output = entry.live_output[:VIEW_OUTPUT_CHARS]
            return view
        text = r.output_text()
        view.success, view.exit_code, view.output = r.success, r.exit_code, text[:VIEW_OUTPUT_CHARS]
        view.worker = r.worker or entry.worker
        view.run_time = None if r.duration is None else round(r.duration, 4)
        view.round_trip = round((entry.finished_at or time.time()) - entry.added_at, 4)
        if entry.state.failed:
            view.reason = failure_reason(r)
        return view

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


async def _probe(check: Any) -> bool | None:
    """A watchdog question to the fleet; None when it could not be asked (Redis unreachable)."""
    try:
        return bool(await check)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.info("watchdog probe failed: %s", e)
        return None


def failure_reason(result: ToolResult) -> str:
    """Why a call failed, in one line: its exit code, or the first line of its output."""
    if result.exit_code not in (None, 0):
        return f"exit code {result.exit_code}"
    lines = result.output_text().strip().splitlines()
    return lines[0][:200] if lines else str(result.status)


_background_tasks: set[asyncio.Task] = set()


async def flush_background() -> None:
    """Wait for pending ledger bookkeeping (before the ledger's connection closes)."""
    while _background_tasks:
        await asyncio.gather(*list(_background_tasks), return_exceptions=True)
