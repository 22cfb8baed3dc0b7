"""`toolq cancel`: stop a turn (or one call) from any process or host.

The durable record goes first: a worker checks it before it starts any call of the turn, so
a call still in the queue, or sent while no worker is online, never runs (a revoke broadcast
alone is lost when nobody hears it: docs/reference/celery-notes.md#revoking-a-queued-task).
Then every task of the turn is revoked with SIGTERM, which kills the tool's whole process group,
and the orchestrator running the turn hears the cancel on its channel and records the aborted
outputs. A turn of `Fleet.run_calls`, which no toolq loop drives, is recorded `cancelled` here.

With no REDIS_URL, the turn is looked for in this user's running embedded stacks (runtime_dir.py).
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass

from toolq.cli.ledgers import ledgers
from toolq.core.settings import Settings
from toolq.core.states import TERMINAL
from toolq.orchestrator.transport.dispatch import Dispatcher
from toolq.orchestrator.transport.ledger import FLEET_DRIVER, Ledger


@dataclass
class CancelReport:
    turn_id: str
    revoked: list[str]
    call_id: str | None = None


class UnknownTarget(LookupError):
    pass


async def cancel(settings: Settings, turn_id: str, call_id: str | None = None) -> CancelReport:
    """Cancel on the Redis that knows the turn: REDIS_URL, else the embedded stack running it.
    ConfigurationError when there is nothing to ask; UnknownTarget when nobody knows the turn."""
    async with aclosing(ledgers(settings.redis_target())) as each:
        async for url, ledger in each:
            calls = await ledger.calls(turn_id)
            if calls or await ledger.turn(turn_id):
                return await _cancel(settings.model_copy(update={"redis_url": url}), ledger, turn_id, calls, call_id)
    raise UnknownTarget(f"no turn {turn_id} in the ledger" if settings.redis_url
                        else f"no turn {turn_id} in your running embedded `toolq run`s")


async def _cancel(settings: Settings, ledger: Ledger, turn_id: str, calls: list[dict[str, str]],
                  call_id: str | None) -> CancelReport:
    dispatcher = Dispatcher(settings, ledger)
    try:
        if call_id is None:
            await ledger.cancel_turn(turn_id)
            if (await ledger.turn(turn_id)).get("driver") == FLEET_DRIVER:
                # No toolq loop drives it to record its end (the caller's own loop, via `Fleet.run_calls`)
                await ledger.end_turn(turn_id, "cancelled")
            targets = [c["task_id"] for c in calls if c.get("task_id") and c.get("state") not in TERMINAL]
        else:
            targets = [c["task_id"] for c in calls if c.get("call_id") == call_id and c.get("task_id")]
            if not targets:
                raise UnknownTarget(f"no call {call_id} in turn {turn_id} (a call pending behind a serial one "
                                    f"is listed once it may start; `toolq cancel {turn_id}` stops the whole turn)")
            for task_id in targets:
                await ledger.cancel_call(turn_id, task_id)
        await dispatcher.revoke(targets, terminate=True)
        return CancelReport(turn_id, targets, call_id)
    finally:
        await dispatcher.aclose()
