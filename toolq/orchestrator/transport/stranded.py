"""Calls stranded on a dead worker: taken off their queue by a worker that died before it started them.

A worker takes a message before one of its pool processes starts it (prefetch, `acks_late`), and
kombu keeps every taken message in Redis's `unacked` hash until the worker acks it. If the worker
is SIGKILLed in between, Redis gives the message back only after the visibility timeout, which
must stay above the longest tool's time limit: longer than a turn. Killed in the instant between
taking the message and recording it there, the message is gone for good. Either way the call
waited for its turn's deadline and was answered `timed_out`, although it never ran anywhere.

So a call queued for `STRANDED_AFTER` seconds without starting is looked for among the taken
messages, and every live worker of the fleet catalog is asked whether it holds it (`query_task`).
When all have answered and none does, a taken message goes back to the head of its queue; a call
sent before a worker died that is neither taken nor on its queue is sent again. A live worker
runs it. Wrong guesses are safe: a message whose call did start somewhere meets the worker's
started marker (`toolq.workers.execute`) and never runs twice.

A write_stdin waits on the queue of the one instance that holds its session; once that instance
has been missing from the catalog for `GONE_AFTER` seconds, the write is answered as one routed
to a lost session is (the session died with its worker), not left to the turn's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from toolq.core.calls import ToolInvocation
from toolq.core.catalog import ToolSpec
from toolq.core.honest import not_run
from toolq.core.session_records import lost_session
from toolq.core.states import CallState
from toolq.orchestrator.transport import CallWatch, TaskOutcome
from toolq.orchestrator.transport.dispatch import Dispatcher, call_queue
from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.transport.results import ResultRouter

log = logging.getLogger("toolq.stranded")

#: A call queued this long without starting is looked for among the taken messages. A message a
#: live worker takes is started within milliseconds (prefetch 1 with `acks_late`: a worker takes
#: only what its idle pool processes can start), so a longer wait means a queue or a dead taker.
STRANDED_AFTER = 3.0
#: At most one look per this many seconds per runtime, shared by all its waiting calls.
SWEEP_INTERVAL = 2.0
#: How long the live workers are given to say what they hold.
ASK_TIMEOUT = 1.0
#: A session's worker instance missing from the catalog this long is dead: its record expired
#: (no heartbeat for the record's TTL), and a live worker re-advertises within a heartbeat of a
#: Redis restarted empty, well inside this.
GONE_AFTER = 5.0


@dataclass(frozen=True)
class Waiting:
    inv: ToolInvocation
    spec: ToolSpec
    queued_at: float
    """`time.time()` when it was sent."""
    watch: CallWatch

    @property
    def unstarted(self) -> bool:
        return self.watch.started_at is None and not self.watch.done.done()


class StrandedCalls:
    """Finds the waiting calls of one runtime that a dead worker had taken, and queues them again."""

    def __init__(self, dispatcher: Dispatcher, router: ResultRouter, ledger: Ledger, *,
                 after: float = STRANDED_AFTER, interval: float = SWEEP_INTERVAL) -> None:
        self.dispatcher, self.router, self.ledger = dispatcher, router, ledger
        self.after, self.interval = after, interval
        self._waiting: dict[str, Waiting] = {}
        """Task id -> a sent call that has not started yet."""
        self._swept_at = float("-inf")
        self._sweep: asyncio.Future | None = None
        self._missing_since: dict[str, float] = {}
        """Session-holding instance -> when a sweep first found it missing from the catalog."""
        self._host_missing_since: dict[str, float] = {}
        """Environment host with calls waiting -> when a sweep first found no live worker on it."""

    async def check(self, inv: ToolInvocation, spec: ToolSpec, queued_at: float, watch: CallWatch) -> None:
        """Called while a sent call waits to start; a sweep, when one is due, covers every such call."""
        self._waiting[inv.task_id] = Waiting(inv, spec, queued_at, watch)
        if time.time() - queued_at < self.after or time.monotonic() - self._swept_at < self.interval:
            return
        if self._sweep is None:
            self._swept_at = time.monotonic()
            self._sweep = asyncio.ensure_future(self._requeue())
            self._sweep.add_done_callback(lambda _: setattr(self, "_sweep", None))
        await asyncio.shield(self._sweep)

    def forget(self, task_id: str) -> None:
        self._waiting.pop(task_id, None)

    async def _requeue(self) -> list[str]:
        """Queue again the due calls that no live worker holds; the task ids queued again."""
        now, fleet = time.time(), self.dispatcher.fleet
        snapshot = await fleet.snapshot(max_age=self.interval)  # a read is also how a death is noticed
        # Only calls not started since: a running one is the lost-worker watchdog's.
        due = {t: w for t, w in self._waiting.items() if now - w.queued_at >= self.after and w.unstarted}
        self._end_orphaned_writes(due, {w.instance for w in snapshot.workers})
        await self._end_unhosted(due, {w.env_host for w in snapshot.workers})
        # writes: only their session's worker; a call of an environment whose host is gone: answered
        due = {t: w for t, w in due.items() if w.watch.session is None and not w.watch.done.done()}
        taken = {t: tag for t, tag in (await self.dispatcher.taken()).items() if t in due}
        # Sent before a worker died, and not taken: on its queue still, or lost with that worker.
        missing = {t for t, w in due.items() if t not in taken and w.queued_at < fleet.departed_at}
        if missing:
            missing -= await self.dispatcher.queued(missing, {call_queue(due[t].inv, due[t].spec) for t in missing})
        if not taken and not missing:  # on their queues (a busy fleet), or started
            return []
        hostnames = {w.hostname for w in snapshot.workers}
        if not hostnames:  # an empty catalog (Redis restarted empty) cannot name the live workers yet
            return []
        # Asked after the reads: a live worker that took one of them since holds it, or has started it.
        held = await self.dispatcher.held(sorted({*taken, *missing}), hostnames, timeout=ASK_TIMEOUT)
        if held is None:  # a worker did not answer: it may be the one holding them, busy
            return []
        stranded = [t for t in [*taken, *missing] if t not in held and t in self._waiting
                    and await self.ledger.started_at(t) is None and not await self.router.has_result(t)]
        restore = [taken[t] for t in stranded if t in taken]
        if restore:
            await self.dispatcher.restore(restore)
        for t in stranded:
            if t not in taken:
                await self.dispatcher.resend(due[t].inv, due[t].spec)
            log.warning("↻ %s was taken by a worker that died before starting it; %s", t,
                        "put back on its queue" if t in taken else "its message was lost with it: sent again")
        return stranded

    async def _end_unhosted(self, due: dict[str, Waiting], live_hosts: set[str | None]) -> None:
        """A call of an environment waits on its host's queue, which only that host's workers
        consume: once no worker of the host has lived for `GONE_AFTER` seconds, the host is gone
        (and its environment with it). A message still on the queue is taken off it, so it can
        never run, and the call is answered as not run; one a dead worker took is put back on the
        queue first (above), and taken off at a later sweep."""
        now = time.monotonic()
        waiting = {w.inv.environment.host for w in due.values() if w.inv.environment is not None}
        self._host_missing_since = {h: self._host_missing_since.get(h, now) for h in waiting - live_hosts}
        for task_id, w in due.items():
            env = w.inv.environment
            if env is None or now - self._host_missing_since.get(env.host, now) < GONE_AFTER:
                continue
            if await self.dispatcher.unqueue(task_id, call_queue(w.inv, w.spec)):
                log.warning("✗ %s: host %s of environment %s is gone; taken off its queue", task_id, env.host, env.id)
                w.watch.finish(TaskOutcome(state=CallState.REJECTED, reason=not_run(
                    w.spec.tool_name, f"the worker host `{env.host}` of this conversation's environment is gone "
                    "(it is recreated from its last checkpoint at the next turn)")))

    def _end_orphaned_writes(self, due: dict[str, Waiting], live: set[str]) -> None:
        """A write_stdin waits on the queue of the one worker instance that holds its session: if
        that instance is gone, so is the session, and nothing will ever take the write."""
        now = time.monotonic()  # an empty catalog counts too: no worker left, or one re-advertises soon
        holders = {w.watch.session.instance for w in due.values() if w.watch.session is not None}
        self._missing_since = {i: self._missing_since.get(i, now) for i in holders - live}
        for w in due.values():
            session = w.watch.session
            if session is None or session.instance not in self._missing_since:
                continue
            if now - self._missing_since[session.instance] >= GONE_AFTER:
                log.warning("✗ %s: the worker holding session %s is gone", w.inv.task_id, session.session_id)
                w.watch.finish(TaskOutcome(state=CallState.FAILED, reason=lost_session(session)))
