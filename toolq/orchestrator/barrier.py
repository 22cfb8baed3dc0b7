"""The barrier: every call of a model response gets exactly one output, in call order.

A `Step` is one model response's calls. The turn loop adds each call the moment its item is
done (contract 2); the step binds it, queues it (parallel tools at once, a serial tool only when
the calls before it are done, holding later ones back: Codex's read/write lock, contract 9),
and tracks it to a result. `wait()` returns when every call has an output; it never waits
forever: per-call deadlines, a watchdog for lost workers and a check after a Redis restart each
synthesize an output that says what happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from toolq.orchestrator.calls import (
    PayloadKind,
    ToolInvocation,
    ToolResult,
    ToolSearchPayload,
    aborted_text,
    output_item,
    task_id_for,
)
from toolq.orchestrator.dispatch import DispatchError, Dispatcher
from toolq.orchestrator.errors import Fatal, RespondToModel
from toolq.orchestrator.ledger import Ledger
from toolq.orchestrator.protocol.items import (
    CustomToolCallItem,
    FunctionCallItem,
    LocalShellCallItem,
    OutputItem,
    ResponseItem,
    ToolSearchCallItem,
)
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.results import CallWatch, ResultRouter
from toolq.orchestrator.router import build_tool_call
from toolq.orchestrator.truncate import DEFAULT_POLICY, truncate_text
from toolq.workers.app import TIME_LIMIT_MARGIN
from toolq.workers.catalog import ToolSpec
from toolq.workers.tools.tool_search import search_catalog

log = logging.getLogger("toolq.barrier")

#: How often a waiting call is checked for a lost worker or a passed deadline.
WATCHDOG_INTERVAL = 1.0
#: Unanswered pings before a started call's worker is declared lost.
LOST_AFTER_MISSES = 2
#: After Redis comes back, how long a call with no trace may take to show up before it is lost.
RECONNECT_GRACE = 2.0
#: Outputs are re-truncated with the policy * 1.2, so formatted tool output is not cut twice.
HISTORY_POLICY = DEFAULT_POLICY.scaled(1.2)

Emit = Callable[[dict[str, Any]], None]


def _kind_of(item: ResponseItem) -> PayloadKind:
    if isinstance(item, CustomToolCallItem):
        return "custom"
    if isinstance(item, ToolSearchCallItem):
        return "tool_search"
    return "function"


def _name_of(item: ResponseItem) -> str:
    if isinstance(item, (FunctionCallItem, CustomToolCallItem)):
        return f"{item.namespace}.{item.name}" if item.namespace else item.name
    return "tool_search" if isinstance(item, ToolSearchCallItem) else "local_shell"


def startable(calls: list[tuple[str, bool]]) -> list[int]:
    """Which pending calls may start, given each call's (state, serial) in call order.

    Codex's read/write lock (contract 9): parallel calls start at once; a serial call starts
    only when every call before it is done, and nothing after it starts until it is done."""
    ready: list[int] = []
    for i, (state, serial) in enumerate(calls):
        if state == "done":
            continue
        if serial:
            if state == "pending" and all(s == "done" for s, _ in calls[:i]):
                ready.append(i)
            break
        if state == "pending":
            ready.append(i)
    return ready


@dataclass(eq=False)
class CallEntry:
    output_index: int
    call_id: str
    kind: PayloadKind
    tool: str
    spec: ToolSpec | None = None
    inv: ToolInvocation | None = None
    result: ToolResult | None = None
    state: str = "pending"
    """pending -> queued -> running -> done"""
    added_at: float = field(default_factory=time.time)
    worker: str | None = None
    task: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def serial(self) -> bool:
        return self.spec is not None and not self.spec.parallel

    @property
    def shell_like(self) -> bool:
        return self.spec is not None and self.spec.shell_like

    @property
    def task_id(self) -> str | None:
        return self.inv.task_id if self.inv else None

    def output(self) -> OutputItem:
        assert self.result is not None
        body = self.result.output
        if isinstance(body, str):
            body = truncate_text(body, HISTORY_POLICY)
        return output_item(self.kind, self.call_id, body, tools=self.result.tools)


class Step:
    def __init__(self, ctx: StepContext, registry: Registry, dispatcher: Dispatcher, router: ResultRouter,
                 ledger: Ledger, emit: Emit = lambda e: None) -> None:
        self.ctx = ctx
        self.registry = registry
        self.dispatcher = dispatcher
        self.router = router
        self.ledger = ledger
        self._emit = emit
        self.entries: list[CallEntry] = []
        self.fatal: Fatal | None = None
        self.aborted = False

    # --- adding calls (at response.output_item.done) -------------------------------------------

    def add(self, item: ResponseItem, output_index: int) -> CallEntry | None:
        """Take a committed item; returns its entry if it is a call. Never raises."""
        if isinstance(item, LocalShellCallItem):
            call_id = item.call_id or item.id or ""
            entry = CallEntry(output_index, call_id, "function", "local_shell")
            self.entries.append(entry)
            self._resolve_now(entry, "unsupported call: local_shell", "rejected")
            return entry
        try:
            call = build_tool_call(item)
        except RespondToModel as e:  # a client tool_search with unreadable arguments
            entry = CallEntry(output_index, getattr(item, "call_id", None) or "", _kind_of(item), _name_of(item))
            self.entries.append(entry)
            self._resolve_now(entry, e.message, "rejected")
            return entry
        if call is None:
            return None
        entry = CallEntry(output_index, call.call_id, call.payload.kind, str(call.tool_name))
        self.entries.append(entry)
        try:
            entry.inv = self.registry.bind(call, self.ctx, output_index)
            entry.spec = self.registry.lookup(call.tool_name)
        except RespondToModel as e:
            self._resolve_now(entry, e.message, "rejected")
            return entry
        except Fatal as e:
            # A runtime bug: the turn ends after this step, but the history stays paired.
            self.fatal = self.fatal or e
            log.error("%s (call_id=%s)", e, call.call_id)
            self._resolve_now(entry, "aborted", "rejected")
            return entry
        if isinstance(call.payload, ToolSearchPayload):
            # A lookup over the specs this orchestrator will expose: answered here, with no side
            # effects; a worker would answer from its own catalog, which may load other modules.
            try:
                tools = search_catalog(self.registry.catalog, call.payload)
            except RespondToModel as e:
                self._resolve_now(entry, e.message, "failed")
                return entry
            self._settle_now(entry, ToolResult(call_id=entry.call_id, output="", tools=tools, success=True))
            return entry
        self._pump()
        self.emit({"type": "item.started", "item": self._view(entry)})
        return entry

    def _resolve_now(self, entry: CallEntry, text: str, status: str) -> None:
        """A call answered without a task (bad arguments, unknown tool...): its error is its output."""
        self._settle_now(entry, ToolResult(call_id=entry.call_id, output=text, status=status, success=False))
        log.info("! %s %s %s: %s", entry.call_id, entry.tool, status, text)

    def _settle_now(self, entry: CallEntry, result: ToolResult) -> None:
        """Give a call its output here, with no task, and still list it in the ledger."""
        entry.result = result
        entry.state = "done"
        entry.done.set()
        task_id = task_id_for(self.ctx.turn_id, self.ctx.step, entry.output_index, entry.call_id)
        state = "succeeded" if result.status == "completed" else result.status
        self._background(self.ledger.record_unqueued(self.ctx.turn_id, self.ctx.step, entry.output_index,
                                                     entry.call_id, entry.tool, state, task_id))

    def _pump(self) -> None:
        """Start what may start now (see `startable`)."""
        if self.aborted:
            return
        for i in startable([(e.state, e.serial) for e in self.entries]):
            self._start(self.entries[i])

    def _start(self, entry: CallEntry) -> None:
        entry.state = "queued"
        entry.task = asyncio.create_task(self._run(entry), name=f"toolq-call-{entry.call_id}")

    # --- running one call ------------------------------------------------------------------------

    async def _run(self, entry: CallEntry) -> None:
        assert entry.inv is not None and entry.spec is not None
        try:
            entry.result = await self._dispatch_and_track(entry)
        except asyncio.CancelledError:
            if entry.result is None:  # abort() fills it; anything else is a bug worth seeing
                raise
        except Exception as e:  # never leave a call without an output
            log.exception("tracking %s failed", entry.call_id)
            entry.result = ToolResult(call_id=entry.call_id, output=f"toolq failed to run this call: {e}",
                                      status="failed", success=False)
        finally:
            if entry.result is not None and not entry.done.is_set():
                entry.state = "done"
                entry.done.set()
                self.emit({"type": "item.completed", "item": self._view(entry)})
                self._pump()

    async def _dispatch_and_track(self, entry: CallEntry) -> ToolResult:
        inv, spec = entry.inv, entry.spec
        assert inv is not None and spec is not None

        def started(w: CallWatch) -> None:
            entry.state, entry.worker = "running", w.hostname
            self.emit({"type": "item.updated", "item": self._view(entry)})

        watch = self.router.watch(inv.task_id, on_started=started)
        try:
            try:
                sent = await self.dispatcher.dispatch(inv, spec)
            except DispatchError as e:
                return ToolResult(call_id=inv.call_id, output=f"{spec.tool_name} was not run: {e}",
                                  status="failed", success=False)
            if not sent:  # queued before (a restarted orchestrator): it may have finished already
                await self.router.catch_up([inv.task_id])
            return await self._track(entry, watch)
        finally:
            self.router.forget(inv.task_id)

    async def _track(self, entry: CallEntry, watch: CallWatch) -> ToolResult:
        inv, spec = entry.inv, entry.spec
        assert inv is not None and spec is not None
        misses = 0
        seen_reconnect = self.router.reconnected_at
        while True:
            deadline = inv.deadline
            if watch.started_at is not None:
                deadline = min(deadline, watch.started_at + spec.timeout + 2 * TIME_LIMIT_MARGIN)
            try:
                meta = await asyncio.wait_for(asyncio.shield(watch.done),
                                              timeout=max(0.05, min(WATCHDOG_INTERVAL, deadline - time.time())))
                return self._from_meta(entry, meta)
            except asyncio.TimeoutError:
                pass
            now = time.time()
            if now >= deadline:
                await self.dispatcher.revoke([inv.task_id])
                return await self._synthesize(entry, "timed_out",
                                              f"call timed out after {now - entry.added_at:.1f}s and was stopped")
            if watch.hostname is not None:
                alive = await self.dispatcher.ping(watch.hostname) or await self.ledger.is_draining(watch.hostname)
                misses = 0 if alive else misses + 1
                if misses >= LOST_AFTER_MISSES:
                    return await self._synthesize(
                        entry, "lost", f"worker {watch.hostname} stopped answering while running this call; "
                        "the call may have partially executed")
            if self.router.reconnected_at != seen_reconnect and time.monotonic() - self.router.reconnected_at > RECONNECT_GRACE:
                seen_reconnect = self.router.reconnected_at
                if not watch.done.done() and await self._vanished(inv.task_id):
                    return await self._synthesize(
                        entry, "lost", "the task queue (Redis) restarted and this call's task was lost; "
                        "it may or may not have run")

    async def _vanished(self, task_id: str) -> bool:
        """After a Redis restart: no stored state and no worker holding it means it is gone."""
        if await self.router.meta(task_id) is not None:
            return False
        return task_id not in await self.dispatcher.active_task_ids()

    async def _synthesize(self, entry: CallEntry, status: str, text: str) -> ToolResult:
        assert entry.inv is not None
        self._background(self.ledger.set_state(entry.inv.task_id, status, finished_at=time.time()))
        log.warning("! %s %s %s: %s", entry.call_id, entry.tool, status, text)
        return ToolResult(call_id=entry.call_id, output=text, status=status, success=False, worker=entry.worker,
                          started_at=entry.added_at, finished_at=time.time())

    def _from_meta(self, entry: CallEntry, meta: dict[str, Any]) -> ToolResult:
        status = meta.get("status")
        if status == "SUCCESS":
            return ToolResult.model_validate(meta["result"])
        info = meta.get("result") or {}
        exc, msg = info.get("exc_type", "Error"), info.get("exc_message")
        msg = " ".join(str(m) for m in msg) if isinstance(msg, list) else str(msg or "")
        if status == "REVOKED":  # e.g. from Flower: this call is aborted, the turn goes on
            self._background(self.ledger.set_state(meta.get("task_id", ""), "cancelled", finished_at=time.time()))
            return ToolResult(call_id=entry.call_id, output=aborted_text(entry.shell_like, time.time() - entry.added_at),
                              status="aborted", success=False, worker=entry.worker)
        if exc == "WorkerLostError":
            text = f"the worker process running this call died ({msg}); the call may have partially executed"
            state = "lost"
        elif exc == "TimeLimitExceeded":
            text, state = f"call exceeded its time limit and was killed ({msg})", "timed_out"
        else:
            text, state = f"call failed on the worker: {exc}: {msg}", "failed"
        self._background(self.ledger.set_state(meta.get("task_id", ""), state, finished_at=time.time()))
        return ToolResult(call_id=entry.call_id, output=text, status=state,
                          success=False, worker=entry.worker)

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
        revoke = [e.task_id for e in unfinished if e.task_id and e.state != "pending"]
        for entry in unfinished:
            entry.result = ToolResult(call_id=entry.call_id, output=aborted_text(entry.shell_like, now - entry.added_at),
                                      status="aborted", success=False, worker=entry.worker)
            if entry.task is not None:
                entry.task.cancel()
            entry.state = "done"
            entry.done.set()
            self.emit({"type": "item.completed", "item": self._view(entry)})
        if revoke:
            await self.dispatcher.revoke(revoke)
        for e in unfinished:
            if e.inv is not None:
                self._background(self.ledger.set_state(e.inv.task_id, "cancelled", finished_at=time.time()))
        return [e.output() for e in self.entries]

    # --- helpers ---------------------------------------------------------------------------------

    def emit(self, event: dict[str, Any]) -> None:
        """Tell the live view; a failing view never costs a call its output."""
        try:
            self._emit(event)
        except Exception:
            log.exception("the live view failed on %s", event.get("type"))

    def _view(self, entry: CallEntry) -> dict[str, Any]:
        view: dict[str, Any] = {"id": entry.call_id, "type": "tool_call", "tool": entry.tool, "status": entry.state,
                                "step": self.ctx.step}
        if entry.worker:
            view["worker"] = entry.worker
        if entry.result is not None:
            r = entry.result
            view.update(status=r.status, success=r.success, exit_code=r.exit_code,
                        duration=round(time.time() - entry.added_at, 4), output=r.output_text()[:2000])
            if r.worker:
                view["worker"] = r.worker
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


_background_tasks: set[asyncio.Task] = set()


async def flush_background() -> None:
    """Wait for pending ledger bookkeeping (before the ledger's connection closes)."""
    while _background_tasks:
        await asyncio.gather(*list(_background_tasks), return_exceptions=True)
