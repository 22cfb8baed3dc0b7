"""Queue invocations on the Celery fleet: the orchestrator's only door into Celery.

A call's task message is built here (task_message.py, Celery's own format) and pushed onto its
queue by the ledger's claim script, so claiming, queueing and marking it sent are one round trip
from the event loop. The task id is derived from the call, so a restarted orchestrator finds the
same task, and the claim makes a second dispatch a no-op. The control commands (revoke, ping,
inspect) are Celery's and synchronous, so they run on a dedicated thread pool: the event loop
never blocks on Celery.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from toolq.core import keys
from toolq.core.advert import tool_queue
from toolq.core.calls import ToolInvocation
from toolq.core.catalog import ToolSpec
from toolq.core.contracts import TIME_LIMIT_MARGIN, task_name
from toolq.core.environments import host_queue
from toolq.core.flower_args import flower_args as shown_args
from toolq.core.session_records import SessionRecord, instance_queue
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.core.states import CallState
from toolq.orchestrator.transport import DispatchError, session_route
from toolq.orchestrator.transport.catalog_reader import FleetCatalog
from toolq.orchestrator.transport.ledger import CONNECT_TIMEOUT, SOCKET_TIMEOUT, Ledger, Sent
from toolq.orchestrator.transport.task_message import (
    UNACKED_KEY,
    TaskMessage,
    anon_nodename,
    message_task_id,
    queue_key,
    task_id_of,
)

if TYPE_CHECKING:
    from celery import Celery


class BrokerUnavailable(ConnectionError):
    """kombu's OperationalError (the broker is away) as a builtin, so that the rest of the
    orchestrator catches it without importing kombu."""


#: What the broker raises when Redis is away, once it has passed through `Dispatcher._run`.
BROKER_ERRORS = (BrokerUnavailable,)

_MAKING_APP = threading.Lock()

log = logging.getLogger("toolq.dispatch")

__all__ = ["DispatchError", "Dispatcher", "call_queue"]

#: Control broadcasts (revoke, ping, inspect) at once. Each holds a broker-pool connection while
#: it takes a producer, which takes another from the same pool (`broker_pool_limit`, 10): ten at
#: once wait on each other forever in kombu's pool. After a Redis restart every call of a wide step
#: asks the fleet, so they are bounded well below half the pool.
CONTROL_CONCURRENCY = 4

def call_queue(inv: ToolInvocation, spec: ToolSpec) -> str:
    """The queue a call goes to: its declaration's, or that declaration's queue on the host of the
    environment it runs in (only that host's workers consume it). A `write_stdin` goes to its
    session's worker instead (`_route`)."""
    if inv.environment is not None:
        return host_queue(inv.environment.host, tool_queue(spec))
    return tool_queue(spec)


def flower_args(inv: ToolInvocation, spec: ToolSpec, trace_url: str | None = None) -> str:
    """The task message's args as Flower shows them (`core.flower_args`, the worker's rules)."""
    trace = inv.trace.model_dump() if inv.trace is not None else None
    return shown_args({"call_id": inv.call_id, "turn_id": inv.turn_id, "payload": inv.payload.model_dump(mode="json"),
                       "trace": trace}, spec, trace_url)


def _env_host(inv: ToolInvocation) -> str | None:
    return inv.environment.host if inv.environment is not None else None


class Dispatcher:
    def __init__(self, settings: Settings, ledger: Ledger, signer: Signer | None = None,
                 longest_timeout: float = 60.0) -> None:
        self._settings, self._longest_timeout = settings, longest_timeout
        self._app: Celery | None = None
        self.ledger = ledger
        self.signer = signer
        """Signs each invocation (toolq/core/signing.py); None: this dispatcher only revokes."""
        self.fleet = FleetCatalog(ledger.r)  # fleet catalog hook: who serves which declaration
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="toolq-dispatch")
        self._control = asyncio.Semaphore(CONTROL_CONCURRENCY)  # waiting here holds no pool thread
        self._asking: asyncio.Future | None = None
        """The `active_task_ids` question out now, if any."""
        self._origin, self._reply_to = anon_nodename(), str(uuid.uuid4())
        """Who sends the task messages, as Celery names a client (task_message.py)."""

    @property
    def app(self) -> Celery:
        """The sending app, made (and Celery imported) at the first call: a turn whose model asks
        for no tool never loads Celery, and `toolq run` starts 0.1 s sooner."""
        with _MAKING_APP:  # Celery's lazy package fails when two threads import it at once
            if self._app is None:
                from toolq.workers.config import make_app

                app = make_app(self._settings, self._longest_timeout)
                # This process's broker connections (sends, revokes, pings) give up on a Redis that
                # stops answering, as the ledger's do, instead of holding a call's deadline up forever.
                app.conf.broker_transport_options = {**app.conf.broker_transport_options,
                                                     "socket_timeout": SOCKET_TIMEOUT,
                                                     "socket_connect_timeout": CONNECT_TIMEOUT,
                                                     "socket_keepalive": True}
                self._app = app
        return self._app

    async def _run(self, fn, *args, **kwargs):
        """`fn` on the dispatch threads (pass a lambda that reads `self.app` there: the first one
        imports Celery, which must not block the event loop)."""

        def call():
            from kombu.exceptions import OperationalError  # loaded with Celery by then

            try:
                return fn(*args, **kwargs)
            except OperationalError as e:
                raise BrokerUnavailable(str(e)) from e

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def _broadcast(self, fn, *args, **kwargs):
        """A control broadcast, never more than CONTROL_CONCURRENCY at once (see there)."""
        async with self._control:
            return await self._run(fn, *args, **kwargs)

    async def dispatch(self, inv: ToolInvocation, spec: ToolSpec,
                       on_session: Callable[[SessionRecord], None] | None = None) -> bool:
        """Queue the call; False if it had been queued before (it is not sent again). `on_session`
        hears the record of a session-routed call's session once it is routed (the view shows its command)."""
        try:
            if spec.route != "session" and await self.fleet.serves(spec, _env_host(inv)):
                # The common case, in one round trip: claimed, queued and marked sent at once.
                sent = await self._claim_and_send(inv, spec, call_queue(inv, spec))
                if sent is Sent.CLAIMED_BEFORE:
                    log.warning("↻ %s was claimed but never sent (its orchestrator died); sent it now", inv.call_id)
            elif await self.ledger.claim(inv, spec.queue) or await self._claimed_unsent(inv):
                # Claimed first: the call is listed (queued) while it waits for its route.
                sent = await self._claim_and_send(inv, spec, await self._route(inv, spec, on_session))
            else:
                sent = Sent.BEFORE
        except (RedisError, OSError) as e:
            raise DispatchError(f"the task queue (Redis) is unavailable: {e}") from e
        if sent is Sent.BEFORE:
            log.info("↺ %s already dispatched as %s; not sent again", inv.call_id, inv.task_id)
            return False
        return True

    async def _claimed_unsent(self, inv: ToolInvocation) -> bool:
        """A resumed turn's call that its dead orchestrator claimed and never sent: it is sent now.
        (Sent by an orchestrator of before the one-script send, killed between the send and its
        mark: the worker's started marker still runs it once.)"""
        if not await self.ledger.never_sent(inv.task_id):
            return False
        log.warning("↻ %s was claimed but never sent (its orchestrator died); sending it now", inv.call_id)
        return True

    async def _route(self, inv: ToolInvocation, spec: ToolSpec,
                     on_session: Callable[[SessionRecord], None] | None) -> str:
        """The queue of a claimed call: its session's worker, or its declaration's once a live
        worker serves it. DispatchError (the call's ledger record says why) if there is none."""
        if spec.route == "session":  # sessions hook: to the worker holding the session it names
            try:
                session = await session_route.session_for(self.ledger.r, inv, spec)
            except DispatchError:
                await self.ledger.set_state(inv.task_id, CallState.FAILED, finished_at=time.time())
                raise
            if on_session is not None:
                on_session(session)
            return instance_queue(session.instance)
        unserved = await self.fleet.unserved(spec, _env_host(inv))  # fleet catalog hook: no live worker serves it
        if unserved:
            await self.ledger.set_state(inv.task_id, CallState.REJECTED, finished_at=time.time())
            raise DispatchError(unserved, state=CallState.REJECTED)
        return call_queue(inv, spec)

    async def _claim_and_send(self, inv: ToolInvocation, spec: ToolSpec, queue: str) -> Sent:
        return await self.ledger.claim_and_send(inv, spec.queue, queue_key(queue), self._message(inv, spec, queue))

    def _message(self, inv: ToolInvocation, spec: ToolSpec, queue: str) -> str:
        """The call's Celery task message (task_message.py), signed, for `queue`."""
        assert self.signer is not None, "a Dispatcher that sends needs the fleet's signer"
        now = time.time()
        task, invocation = task_name(spec.idempotent), inv.model_dump(mode="json")
        invocation["sent_at"] = now  # signed with the rest: the worker's queue wait starts here
        return TaskMessage(
            task=task, task_id=inv.task_id, args=[invocation],
            kwargs={"signature": self.signer.sign_invocation(task, inv.task_id, invocation)},  # signing hook
            queue=queue,  # fleet catalog hook: only workers serving this declaration (or holding the session)
            expires=inv.deadline,  # a call still queued at the turn deadline never starts
            time_limit=spec.timeout + TIME_LIMIT_MARGIN, soft_time_limit=spec.timeout + TIME_LIMIT_MARGIN / 2,
            # Flower shows these: a low-cardinality name, the call id, and what a shell call runs.
            shadow=f"tool:{spec.tool_name}", argsrepr=flower_args(inv, spec, self._settings.trace_url), kwargsrepr="{}",
            origin=self._origin, reply_to=self._reply_to,
        ).encode(now)

    async def revoke(self, task_ids: list[str], terminate: bool = True) -> None:
        if task_ids:
            await self._broadcast(lambda: self.app.control.revoke(task_ids, terminate=terminate, signal="SIGTERM"))

    async def ping(self, hostname: str, timeout: float = 1.0) -> bool:
        """Whether a worker answers (2-3 ms when alive; the full timeout when it is gone)."""
        replies = await self._broadcast(lambda: self.app.control.ping(destination=[hostname], timeout=timeout))
        return any(hostname in r for r in replies or [])

    async def active_task_ids(self, timeout: float = 1.0) -> set[str]:
        """Task ids some live worker holds (running or prefetched). Callers that ask while a
        question is out share its answer: after a Redis restart every call of a step asks at once,
        and each question costs the full `timeout` (workers that do not answer are waited for)."""
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask_active(timeout))
            self._asking.add_done_callback(lambda _: setattr(self, "_asking", None))
        return set(await asyncio.shield(self._asking))

    async def _ask_active(self, timeout: float) -> set[str]:
        inspect = self.app.control.inspect(timeout=timeout)
        ids: set[str] = set()
        for fn in (inspect.active, inspect.reserved):
            for tasks in (await self._broadcast(fn) or {}).values():
                ids |= {t["id"] for t in tasks}
        return ids

    async def taken(self) -> dict[str, str]:
        """Task id -> delivery tag of every message some worker has taken and not acked: running,
        about to start, or stranded on a worker that died."""
        out = {}
        for tag, value in (await self.ledger.r.hgetall(UNACKED_KEY)).items():
            try:
                task_id = task_id_of(json.loads(value)[0])  # [message, exchange, routing key]
            except (ValueError, KeyError, IndexError, TypeError):  # not a kombu entry
                continue
            if task_id is not None:
                out[task_id] = keys.text(tag)
        return out

    async def held(self, task_ids: list[str], hostnames: set[str], timeout: float = 1.0) -> set[str] | None:
        """Which of the tasks these workers hold (reserved or running); None unless all answered."""
        def ask() -> dict:
            inspect = self.app.control.inspect(destination=sorted(hostnames), timeout=timeout, limit=len(hostnames))
            return inspect.query_task(*task_ids) or {}

        replies = await self._broadcast(ask)
        if not hostnames <= set(replies):
            return None
        return {t for tasks in replies.values() for t in (tasks or {})}

    async def queued(self, task_ids: set[str], queues: set[str]) -> set[str]:
        """Which of the tasks wait on these queues (read whole: asked only after a worker died)."""
        found: set[str | None] = set()
        for queue in queues:
            found |= {message_task_id(raw) for raw in await self.ledger.r.lrange(queue_key(queue), 0, -1)}
        return task_ids & found

    async def unqueue(self, task_id: str, queue: str) -> bool:
        """Take the call's message off its queue, if it is there: True when this removed it (no
        worker can take it any more). Asked only of a queue nobody consumes (a host gone)."""
        for raw in await self.ledger.r.lrange(queue_key(queue), 0, -1):
            if message_task_id(raw) == task_id:
                return bool(await self.ledger.r.lrem(queue_key(queue), 1, raw))  # type: ignore[arg-type]  # bytes, as read
        return False

    async def resend(self, inv: ToolInvocation, spec: ToolSpec) -> None:
        """Send a call again under its task id, at the head of its queue (where a restored message
        goes): its message was lost. The worker's started marker still runs it at most once."""
        queue = call_queue(inv, spec)
        await self.ledger.r.rpush(queue_key(queue), self._message(inv, spec, queue))

    async def restore(self, tags: list[str]) -> None:
        """Put taken messages back at the head of their queues (as kombu does at a warm shutdown)."""
        def put_back() -> None:
            with self.app.connection_for_write() as conn:
                qos = conn.default_channel.qos
                for tag in tags:
                    qos.restore_by_tag(tag)

        await self._run(put_back)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._app is not None:
            self._app.close()
