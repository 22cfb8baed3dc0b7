"""Tracking a sent call to its outcome, so that no call waits forever.

The worker's result settles a call. When none comes, the watchdog decides what is known and says
so: the call's deadline passed (stopped, or could not be stopped), its worker stopped answering
while running it (it may have partly run), or the queue restarted and lost its task (stopped, and
it may or may not have run). A probe that fails (Redis blinked) is no evidence either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from toolq.core.calls import ToolResult, aborted_text
from toolq.core.contracts import TIME_LIMIT_MARGIN
from toolq.core.honest import interrupted
from toolq.core.states import CallState
from toolq.orchestrator.call_entry import CallEntry
from toolq.orchestrator.transport import CallRecords, CallWatch, TaskOutcome, Transport

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

Background = Callable[[Coroutine[Any, Any, Any]], None]


class Watchdog:
    def __init__(self, transport: Transport, records: CallRecords, background: Background) -> None:
        self.transport, self.records, self._background = transport, records, background

    async def track(self, entry: CallEntry, watch: CallWatch) -> ToolResult:
        """The call's outcome: its worker's, or what the watchdog knows when none comes."""
        inv, spec = entry.inv, entry.spec
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
                return self.from_outcome(entry, outcome)
            except TimeoutError:
                pass
            now = time.time()
            if now >= deadline:
                return await self.expire(entry, now)
            if watch.hostname is not None:
                # A probe that fails (Redis blinked) is no evidence either way: the call may be running,
                # and for a while after a fault the workers' pings and heartbeats are still coming back.
                alive = await _probe(self.transport.worker_alive(watch.hostname, inv.task_id))
                if alive is None:
                    fault_at = time.monotonic()
                settling = time.monotonic() - max(fault_at, self.transport.reconnected_at) < FAULT_SETTLE
                misses = 0 if alive or alive is None or settling else misses + 1
                if misses >= LOST_AFTER_MISSES:
                    return self.synthesize(
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
                    return self.synthesize(
                        entry, CallState.LOST, "the task queue (Redis) restarted and this call's task was lost; "
                        "toolq stopped it, and it may or may not have run")

    async def expire(self, entry: CallEntry, now: float) -> ToolResult:
        """Past the call's deadline: stop it, and say whether it was stopped. A call its worker
        recorded as ended was not stopped: its result was lost on the way back (Redis)."""
        assert entry.inv is not None
        waited = now - entry.added_at
        ended = await _probe_value(self.records.recorded_end(entry.inv.task_id)) if entry.started_at else None
        if ended is not None:
            # The unsigned ledger's worker name is quoted only when it is the one that reported
            # starting the call: whoever reaches Redis could write a sentence there for the model.
            state, worker = ended
            where = f"worker {worker}" if worker == entry.worker else "a worker"
            return self.synthesize(entry, CallState.LOST, interrupted(
                entry.tool, f"it ended {state} on {where}, but its result never reached the orchestrator (lost on "
                "the way back through Redis), so its output is unknown"))
        try:
            await self.transport.revoke([entry.inv.task_id])
        except Exception as e:  # Redis away: nobody could be told to stop it
            return self.synthesize(entry, CallState.TIMED_OUT,
                                   f"call timed out after {waited:.1f}s; toolq could not stop it ({e}), so it "
                                   "may still be running and its outcome is unknown")
        if entry.started_at is None:
            return self.synthesize(entry, CallState.TIMED_OUT,
                                   f"call stopped: the turn's deadline passed after {waited:.1f}s before any "
                                   "worker reported starting it")
        spec = entry.spec
        if spec is not None and entry.inv.deadline < entry.started_at + spec.timeout:
            # The turn's deadline came before the call's own time limit, which the worker enforces
            # itself: only the revoke stops it, and a worker cut from Redis hears it late.
            return self.synthesize(entry, CallState.TIMED_OUT,
                                   f"call timed out after {waited:.1f}s (the turn's deadline) and toolq told its "
                                   "worker to stop it; it may have run on until the worker heard")
        return self.synthesize(entry, CallState.TIMED_OUT, f"call timed out after {waited:.1f}s and was stopped")

    def synthesize(self, entry: CallEntry, state: CallState, text: str) -> ToolResult:
        """An outcome the orchestrator decided (no worker reported one): recorded in the ledger."""
        assert entry.inv is not None
        self._background(self.records.set_state(entry.inv.task_id, state.value, finished_at=time.time()))
        log.warning("! %s %s %s: %s", entry.call_id, entry.tool, state, text)
        return ToolResult(call_id=entry.call_id, output=text, status=state, success=False, worker=entry.worker)

    def from_outcome(self, entry: CallEntry, outcome: TaskOutcome) -> ToolResult:
        if outcome.result is not None:  # the worker recorded its own state in the ledger
            return outcome.result
        if outcome.state is CallState.CANCELLED:  # revoked, e.g. from Flower: the turn goes on
            text = aborted_text(entry.call.shell_like, time.time() - entry.added_at)
        else:
            text = outcome.reason or f"the call ended {outcome.state} without a result"
        return self.synthesize(entry, outcome.state, text)


async def _probe_value(check: Any) -> Any:
    """A watchdog read from the ledger or the fleet; None when it could not be made (Redis unreachable)."""
    try:
        return await check
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.info("watchdog read failed: %s", e)
        return None


async def _probe(check: Any) -> bool | None:
    """A watchdog question to the fleet (a yes or no); None when it could not be asked."""
    answer = await _probe_value(check)
    return None if answer is None else bool(answer)
