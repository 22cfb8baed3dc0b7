"""The turn loop: request -> stream -> dispatch -> barrier -> next request, as Codex runs it
(docs/reference/codex-behaviour.md#the-turn-loop).

A response with calls is followed by another request once every call has its output (the
barrier); a response without calls ends the turn. A retryable model error drains what was
dispatched, records the outputs and retries with that history, as Codex does. A cancel (from
`toolq cancel` in any process, or Ctrl-C) stops the stream at once, aborts unfinished calls
(keeping finished ones), records `<turn_aborted>` and leaves the history paired.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from toolq.core import keys
from toolq.core.calls import ToolName
from toolq.core.catalog import Catalog
from toolq.core.environments import EnvironmentRecord, EnvRef, EnvSource, GitSource, TurnDiff
from toolq.core.errors import ConfigurationError
from toolq.core.items import (
    CustomToolCallOutputItem,
    FunctionCallOutputItem,
    InputText,
    MessageItem,
    ReasoningItem,
    ResponseItem,
    ToolSearchOutputItem,
    decode_item,
    is_api_item,
)
from toolq.core.reasoning import reasoning_for
from toolq.core.session_records import conversation_key
from toolq.core.settings import Settings, absolute_workspace, workspace_problem
from toolq.orchestrator import spans
from toolq.orchestrator.barrier import Step
from toolq.orchestrator.environments import (
    Environment,
    EnvironmentRefused,
    environment_record,
    lost_note,
    pending_source,
    source_of,
)
from toolq.orchestrator.fleet import Fleet, ToolSource, new_turn_id
from toolq.orchestrator.history import History
from toolq.orchestrator.model_client import ModelClient, ModelError, ModelSettings, backoff, build_request
from toolq.orchestrator.protocol.events import Usage
from toolq.orchestrator.registry import StepContext
from toolq.orchestrator.transport.conversation import ConversationLease, new_conversation_id
from toolq.orchestrator.transport.durable import (
    Committed,
    StoreBudget,
    TurnSettings,
    TurnStore,
    item_cost,
    unanswered,
    wire_cost,
)
from toolq.orchestrator.transport.redis_faults import REDIS_FAULTS, RedisUnreachable
from toolq.orchestrator.turn_events import (
    AgentMessageView,
    Emit,
    ErrorEvent,
    ItemCompleted,
    ReasoningView,
    TurnAborted,
    TurnCompleted,
    TurnError,
    TurnFailed,
    TurnStarted,
    ignore,
)
from toolq.orchestrator.turn_scope import TurnScope, stop
from toolq.telemetry import metrics, tracing

log = logging.getLogger("toolq.turn")

# Codex's record a cancelled turn leaves for the next one (docs/reference/codex-behaviour.md#cancel).
TURN_ABORTED = (
    "<turn_aborted>\nThe user interrupted the previous turn on purpose. Any running unified exec processes may "
    "still be running in the background. If any tools/commands were aborted, they may have partially executed.\n"
    "</turn_aborted>"
)

class CannotResume(ConfigurationError):
    """`toolq resume` was asked for a turn it may not take over (one line, exit 2)."""


@dataclass
class TurnOutcome:
    turn_id: str
    status: Literal["running", "completed", "failed", "cancelled"]
    """running until the turn ends"""
    final_message: str | None = None
    error: str | None = None
    usage: Usage = field(default_factory=Usage)
    requests: int = 0
    could_not_start: bool = False
    """Nothing ran (Redis unreachable at the start); the command line exits 2 (`exits.py`)."""
    model_unreachable: bool = False
    """The model's endpoint never answered this turn (every connection failed): the command line
    exits 2, as for any start that could not happen (a wrong OPENAI_BASE_URL)."""
    environment: str | None = None
    """The environment the turn's calls ran in (issue 28), or None: the shared workspace."""
    diff: TurnDiff | None = None
    """What the turn changed in its environment: the checkpoint taken at its end and its diff
    (None without an environment, or when the checkpoint could not be taken)."""


class DeadlinePassed(Exception):
    """The turn's deadline passed while it waited for the model."""


class Runtime:
    """The orchestrator's long-lived parts, shared by every turn of a process: a fleet, a model,
    and the durable store of turns. Build one with `Runtime.create(settings)`, or for a block with
    `async with Runtime.connect()` (which starts an embedded stack when no REDIS_URL is set)."""

    def __init__(self, fleet: Fleet, client: ModelClient) -> None:
        self.fleet = fleet
        self.settings = fleet.settings
        self.client = client
        self.turns = TurnStore(fleet.ledger.r, fleet.settings.turn_lease)

    @classmethod
    async def create(cls, settings: Settings, *, catalog: Catalog | None = None,
                     model: ModelSettings | None = None) -> Runtime:
        # Each turn reads the fleet's MCP tools at its start, and says so in one line if Redis is down.
        fleet = await Fleet.open(settings, catalog=catalog, read_fleet_tools=False)
        return cls(fleet, ModelClient(model or ModelSettings.from_settings(settings)))

    @classmethod
    @asynccontextmanager
    async def connect(cls, redis_url: str | None = None, tools: Iterable[ToolSource] = (),
                      **settings: Any) -> AsyncIterator[Runtime]:
        """`Fleet.connect` with a model: the same arguments, the model from the settings."""
        async with Fleet.connect(redis_url, tools, **settings) as fleet:
            runtime = cls(fleet, ModelClient(ModelSettings.from_settings(fleet.settings)))
            try:
                yield runtime
            finally:
                await runtime.client.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.fleet.aclose()


class Session:
    """The whole agent loop (what `toolq run` uses): request, stream, calls on the fleet, next
    request, until the model answers without calls. The history carries over from turn to turn,
    cancelled ones included.

        runtime = await Runtime.create(Settings.load())
        outcome = await Session(runtime).run_turn("fix the tests", emit=print)
    """

    def __init__(self, runtime: Runtime, *, instructions: str | None = None,
                 reasoning: dict[str, Any] | None = None, workspace: str | Path | None = None,
                 environment: Environment | EnvironmentRecord | None = None, upload: str | Path | None = None,
                 git: str | GitSource | None = None, from_checkpoint: str | None = None) -> None:
        self.rt = runtime
        self.fleet = runtime.fleet
        where = absolute_workspace(workspace) if workspace else runtime.settings.workspace
        in_environment = any(x is not None for x in (environment, upload, git, from_checkpoint))
        # A missing workspace: each call says so. The calls of an environment never run in it.
        if not in_environment and (problem := workspace_problem(where, must_exist=False)):
            raise ConfigurationError(problem)
        self.workspace = str(where)
        """Where its tools work; many sessions on one runtime may each have their own (`toolq batch`)."""
        self.instructions = instructions
        # None: from TOOLQ_REASONING_EFFORT and the model (on by default for reasoning models)
        self.reasoning = reasoning if reasoning is not None else reasoning_for(
            runtime.client.settings.model, runtime.settings.reasoning_effort)
        self.history = History()
        self.loaded_tools: set[ToolName] = set()
        self.unknown_items = 0
        self.turn_id: str | None = None
        """The running (or last) turn's id."""
        self._cancel = asyncio.Event()
        self._scope: TurnScope | None = None
        """The running turn's watch and cancel listeners (turn_scope.py), open from its start to its end."""
        self._step: Step | None = None
        self._lease: str | None = None
        """The token of this session's lease on the running turn (durable.py)."""
        self._superseded = False
        """Another orchestrator took the turn over: this session writes nothing more to it."""
        self._model_answered = False
        """The running turn's model endpoint sent something (else a connect failure is a start that failed)."""
        self._store = StoreBudget(runtime.settings.turn_store_mb)
        """What the running turn has made toolq keep in Redis, bounded by TOOLQ_TURN_STORE_MB."""
        self.conversation = ConversationLease(runtime.fleet.ledger.r, new_conversation_id())
        """Its exec_command sessions live while it is held: from the first turn to `close()`."""
        self._turn_span: Any = None
        self._in_flight = False
        """This turn counts in toolq_turns_in_flight and its span is open (`_close_telemetry`)."""
        """The running turn's root span (spans.py) when tracing is on."""
        # --- environments (issue 28): the calls run in an environment on one worker host
        self._handle = environment if isinstance(environment, Environment) else None
        self.environment: EnvironmentRecord | None = environment_record(environment)
        """The environment its calls run in (its record, whose host may change when one dies)."""
        self._env_to_make: EnvSource | Path | None = None
        """A source given to the Session itself: made at the first turn, owned by the conversation."""
        self._owns_environment = False
        """Its environment is the conversation's own (made here): destroyed at `close()`."""
        if upload is not None or git is not None or from_checkpoint is not None:
            if environment is not None:
                raise ConfigurationError("Session: give an environment, or a source to make one from, not both")
            self._env_to_make = pending_source(upload, git, from_checkpoint)
            self._owns_environment = True

    async def close(self) -> None:
        """End the conversation: every exec_command session it started is killed, and the
        environment it made for itself (`upload=`, `git=`, `from_checkpoint=`) is destroyed."""
        try:
            if self._owns_environment and self.environment is not None:
                await self.fleet.environments.destroy(self.environment.id)
        except Exception as e:  # its host's reaper destroys it once the conversation's key is gone
            log.warning("could not destroy environment %s: %s", self.environment.id if self.environment else "", e)
        finally:
            await self.conversation.release()

    def cancel(self) -> None:
        """Cancel the running turn from this process (Ctrl-C). Other processes use the ledger."""
        self._cancel.set()

    async def run_turn(self, prompt: str, emit: Emit = ignore, *, turn_id: str | None = None) -> TurnOutcome:
        """Run one turn to its end; `emit` hears every transition (typed `toolq.orchestrator.turn_events`)."""
        turn_id = self.turn_id = turn_id or new_turn_id()
        settings = self.rt.settings
        outcome = TurnOutcome(turn_id=turn_id, status="running")
        self._cancel.clear()
        self._store = StoreBudget(settings.turn_store_mb)
        self.history.record(MessageItem(role="user", content=[InputText(text=prompt)]))
        # The turn's item list starts with the whole conversation so far (for `toolq resume`).
        self._store.add(sum(wire_cost(obj, history=True) for obj in self.history.to_json()))
        deadline = time.time() + settings.turn_timeout
        tracing.setup(tracing.ORCHESTRATOR)  # once per process; off unless OTEL_* turn it on
        self._turn_span = spans.start_turn(turn_id, self.conversation.id)
        metrics.turn_started()
        self._in_flight = True
        try:
            return await self._start(turn_id, prompt, outcome, emit, deadline)
        finally:  # whatever escaped (a bug, a cancelled task): the span ended, the gauge down, once
            self._close_telemetry(outcome)

    async def _start(self, turn_id: str, prompt: str, outcome: TurnOutcome, emit: Emit,
                     deadline: float) -> TurnOutcome:
        settings = self.rt.settings
        try:
            await self.fleet.follow_fleet_tools()  # MCP hook: this turn offers the MCP tools live workers host now
            await self.fleet.ledger.start_turn(turn_id, prompt, self.workspace)
            await self._hold_conversation(turn_id)
            await self._keep_environment(durable=False)
            self._lease = await self.rt.turns.take_lease(turn_id)
            await self.rt.turns.save_settings(turn_id, self._turn_settings(deadline))
            if not self._store.full:  # else the loop stops the turn first, having written none of it
                await self._durable([Committed(item=obj) for obj in self.history.to_json()])
            await self._open_scope(turn_id)
        except REDIS_FAULTS as e:  # nothing ran: one line naming the server, and a turn.failed
            outcome.status, outcome.error = "failed", str(RedisUnreachable(settings.redis_url, e))
            outcome.could_not_start = True
            return await self._end(turn_id, outcome, emit)
        except EnvironmentRefused as e:  # no environment to run in: nothing ran, one line, exit 2
            outcome.status, outcome.error, outcome.could_not_start = "failed", str(e), True
            return await self._end(turn_id, outcome, emit)
        # Started once its records are in Redis: a turn that could not start names no turn id a
        # user would look for (`toolq status` knows none), only its one-line error and turn.failed.
        emit(TurnStarted(turn_id=turn_id, trace_id=spans.trace_id(self._turn_span)))
        return await self._drive(turn_id, outcome, emit, self._loop(turn_id, outcome, emit, deadline))

    async def resume(self, turn_id: str, emit: Emit = ignore) -> TurnOutcome:
        """Go on with a turn whose orchestrator died (`toolq resume`): its history is rebuilt from
        Redis; a finished call's stored result is used (never a second run), a running one is
        awaited, a queued one runs once; then the loop goes on to the end. Raises `CannotResume`."""
        record, saved, committed = await self.rt.turns.load(turn_id)
        if not record:
            raise CannotResume(f"no turn {turn_id} in the ledger")
        if saved is None:
            raise CannotResume(f"turn {turn_id} was not recorded durably (started by an older toolq, or via Fleet)")
        if record.get("state") != "running":
            raise CannotResume(f"turn {turn_id} is {record.get('state')}, not orphaned: nothing to resume")
        self._lease = await self.rt.turns.take_lease(turn_id)
        if self._lease is None:
            raise CannotResume(f"turn {turn_id} is driven by another orchestrator (its lease is live); "
                               f"`toolq cancel {turn_id}` stops it")
        self.turn_id = turn_id
        self.instructions, self.reasoning = saved.instructions, saved.reasoning
        # The ledger is unsigned: whoever reaches Redis could have written the saved workspace.
        if problem := workspace_problem(Path(saved.workspace), must_exist=False):
            raise CannotResume(f"turn {turn_id} cannot be resumed: {problem}")
        self.workspace = saved.workspace
        self.loaded_tools = set(saved.loaded_tools)
        self.history = History(c.item for c in committed)
        # This turn's own items (those with a step) cost what they did; the conversation it started
        # from, only the copy in the item list.
        self._store = StoreBudget(self.rt.settings.turn_store_mb,
                                  sum(wire_cost(c.item, history=c.step is None) for c in committed))
        outcome = TurnOutcome(turn_id=turn_id, status="running")
        self._cancel.clear()
        tracing.setup(tracing.ORCHESTRATOR)
        self._turn_span = spans.start_turn(turn_id, self.conversation.id, resumed=True)
        metrics.turn_started()
        self._in_flight = True
        try:
            emit(TurnStarted(turn_id=turn_id, trace_id=spans.trace_id(self._turn_span)))
            await self.fleet.follow_fleet_tools()  # MCP hook: the resumed turn offers what live workers host now
            await self._hold_conversation(turn_id)  # a new conversation: the dead one's sessions died with its lease
            if saved.environment:
                await self._take_up_environment(turn_id, saved.environment)
            await self._open_scope(turn_id)
            pending = unanswered(committed)
            first_step = 1 + max((c.step for c in committed if c.step is not None), default=-1)
            return await self._drive(turn_id, outcome, emit,
                                     self._loop(turn_id, outcome, emit, saved.deadline, first_step, pending))
        finally:
            self._close_telemetry(outcome)

    def _turn_settings(self, deadline: float) -> TurnSettings:
        s = self.rt.settings
        return TurnSettings(model=self.rt.client.settings.model, workspace=self.workspace, tools=list(s.tools),
                            instructions=self.instructions, reasoning=self.reasoning, deadline=deadline,
                            loaded_tools=sorted(self.loaded_tools, key=str),
                            environment=self.environment.id if self.environment is not None else None)

    async def _open_scope(self, turn_id: str) -> None:
        scope = TurnScope(self.fleet.ledger, self.fleet.router, turn_id, on_call_cancel=self._call_cancelled,
                          cancelled=self._cancel)
        await scope.__aenter__()  # left in `_drive`, whatever ends the turn
        self._scope = scope

    async def _drive(self, turn_id: str, outcome: TurnOutcome, emit: Emit, loop: Any) -> TurnOutcome:
        """Run the loop under the lease, hear cancels, and end with exactly one terminal event."""
        self._model_answered = False
        heartbeat = asyncio.create_task(self.rt.turns.heartbeat(turn_id, self._lease)) if self._lease else None
        inner = asyncio.create_task(loop)
        cancelled = asyncio.create_task(self._cancel.wait())
        started = time.monotonic()
        self._superseded = False
        try:
            await asyncio.wait({inner, cancelled, *([heartbeat] if heartbeat else [])},
                               return_when=asyncio.FIRST_COMPLETED)
            if inner.done():
                inner.result()
            elif heartbeat is not None and heartbeat.done():
                await self._hand_over(turn_id, inner, outcome)
            else:
                await self._abort(turn_id, inner, outcome, emit, started)
        except ModelError as e:
            outcome.status, outcome.error = "failed", e.message
            outcome.model_unreachable = e.unreachable and not self._model_answered
        except EnvironmentRefused as e:  # its host died and no other could take the environment up
            if self._step is not None:
                await self._commit(*await self._kept_outputs(await self._step.abort()))
            outcome.status, outcome.error = "failed", str(e)
        except Exception as e:  # a bug: still one terminal event, a paired history, the calls stopped
            log.exception("the turn loop of %s failed", turn_id)
            if self._step is not None:
                await self._commit(*await self._kept_outputs(await self._step.abort()))
            outcome.status, outcome.error = "failed", f"toolq failed: {type(e).__name__}: {e}"
        finally:
            cancelled.cancel()
            if self._scope is not None:
                scope, self._scope = self._scope, None
                await scope.__aexit__(None, None, None)
        if not self._superseded:
            await self._checkpoint(outcome, emit)
        outcome = await self._end(turn_id, outcome, emit)
        if heartbeat is not None:
            await stop(heartbeat)
        await self._release(turn_id)
        return outcome

    async def _release(self, turn_id: str) -> None:
        if self._lease is None:
            return
        try:
            await self.rt.turns.release(turn_id, self._lease)
        except Exception as e:  # it lapses by itself
            log.warning("could not release the lease on %s: %s", turn_id, e)
        self._lease = None

    async def _commit(self, *items: Any, step: int | None = None, output_index: int | None = None) -> None:
        """Into the history, and into Redis as it happens (so `toolq resume` can rebuild the turn)."""
        added = self.history.record(*items)  # each item's wire JSON, made once
        await self._durable([Committed(item=obj, step=step, output_index=output_index) for obj in added])

    async def _durable(self, entries: list[Committed]) -> None:
        if self.turn_id is None or not entries or self._superseded:
            return
        try:
            await self.rt.turns.append(self.turn_id, entries)
        except Exception as e:  # Redis away: the turn goes on; a resume would miss these items
            log.warning("could not record %d item(s) of %s durably: %s", len(entries), self.turn_id, e)

    async def _end(self, turn_id: str, outcome: TurnOutcome, emit: Emit) -> TurnOutcome:
        """Exactly one terminal event, then the ledger's record of the end."""
        trace_id = spans.trace_id(self._turn_span)
        self._close_telemetry(outcome)  # before the emits: a caller's `emit` that raises leaks nothing
        if outcome.status == "failed":
            emit(ErrorEvent(message=outcome.error or ""))
            emit(TurnFailed(turn_id=turn_id, error=TurnError(message=outcome.error or ""), trace_id=trace_id))
        elif outcome.status == "completed":
            diff = outcome.diff
            emit(TurnCompleted(turn_id=turn_id, usage=outcome.usage.model_dump(), environment=outcome.environment,
                               checkpoint=diff.checkpoint if diff is not None else None, diff=diff,
                               trace_id=trace_id))
        # Not recorded when the Redis to record it in is away, or when the turn's new orchestrator will.
        if not (outcome.could_not_start or self._superseded):
            await self._finish(turn_id, outcome)
        return outcome

    def _close_telemetry(self, outcome: TurnOutcome) -> None:
        """The turn's span ended and the turns-in-flight gauge down, once, whatever ended the turn
        (`_end`, or an exception that escaped before it: then the turn counts as failed)."""
        if not self._in_flight:
            return
        self._in_flight = False
        span, self._turn_span = self._turn_span, None
        status = "failed" if outcome.status == "running" else outcome.status
        spans.end_turn(span, status, outcome.usage, outcome.requests)
        metrics.turn_ended(status)

    async def _keep_environment(self, *, durable: bool = True) -> None:
        """Make the Session's own environment at its first turn; recreate the environment from its
        last checkpoint on another host when its host is gone (the model is told what was lost)."""
        envs = self.fleet.environments
        if self.environment is None and self._env_to_make is not None:
            source = self._env_to_make
            if isinstance(source, Path):
                source = (await envs.upload(source)).source
            self.environment = await envs.create(source, owner=conversation_key(self.conversation.id))
            return
        env = self.environment
        if env is None or await envs.host_alive(env.host):
            return
        old_host = env.host
        log.warning("host %s of environment %s is gone: recreating it from %s", old_host, env.id,
                    env.checkpoint or "its source")
        env = self.environment = await envs.recreate(env)
        if self._handle is not None:
            self._handle.record = env
        note = MessageItem(role="developer", content=[InputText(text=lost_note(env, old_host))])
        if durable:
            await self._commit(note)
        else:  # a turn's start: the whole history goes to Redis next
            self.history.record(note)

    async def _take_up_environment(self, turn_id: str, env_id: str) -> None:
        """A resumed turn ran in an environment, which died with its owner (the dead orchestrator's
        conversation): a new one, this conversation's own, from its last checkpoint."""
        envs = self.fleet.environments
        try:
            old = await envs.record(env_id)
            if old is None:
                raise EnvironmentRefused(f"its environment {env_id} has no record left")
            source = source_of(checkpoint=old.checkpoint) if old.checkpoint else old.source
            self.environment = await envs.create(source, owner=conversation_key(self.conversation.id))
        except EnvironmentRefused as e:
            await self._release(turn_id)
            await self.conversation.release()
            raise CannotResume(f"turn {turn_id} cannot be resumed: {e}") from None
        self._owns_environment = True
        await self._commit(MessageItem(role="developer", content=[InputText(text=lost_note(
            self.environment, old.host, cause=f"The orchestrator driving this turn stopped, and environment {env_id} "
                                              f"on {old.host} ended with it."))]))

    def _env_ref(self) -> EnvRef | None:
        return self.environment.ref() if self.environment is not None else None

    async def _checkpoint(self, outcome: TurnOutcome, emit: Emit) -> None:
        """At each turn's end: the environment's changes as a checkpoint, and the turn's diff."""
        env = self.environment
        if env is None or outcome.could_not_start:
            return
        outcome.environment = env.id
        try:
            outcome.diff = await self.fleet.environments.checkpoint(env)
        except Exception as e:  # the turn's outcome stands; the next turn starts from the last checkpoint
            log.warning("no checkpoint of environment %s: %s", env.id, e)
            emit(ErrorEvent(message=f"no checkpoint of environment {env.id} was taken: {e}"))

    async def _hold_conversation(self, turn_id: str) -> None:
        try:
            await self.conversation.hold()
            await self.fleet.ledger.r.hset(keys.turn(turn_id), "conversation", self.conversation.id)
        except Exception as e:  # Redis away: the turn's own calls will say so
            log.warning("could not hold conversation %s: %s", self.conversation.id, e)

    async def _finish(self, turn_id: str, outcome: TurnOutcome) -> None:
        try:
            await self.fleet.ledger.finish_turn(turn_id, outcome.status, outcome.error)
        except Exception as e:  # Redis gone at the very end: the outcome still stands
            log.warning("could not record the end of %s: %s", turn_id, e)

    async def _hand_over(self, turn_id: str, inner: asyncio.Task, outcome: TurnOutcome) -> None:
        """Another orchestrator holds the lease (this one stalled past it, and `toolq resume` took
        the turn): stop driving without touching the calls, which the new driver awaits."""
        self._superseded = True
        await _stop_loop(inner)
        if self._step is not None:
            self._step.detach()
        outcome.status = "failed"
        outcome.error = (f"another orchestrator took over turn {turn_id} after this one's lease lapsed; "
                         "it drives the turn now, and this process stopped")

    async def _abort(self, turn_id: str, inner: asyncio.Task, outcome: TurnOutcome, emit: Emit,
                     started: float) -> None:
        await _stop_loop(inner)
        if self._step is not None:
            await self._commit(*await self._kept_outputs(await self._step.abort()))
        await self._commit(MessageItem(role="user", content=[InputText(text=TURN_ABORTED)]))
        outcome.status = "cancelled"
        outcome.error = f"turn cancelled after {time.monotonic() - started:.1f}s"
        emit(TurnAborted(turn_id=turn_id, reason="interrupted", trace_id=spans.trace_id(self._turn_span)))

    def _call_cancelled(self, task_id: str) -> None:
        """`toolq cancel --call`: a call this process still holds (throttled, or waiting for its
        turn in call order) is answered now; a sent one is stopped by its worker."""
        if self._step is not None:
            self._step.cancel_unsent(task_id)

    async def _loop(self, turn_id: str, outcome: TurnOutcome, emit: Emit, deadline: float, step_index: int = 0,
                    pending: Sequence[tuple[int, list[Committed]]] = ()) -> None:
        settings = self.rt.settings
        retries = 0
        responses_with_calls = 0
        # step_index: one per model request, retries included, so task ids never collide
        for step_no, calls in pending:  # a resumed turn: the calls that had no output yet, first
            step = self._step = self.fleet.step(StepContext(turn_id, step_no, deadline, self.workspace,
                                                         conversation=self.conversation.id,
                                                         environment=self._env_ref()), emit)
            step.trace_parent = self._turn_span
            for c in calls:
                bound = self.fleet.bind(decode_item(c.item), step.ctx, c.output_index or 0)
                if bound is not None:
                    step.add(bound)
            outputs = await step.wait()
            await self._commit(*await self._kept_outputs(outputs))
            self._load_found_tools(outputs)
        while True:
            if self._store.full:  # the conversation it starts from, or the outputs just kept, fill it
                outcome.status, outcome.error = "failed", self._store.error
                return
            if time.time() >= deadline:  # no request that could only queue calls already expired
                outcome.status = "failed"
                outcome.error = ("turn stopped: it ran past its deadline "
                                 f"(TOOLQ_TURN_TIMEOUT={settings.turn_timeout:g}s)")
                return
            if responses_with_calls >= settings.max_steps:
                outcome.status = "failed"
                outcome.error = f"turn stopped after {settings.max_steps} model responses with tool calls"
                return
            await self._keep_environment()  # its host died mid-turn: the next request says so
            step = self._step = self.fleet.step(StepContext(turn_id, step_index, deadline, self.workspace,
                                                        conversation=self.conversation.id,
                                                        environment=self._env_ref()), emit)
            step.trace_parent = self._turn_span
            step_index += 1
            body = build_request(self.rt.client.settings.model, self.history.for_prompt(),
                                 self.fleet.registry.model_visible_specs(self.loaded_tools),
                                 instructions=self.instructions, reasoning=self.reasoning)
            outcome.requests += 1
            error, expired = await self._sample_by(deadline, body, step, outcome, emit)
            # The barrier, whatever happened to the stream: calls already queued get their outputs.
            outputs = await step.wait()
            await self._commit(*await self._kept_outputs(outputs))
            self._load_found_tools(outputs)
            if step.fatal is not None:
                outcome.status, outcome.error = "failed", str(step.fatal)
                return
            if self._store.full:  # an item refused at the bound, or outputs that did not fit
                outcome.status, outcome.error = "failed", self._store.error
                return
            if expired:  # the loop's first check says the deadline passed
                continue
            if error is not None:
                max_retries = self.rt.client.settings.stream_max_retries
                if not error.retryable or retries >= max_retries:
                    metrics.model_request("failed")
                    raise error
                metrics.model_request("retried")
                retries += 1
                emit(ErrorEvent(message=f"Reconnecting... {retries}/{max_retries} ({error.message})"))
                delay = error.delay if error.delay is not None else backoff(retries)
                await asyncio.sleep(min(delay, max(0.0, deadline - time.time())))  # never past the deadline
                continue
            retries = 0
            if not step.entries:
                outcome.status = "completed"
                return
            responses_with_calls += 1

    async def _sample_by(self, deadline: float, body: dict[str, Any], step: Step, outcome: TurnOutcome,
                         emit: Emit) -> tuple[ModelError | None, bool]:
        """One response streamed, the turn's deadline bounding the stream too: (the model's error,
        whether the deadline stopped it)."""
        try:
            await self._sample(body, step, outcome, emit, deadline)
        except ModelError as e:  # counted where the loop decides whether it is retried
            return e, False
        except DeadlinePassed:
            metrics.model_request("cancelled")
            return None, True
        except asyncio.CancelledError:
            metrics.model_request("cancelled")
            raise
        metrics.model_request("completed")
        return None, False

    async def _sample(self, body: dict[str, Any], step: Step, outcome: TurnOutcome, emit: Emit,
                      deadline: float) -> None:
        span = spans.start_chat(self._turn_span, self.rt.client.settings.model, body)
        if span is None:
            return await self._stream(body, step, outcome, emit, deadline, None)
        record = spans.ChatRecord()
        try:
            await self._stream(body, step, outcome, emit, deadline, record)
        except BaseException as e:
            spans.end_chat(span, record, e)
            raise
        spans.end_chat(span, record)

    async def _stream(self, body: dict[str, Any], step: Step, outcome: TurnOutcome, emit: Emit,
                      deadline: float, record: spans.ChatRecord | None) -> None:
        index = 0
        async with aclosing(self.rt.client.stream(body)) as events:  # a stop at the store bound closes it now
            while True:
                # The deadline bounds the wait for the model, never toolq's own bookkeeping: a call
                # committed to the history is always bound and queued, so it always gets an output.
                limit = asyncio.timeout(max(0.0, deadline - time.time()))
                try:
                    async with limit:
                        event = await anext(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if limit.expired():
                        raise DeadlinePassed from None
                    raise
                self._model_answered = True
                if record is not None:
                    record.event(event)
                if event.kind == "item_done":
                    item: ResponseItem = event.item
                    # toolq's own count, not the server's output_index, names the call's task: a server
                    # that repeats an index and a call_id gave its calls one task id, and each answered
                    # with one command's output (found by a red-team helper).
                    output_index = index
                    index += 1
                    if not is_api_item(item):
                        self.unknown_items += 1
                        log.info("kept aside an item of unknown type %r", getattr(item, "type", None))
                        continue
                    call_id = getattr(item, "call_id", None)
                    call_id = call_id if isinstance(call_id, str) else None
                    cost = (item_cost(event.size, event.escaped, item.type, call_id)
                            if event.size else wire_cost(item.to_wire()))
                    if not self._store.take(cost):  # not recorded, not queued: the turn stops after the barrier
                        raise ModelError(self._store.error, retryable=False)
                    # the call is in history (and in Redis) before it is queued
                    await self._commit(item, step=step.ctx.step, output_index=output_index)
                    self._show(item, outcome, emit)
                    bound = self.fleet.bind(item, step.ctx, output_index)
                    if bound is not None:
                        step.add(bound)
                elif event.kind == "completed" and event.usage is not None:
                    outcome.usage = outcome.usage + event.usage

    async def _kept_outputs(self, outputs: list[Any]) -> list[Any]:
        """The barrier's outputs as the turn keeps them: each counted against TOOLQ_TURN_STORE_MB,
        and one that does not fit kept as a line saying so (its call still has exactly one output,
        which claims nothing about what the call did) and its worker's result deleted; the turn
        then stops before the next request."""
        entries = self._step.entries if self._step is not None else []
        task_ids = [e.call.invocation.task_id if e.call.invocation is not None else None for e in entries]
        if len(task_ids) != len(outputs):  # not this step's outputs, one per entry: no result to name
            task_ids = [None] * len(outputs)
        kept, dropped = [], []
        for out, task_id in zip(outputs, task_ids, strict=True):
            cost = wire_cost(out.to_wire()) if hasattr(out, "to_wire") else 0
            if self._store.take(cost):
                kept.append(out)
                continue
            if not isinstance(out, (FunctionCallOutputItem, CustomToolCallOutputItem)):  # toolq's own, small
                self._store.add(cost)
                kept.append(out)
                continue
            stub = out.model_copy(update={"output": (
                f"[toolq kept no output for this call: its {cost} bytes would have taken this turn past "
                f"TOOLQ_TURN_STORE_MB ({self._store.bound_mb} MiB), what one turn may keep in Redis]")})
            self._store.add(wire_cost(stub.to_wire()))
            kept.append(stub)
            if task_id is not None:
                dropped.append(keys.celery_meta(task_id))
        if dropped:  # the worker's copy of an output the turn does not keep goes too
            try:
                await self.fleet.router.r.delete(*dropped)
            except Exception as e:  # it expires by itself (the workers' result_expires)
                log.warning("could not delete %d result(s) of %s: %s", len(dropped), self.turn_id, e)
        return kept

    def _show(self, item: ResponseItem, outcome: TurnOutcome, emit: Emit) -> None:
        if isinstance(item, MessageItem) and item.role == "assistant":
            outcome.final_message = item.text()
            emit(ItemCompleted(item=AgentMessageView(id=item.id, text=item.text())))
        elif isinstance(item, ReasoningItem) and item.summary:
            text = "\n".join(s.get("text", "") for s in item.summary)
            emit(ItemCompleted(item=ReasoningView(id=item.id, text=text)))

    def _load_found_tools(self, outputs: list[Any]) -> None:
        for out in outputs:
            if isinstance(out, ToolSearchOutputItem) and out.tools:
                self.loaded_tools |= self.fleet.registry.deferred_names(out.tools)


async def _stop_loop(inner: asyncio.Task) -> None:
    """Cancel the turn loop and let it unwind (its stream closes; a model error on the way is moot)."""
    inner.cancel()
    try:
        await inner
    except (asyncio.CancelledError, ModelError):
        pass
