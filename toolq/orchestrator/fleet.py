"""`Fleet`: the workers, seen from one process: bind a response's calls, run them, get outputs.

The shape of pydantic-ai's `ExternalToolset` + `DeferredToolRequests` → `DeferredToolResults`:
calls go out as data and outputs come back as data, so any agent loop (the official `openai`
SDK, toolq's own `Session`) hands a response's output items to `run_calls` and appends what it
returns to the next request's `input`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from toolq.core.calls import ToolName
from toolq.core.catalog import Catalog
from toolq.core.environments import EnvironmentRecord, GitSource
from toolq.core.errors import ConfigurationError, Fatal
from toolq.core.items import OutputItem, ResponseItem, ToolSearchOutputItem, decode_item
from toolq.core.settings import Settings, workspace_problem
from toolq.core.signing import required_signer
from toolq.orchestrator.barrier import Step, flush_background
from toolq.orchestrator.binding import BoundCall, bind_item
from toolq.orchestrator.environments import Environment, Environments, Upload, environment_record, pending_source
from toolq.orchestrator.limits import FleetLimits
from toolq.orchestrator.registry import Registry, StepContext
from toolq.orchestrator.transport.celery import CeleryTransport
from toolq.orchestrator.transport.dispatch import Dispatcher
from toolq.orchestrator.transport.ledger import FLEET_DRIVER, Ledger
from toolq.orchestrator.transport.results import ResultRouter
from toolq.orchestrator.turn_events import Emit, ignore
from toolq.orchestrator.turn_scope import TurnScope, stop
from toolq.telemetry import metrics
from toolq.workers.config import longest_timeout
from toolq.workers.loader import load_catalog

log = logging.getLogger("toolq.fleet")

#: What `Fleet.connect(tools=...)` takes: module names, or the modules / `@tool` functions themselves.
ToolSource = str | ModuleType | Callable[..., Any]


def new_turn_id() -> str:
    return "turn-" + uuid.uuid4().hex[:12]


#: How a caller may end a turn (`Fleet.end_turn`).
TURN_ENDS = ("completed", "failed", "cancelled")

#: How long a turn's result pattern outlives a `run_calls` (its next step then subscribes nothing).
WATCH_LINGER = 30.0


class Fleet:
    """A connection to toolq's worker fleet: its tools, its queue, its ledger.

    Open one with `async with Fleet.connect(...) as fleet:`. `tool_specs()` gives the `tools` of a
    Responses request and `run_calls(items)` runs one response's calls under every contract of
    toolq (routing, validation, serial gating, deadlines, lost workers, `toolq cancel TURN_ID`).
    `end_turn(turn_id)` records a turn over (`toolq turns`); `aclose()` ends the turns still open."""

    def __init__(self, settings: Settings, catalog: Catalog, ledger: Ledger, dispatcher: Dispatcher,
                 router: ResultRouter) -> None:
        self.settings = settings
        self.catalog = catalog
        # The registry learns (MCP namespaces, found deferred tools) into its own copy: never into
        # the process-wide CATALOG, which another Fleet in this process would then take as loaded.
        self.registry = Registry(Catalog(list(catalog)))
        self.ledger = ledger
        self.dispatcher = dispatcher
        self.router = router
        self.transport = CeleryTransport(dispatcher, router, ledger)
        self.limits = FleetLimits(ledger.r, max_parallel_calls=settings.max_parallel_calls,
                                  overrides=settings.tool_limits, lease=settings.limit_lease)
        """Fleet-wide max_concurrency and rate limits, and the per-turn cap, for every step of this process."""
        self._check_limit_overrides()
        self.loaded_tools: set[ToolName] = set()
        """Deferred tools a `tool_search` made visible; `tool_specs()` includes them."""
        self.turn_id = new_turn_id()
        """The turn `run_calls` uses when given none: `toolq cancel` it, `toolq status` it. A new
        one begins when `end_turn()` ends it."""
        self._open_turns: set[str] = set()
        """Turns `run_calls` started here and nobody ended: their leases are kept alive (`_touch`),
        and `aclose` ends them."""
        self._toucher: asyncio.Task[None] | None = None
        # --- MCP hook (mcp_tools.py): the MCP servers' namespaces follow the fleet catalog
        from toolq.orchestrator.mcp_tools import FleetMcpTools

        self.mcp_tools = FleetMcpTools(self.registry, dispatcher.fleet)
        # --- end of the MCP hook
        self.environments = Environments(ledger.r, settings, dispatcher.signer, dispatcher.fleet)
        """Workspaces placed on worker hosts (issue 28): uploads, creation, checkpoints, forks."""
        # Prometheus' /metrics for this process when TOOLQ_METRICS_PORT is set (once per process:
        # every Fleet of it records into the same instruments); nothing at all when it is not.
        metrics.serve_orchestrator(settings.metrics_port)

    async def follow_fleet_tools(self) -> int:
        """Make the registry's MCP namespaces what live workers offer now (at a turn's start; `open`
        does it once). Returns how many MCP tools it holds."""
        return await self.mcp_tools.follow()

    def _check_limit_overrides(self) -> None:
        """Say that TOOLQ_TOOL_LIMITS names a plain tool nobody loaded (a typo applies to nothing,
        silently). Namespaced names may be MCP tools that live workers will offer."""
        known = {str(spec.tool_name) for spec in self.catalog}
        for name in sorted(n for n in self.settings.tool_limits if n not in known and "." not in n):
            log.warning("TOOLQ_TOOL_LIMITS names tool %s, which is not loaded here: its limits apply to nothing", name)

    @classmethod
    async def open(cls, settings: Settings, *, catalog: Catalog | None = None, read_fleet_tools: bool = True) -> Fleet:
        """A fleet on `settings.redis_url`; close it with `aclose()`. (`connect` is the block form.)
        `read_fleet_tools=False`: no Redis round trip yet; the MCP tools are read at a turn's start."""
        if not settings.redis_url:
            raise ValueError("a fleet needs a Redis URL (Fleet.connect starts an embedded one when none is given)")
        catalog = catalog if catalog is not None else load_catalog(settings.tools)
        signer = required_signer(settings.signing_key, "an orchestrator with REDIS_URL")
        ledger = Ledger.from_url(settings.redis_target() or settings.redis_url, settings.redis_connections)
        router = ResultRouter(settings.result_target() or settings.redis_url, signer,
                              stream_output=settings.stream_output)
        await router.start()
        fleet = cls(settings, catalog, ledger, Dispatcher(settings, ledger, signer, longest_timeout(catalog)), router)
        if read_fleet_tools:  # MCP hook: the MCP tools live workers offer, in `tool_specs()`
            await fleet.follow_fleet_tools()
        return fleet

    @classmethod
    @asynccontextmanager
    async def connect(cls, redis_url: str | None = None, tools: Iterable[ToolSource] = (),
                      **settings: Any) -> AsyncIterator[Fleet]:
        """Connect to the fleet on `redis_url`; with none (and no `REDIS_URL`), start an embedded
        Redis-protocol server and two workers for the block, as `toolq run` does.

        `tools`: the tool modules both sides load (names, modules or `@tool` functions).
        Other keywords override `toolq.Settings` fields (e.g. `workspace=...`)."""
        base = Settings.load()
        modules = sorted({_module_name(t) for t in tools})
        # Validated like the environment's values: a wrong type is one clear error here.
        base = Settings.model_validate({**base.model_dump(), "tools": modules or base.tools, **settings,
                                        **({"redis_url": redis_url} if redis_url else {})})
        async with AsyncExitStack() as stack:
            embedded = None
            if not base.redis_url:
                from toolq.local.embedded import EmbeddedStack

                # The workers boot while the caller makes its first request (as for `toolq run`).
                embedded = EmbeddedStack(workers=2, concurrency=4, tools=base.tools,
                                         wait_for_workers=bool(base.mcp or base.mcp_config))
                await asyncio.to_thread(embedded.__enter__)
                stack.push_async_callback(asyncio.to_thread, embedded.__exit__, None, None, None)
                base = base.model_copy(update={"redis_url": embedded.url, "signing_key": embedded.signing_key})
            fleet = await cls.open(base)
            stack.push_async_callback(fleet.aclose)
            if embedded is not None:
                fleet.dispatcher.fleet.starting = embedded.starting  # a call waits for them, not the grace
            try:
                yield fleet
            except (asyncio.CancelledError, KeyboardInterrupt):
                await fleet.end_open_turns("cancelled")
                raise
            except Exception as e:  # the caller's loop failed: its open turns say so
                await fleet.end_open_turns("failed", f"{type(e).__name__}: {e}")
                raise

    def environment(self, upload: Path | str | Upload | None = None, git: str | GitSource | None = None,
                    checkpoint: str | None = None) -> Environment:
        """An environment on a worker host, made from a folder (`upload`), a repository (`git`:
        `URL[@REF]`), a checkpoint, or nothing: `env = await fleet.environment(upload="src")`, or
        `async with fleet.environment(...) as env:` (destroyed when the block ends). Its calls run
        there: `run_calls(items, environment=env)`, `Session(runtime, environment=env)`."""
        return Environment(self.environments, pending_source(upload, git, checkpoint))

    def tool_specs(self) -> list[dict[str, Any]]:
        """The `tools` array of a Responses request: every tool but the deferred ones no search found."""
        return self.registry.model_visible_specs(self.loaded_tools)

    def bind(self, item: ResponseItem, ctx: StepContext, output_index: int) -> BoundCall | None:
        return bind_item(item, self.registry, ctx, output_index)

    def step(self, ctx: StepContext, emit: Emit = ignore) -> Step:
        return Step(ctx, self.transport, self.ledger, emit, self.limits, stream_output=self.settings.stream_output)

    async def run_calls(self, items: Iterable[Any], turn_id: str | None = None, *, emit: Emit = ignore,
                        environment: Environment | EnvironmentRecord | None = None,
                        conversation: str | None = None, label: str | None = None) -> list[dict[str, Any]]:
        """Run every call among one response's output items; one output item per call, in call order.

        `items`: the response's `output`, as the openai SDK returns it (objects or `model_dump()`s)
        or toolq's items; messages and reasoning are skipped. The outputs are wire dicts, ready to
        append to the next request's `input`. Successive calls for one `turn_id` never collide,
        and `toolq cancel TURN_ID` from any process gives the unfinished calls aborted outputs.
        Raises `Fatal` (with `.outputs`) after every call has its output if the runtime broke a
        contract (a tool invoked with a payload kind it does not take). `environment`: the calls run
        in it, on its host (`fleet.environment(...)`), instead of in the shared workspace.
        `conversation`: the conversation (a `ConversationLease`'s id, held by the caller) the calls
        belong to: their sessions (exec_command's, a front door's processes) live as long as it.
        `label`: what `toolq turns` shows for the turn where a turn of `Session` shows its prompt
        (set by the first call of the turn; "(Fleet.run_calls)" by default)."""
        turn_id = turn_id or self.turn_id
        env = environment_record(environment)
        # As `Session` refuses it; the calls of an environment never run in the shared workspace.
        if env is None and (problem := workspace_problem(self.settings.workspace, must_exist=False)):
            raise ConfigurationError(problem)
        decoded = [decode_item(_as_wire(i)) for i in items]
        if turn_id not in self._open_turns:
            await self.ledger.start_turn(turn_id, label or "(Fleet.run_calls)", str(self.settings.workspace),
                                         driver=FLEET_DRIVER, lease=self.settings.turn_lease)
            self._open_turns.add(turn_id)
            if self._toucher is None or self._toucher.done():
                self._toucher = asyncio.create_task(self._touch())
        ctx = StepContext(turn_id, await self.ledger.next_step(turn_id), time.time() + self.settings.turn_timeout,
                          str(self.settings.workspace), conversation=conversation,
                          environment=env.ref() if env is not None else None)
        step = self.step(ctx, emit)
        async with TurnScope(self.ledger, self.router, turn_id, on_call_cancel=step.cancel_unsent,
                             linger=WATCH_LINGER) as scope:
            for index, item in enumerate(decoded):
                bound = self.bind(item, ctx, index)
                if bound is not None:
                    step.add(bound)
            waiter = asyncio.create_task(step.wait())
            cancelled = asyncio.create_task(scope.cancelled.wait())
            await asyncio.wait({waiter, cancelled}, return_when=asyncio.FIRST_COMPLETED)
            cancelled.cancel()
            outputs = waiter.result() if waiter.done() else await step.abort()
            waiter.cancel()
        if scope.cancelled.is_set():  # `toolq cancel TURN_ID`: the turn is over, whatever the caller does next
            self._open_turns.discard(turn_id)  # its lease is no longer renewed
            await self.ledger.end_turn(turn_id, "cancelled")
        self.note_outputs(outputs)
        wire = [o.to_wire() for o in outputs]
        if step.fatal is not None:
            step.fatal.outputs = wire  # type: ignore[attr-defined]
            raise step.fatal
        return wire

    def note_outputs(self, outputs: list[OutputItem]) -> None:
        """A tool_search output makes its tools visible from the next request on."""
        for out in outputs:
            if isinstance(out, ToolSearchOutputItem) and out.tools:
                self.loaded_tools |= self.registry.deferred_names(out.tools)

    async def end_turn(self, turn_id: str | None = None, *, status: str = "completed",
                       error: str | None = None) -> None:
        """Record that a turn `run_calls` ran is over (`toolq turns` lists it with `status`:
        completed, failed or cancelled); with no `turn_id`, the default turn (`self.turn_id`), and
        a new default turn begins. A turn cancelled meanwhile stays `cancelled`. `aclose()` ends
        every turn still open; a turn whose process died without either shows `orphaned` once its
        lease (TOOLQ_TURN_LEASE) has lapsed."""
        if status not in TURN_ENDS:
            raise ValueError(f"end_turn: status {status!r} is not one of {', '.join(TURN_ENDS)}")
        turn_id = turn_id or self.turn_id
        if turn_id == self.turn_id:
            self.turn_id = new_turn_id()
        self._open_turns.discard(turn_id)
        if await self.ledger.is_cancelled(turn_id):
            status, error = "cancelled", None
        await self.ledger.end_turn(turn_id, status, error)

    async def _touch(self) -> None:
        """Keep the open turns' leases alive while this fleet is open (a loop may think for
        minutes between two `run_calls`). Redis trouble is logged and retried."""
        while True:
            await asyncio.sleep(self.settings.turn_lease / 3)
            try:
                await self.ledger.touch_turns(sorted(self._open_turns), self.settings.turn_lease)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("could not renew the leases of this fleet's turns: %s", e)

    async def end_open_turns(self, status: str = "completed", error: str | None = None) -> None:
        """End every turn this fleet started and nobody ended (what `aclose` does first)."""
        for turn_id in sorted(self._open_turns):
            try:
                await self.end_turn(turn_id, status=status, error=error)
            except Exception as e:  # Redis away at the very end: the turn shows orphaned once its lease lapses
                log.warning("could not record the end of %s: %s", turn_id, e)

    async def aclose(self) -> None:
        await self.end_open_turns()
        if self._toucher is not None:  # cancelled until it ends: redis-py may swallow one cancel
            await stop(self._toucher)
        await flush_background()
        await self.limits.aclose()
        await self.router.aclose()
        await self.dispatcher.aclose()
        await self.ledger.aclose()


def _as_wire(item: Any) -> Any:
    if isinstance(item, BaseModel):  # an openai SDK object, or one of toolq's items
        return item.model_dump(mode="json", exclude_none=True)
    return item


def _module_name(source: ToolSource) -> str:
    if isinstance(source, str):
        return source
    if isinstance(source, ModuleType):
        return source.__name__
    return source.__module__


__all__ = ["Fatal", "Fleet", "new_turn_id"]
