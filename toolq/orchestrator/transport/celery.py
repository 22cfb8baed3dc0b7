"""The real fleet behind the `Transport` seam: Celery dispatch, Redis results, the ledger."""

from __future__ import annotations

import shlex
from collections.abc import Callable

from toolq.core.calls import ToolInvocation
from toolq.core.catalog import ToolSpec
from toolq.core.session_records import SessionRecord
from toolq.orchestrator.transport import CallWatch
from toolq.orchestrator.transport.dispatch import Dispatcher
from toolq.orchestrator.transport.ledger import Ledger
from toolq.orchestrator.transport.results import ResultRouter
from toolq.orchestrator.transport.stranded import StrandedCalls

#: How stale a fleet catalog read the lost-worker check may use (every running call asks each second).
CATALOG_MAX_AGE = 1.0


class CeleryTransport:
    def __init__(self, dispatcher: Dispatcher, router: ResultRouter, ledger: Ledger) -> None:
        self.dispatcher = dispatcher
        self.router = router
        self.ledger = ledger
        self._instances: dict[str, set[str]] = {}
        """Task id -> the fleet catalog's instances of its worker's name when it was first checked."""
        self.stranded = StrandedCalls(dispatcher, router, ledger)

    @property
    def reconnected_at(self) -> float:
        return self.router.reconnected_at

    def watch(self, task_id: str, on_started: Callable[[CallWatch], None] | None = None) -> CallWatch:
        return self.router.watch(task_id, on_started=on_started)

    def forget(self, task_id: str) -> None:
        self.router.forget(task_id)
        self._instances.pop(task_id, None)
        self.stranded.forget(task_id)

    async def send(self, inv: ToolInvocation, spec: ToolSpec) -> None:
        watch = self.router.watch(inv.task_id)

        def routed(session: SessionRecord) -> None:
            watch.session_command = shlex.join([session.shell, "-c", session.command])
            watch.session = session

        if not await self.dispatcher.dispatch(inv, spec, on_session=routed):
            # Queued before (a restarted orchestrator): it may have finished already.
            await self.router.catch_up([inv.task_id])

    async def revoke(self, task_ids: list[str]) -> None:
        await self.dispatcher.revoke(task_ids)

    async def worker_alive(self, hostname: str, task_id: str | None = None) -> bool:
        """Per process instance, from the fleet catalog's heartbeats first (they come back within a
        beat of a Redis restart, when pings still go unanswered), then a ping or the draining mark."""
        same_name = [w for w in (await self.dispatcher.fleet.snapshot(max_age=CATALOG_MAX_AGE)).workers
                     if w.hostname == hostname]
        live = {w.instance for w in same_name}
        if task_id is not None:
            seen = self._instances.get(task_id)
            if seen is None and live:  # an empty catalog (Redis restarted empty) says nothing yet
                # The instances that were up when the call started (one host's clock: the worker's).
                started = await self.ledger.started_at(task_id)
                self._instances[task_id] = {w.instance for w in same_name
                                            if started is None or w.started_at <= started} or live
            elif seen is not None and live:
                # Restarted under the same name (SIGKILL, then a supervisor): it answers pings,
                # but the instance that ran the call is gone once only newer ones are listed.
                return bool(live & seen)
        if live:
            return True
        return await self.dispatcher.ping(hostname) or await self.ledger.is_draining(hostname)

    async def requeue_if_stranded(self, inv: ToolInvocation, spec: ToolSpec, queued_at: float) -> None:
        await self.stranded.check(inv, spec, queued_at, self.router.watch(inv.task_id))

    async def vanished(self, task_id: str) -> bool:
        if await self.router.has_result(task_id):
            return False
        return task_id not in await self.dispatcher.active_task_ids()
