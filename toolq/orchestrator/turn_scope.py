"""The bookkeeping around one turn's calls, shared by `Session` (toolq's own loop) and
`Fleet.run_calls` (a caller's loop): while the scope is open the turn's results are watched,
`toolq cancel TURN` from any process sets `cancelled`, and `toolq cancel --call TASK` reaches
`on_call_cancel`. Leaving it undoes each, in reverse order, whatever ended the turn."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import TracebackType

from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.transport.results import ResultRouter

log = logging.getLogger("toolq.fleet")

#: How long a cancelled helper task may take to close its connection.
STOP_GRACE = 2.0
#: How often a helper task that goes on is cancelled again.
RECANCEL = 0.05
#: The cancel listener's wait after Redis trouble, doubled each time up to the second.
LISTEN_AGAIN = (0.5, 5.0)


async def stop(task: asyncio.Task) -> None:
    """Cancel a helper task and let it finish (its Redis connection closes before ours does). A
    cancel that lands inside a redis-py command can be swallowed there, and the task goes on to
    its next await (a one-request `toolq run` waited out the whole grace at exit, every other run):
    it is cancelled again until it ends."""
    end = time.monotonic() + STOP_GRACE
    while not task.done() and time.monotonic() < end:
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL)


async def cancel_requested(ledger: Ledger, turn_id: str) -> bool:
    """True once the turn is cancelled from any process; False if Redis trouble stopped the
    listening (the caller listens again)."""
    try:
        await ledger.wait_for_cancel(turn_id)
        return True
    except asyncio.CancelledError:
        raise
    except Exception as e:  # redis-py may turn a cancel during a read into a connection error
        log.warning("cancel listener stopped: %s", e)
        return False


class TurnScope:
    """`async with TurnScope(ledger, router, turn_id, on_call_cancel=...) as scope:` around a
    turn's calls. `cancelled` may be the caller's own event (Ctrl-C sets it too)."""

    def __init__(self, ledger: Ledger, router: ResultRouter, turn_id: str, *,
                 on_call_cancel: Callable[[str], None], cancelled: asyncio.Event | None = None,
                 linger: float = 0.0) -> None:
        self.ledger, self.router, self.turn_id = ledger, router, turn_id
        self.cancelled = cancelled if cancelled is not None else asyncio.Event()
        self._on_call_cancel, self._linger = on_call_cancel, linger
        self._listener: asyncio.Task | None = None
        self._stop_hearing_calls: Callable[[], None] | None = None

    async def __aenter__(self) -> TurnScope:
        await self.router.watch_turn(self.turn_id)  # first: a call sent later cannot be missed
        self._listener = asyncio.create_task(self._listen())
        self._stop_hearing_calls = self.ledger.on_call_cancel(self.turn_id, self._on_call_cancel)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self._stop_hearing_calls is not None:
            self._stop_hearing_calls()
        if self._listener is not None:
            await stop(self._listener)
        await self.router.unwatch_turn(self.turn_id, linger=self._linger)

    async def _listen(self) -> None:
        """Hear `toolq cancel` from any process; the durable record covers a cancel sent earlier."""
        delay, most = LISTEN_AGAIN
        while not await cancel_requested(self.ledger, self.turn_id):  # Redis trouble: listen again
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)
        self.cancelled.set()
