"""Calls stranded on a dead worker: taken off their queue by a worker that died before it started them.

A worker takes a message before one of its pool processes starts it (prefetch, `acks_late`), and
Redis keeps every taken message in kombu's `unacked` hash until the worker acks it. If the worker
is SIGKILLed in between, Redis gives the message back only after the visibility timeout, which
must stay above the longest tool's time limit: longer than a turn. The call would wait for its
turn's deadline and be answered `timed_out` although it never ran anywhere.

So a call that has been queued for `STRANDED_AFTER` seconds without starting is looked for in that
hash. Found there, every live worker of the fleet catalog is asked whether it holds it
(`query_task`); when all have answered and none does, its message goes back to the head of its
queue and a live worker runs it. Wrong guesses are safe: a restored message whose call did start
somewhere meets the worker's started marker (`toolq.workers.execute`) and never runs twice.
"""

from __future__ import annotations

import asyncio
import logging
import time

from toolq.orchestrator.dispatch import Dispatcher
from toolq.orchestrator.ledger import Ledger
from toolq.orchestrator.results import ResultRouter

log = logging.getLogger("toolq.stranded")

#: A call queued this long without starting is looked for among the taken messages. A message a
#: live worker takes is started within milliseconds (prefetch 1 with `acks_late`: a worker takes
#: only what its idle pool processes can start), so a longer wait means a queue or a dead taker.
STRANDED_AFTER = 3.0
#: At most one look per this many seconds per runtime, shared by all its waiting calls.
SWEEP_INTERVAL = 2.0
#: How long the live workers are given to say what they hold.
ASK_TIMEOUT = 1.0


class StrandedCalls:
    """Finds and requeues the waiting calls of one runtime that a dead worker had taken."""

    def __init__(self, dispatcher: Dispatcher, router: ResultRouter, ledger: Ledger, *,
                 after: float = STRANDED_AFTER, interval: float = SWEEP_INTERVAL) -> None:
        self.dispatcher, self.router, self.ledger = dispatcher, router, ledger
        self.after, self.interval = after, interval
        self._waiting: dict[str, float] = {}
        """Task id -> when it was queued (`time.time()`), for the calls not started yet."""
        self._swept_at = float("-inf")
        self._sweep: asyncio.Future | None = None

    async def check(self, task_id: str, queued_at: float) -> None:
        """Called while a sent call waits to start; a sweep, when one is due, covers every such call."""
        self._waiting[task_id] = queued_at
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
        """Requeue the due calls that sit taken by no live worker; the task ids requeued."""
        now = time.time()
        due = {t for t, queued in self._waiting.items() if now - queued >= self.after}
        taken = {t: tag for t, tag in (await self.dispatcher.taken()).items() if t in due}
        if not taken:  # still on their queues (a busy fleet), or started
            return []
        hostnames = {w.hostname for w in (await self.dispatcher.fleet.snapshot(max_age=0)).workers}
        if not hostnames:  # an empty catalog (Redis restarted empty) cannot name the live workers yet
            return []
        held = await self.dispatcher.held(sorted(taken), hostnames, timeout=ASK_TIMEOUT)
        if held is None:  # a worker did not answer: it may be the one holding them, busy
            return []
        stranded = [t for t in taken if t not in held and t in self._waiting
                    and await self.ledger.started_at(t) is None and not await self.router.has_result(t)]
        if stranded:
            await self.dispatcher.restore([taken[t] for t in stranded])
            for t in stranded:
                log.warning("↻ %s was taken by a worker that died before starting it; put back on its queue", t)
        return stranded
