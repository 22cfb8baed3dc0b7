"""The real fleet behind the `Transport` seam: Celery dispatch, Redis results, the ledger."""

from __future__ import annotations

from typing import Callable

from toolq.orchestrator.calls import ToolInvocation
from toolq.orchestrator.dispatch import Dispatcher
from toolq.orchestrator.ledger import Ledger
from toolq.orchestrator.results import ResultRouter
from toolq.orchestrator.transport import CallWatch
from toolq.workers.catalog import ToolSpec


class CeleryTransport:
    def __init__(self, dispatcher: Dispatcher, router: ResultRouter, ledger: Ledger) -> None:
        self.dispatcher = dispatcher
        self.router = router
        self.ledger = ledger

    @property
    def reconnected_at(self) -> float:
        return self.router.reconnected_at

    def watch(self, task_id: str, on_started: Callable[[CallWatch], None] | None = None) -> CallWatch:
        return self.router.watch(task_id, on_started=on_started)

    def forget(self, task_id: str) -> None:
        self.router.forget(task_id)

    async def send(self, inv: ToolInvocation, spec: ToolSpec) -> None:
        if not await self.dispatcher.dispatch(inv, spec):
            # Queued before (a restarted orchestrator): it may have finished already.
            await self.router.catch_up([inv.task_id])

    async def revoke(self, task_ids: list[str]) -> None:
        await self.dispatcher.revoke(task_ids)

    async def worker_alive(self, hostname: str) -> bool:
        return await self.dispatcher.ping(hostname) or await self.ledger.is_draining(hostname)

    async def vanished(self, task_id: str) -> bool:
        if await self.router.has_result(task_id):
            return False
        return task_id not in await self.dispatcher.active_task_ids()
