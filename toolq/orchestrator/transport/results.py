"""Hear results from the workers without blocking and without piling up subscriptions, and hand
the barrier typed outcomes (`TaskOutcome`): Celery's result format stays in this module.

Celery's Redis backend publishes every state change of a task on `celery-task-meta-<task id>`.
Task ids start with the turn id, so one PSUBSCRIBE per turn covers all of its calls; every
turn's pattern is on the one subscription of the runtime, which is taken and changed under a
lock (turns starting at once each opened a connection of their own, and only one was read). After
subscribing we MGET the keys we wait for, which closes the race with results stored before the
subscription (docs/reference/celery-notes.md#waiting-without-blocking-the-event-loop). A lost
connection is retried; afterwards the router catches up with MGET and tells the barrier, which
then checks for calls whose messages were lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from toolq.core import keys
from toolq.core.calls import ToolResult
from toolq.core.contracts import ToolCallFailed
from toolq.core.redis_target import RedisTarget
from toolq.core.signing import Signer
from toolq.core.states import FAILURE, REVOKED, STARTED, SUCCESS, CallState
from toolq.orchestrator.transport import TaskOutcome, Watches
from toolq.orchestrator.transport.redis_pool import blocking_client

log = logging.getLogger("toolq.results")

READY = {SUCCESS, FAILURE, REVOKED}


def outcome_from_meta(meta: dict[str, Any]) -> TaskOutcome:
    """A terminal Celery result meta as the barrier needs it.

    SUCCESS and a `ToolCallFailed` FAILURE carry the worker's `ToolResult`; any other FAILURE is
    Celery's own (the pool child died, the hard time limit), and REVOKED is a cancel."""
    status = meta.get("status")
    info = meta.get("result") or {}
    if status == SUCCESS:
        result = ToolResult.model_validate(info)
        return TaskOutcome(state=result.status, result=result)
    exc, msg = info.get("exc_type", "Error"), info.get("exc_message")
    if status == REVOKED:
        if msg == ["expired"] or msg == "expired":  # Celery's reason when the deadline passed in the queue
            return TaskOutcome(state=CallState.TIMED_OUT, reason="call was not run: its deadline passed while it "
                                                                 "waited in the queue for a worker")
        return TaskOutcome(state=CallState.CANCELLED)  # e.g. from Flower: this call is cancelled, the turn goes on
    if exc == ToolCallFailed.__name__ and isinstance(msg, list) and msg and isinstance(msg[0], dict):
        result = ToolResult.model_validate(msg[0])
        return TaskOutcome(state=result.status, result=result)
    msg = " ".join(str(m) for m in msg) if isinstance(msg, list) else str(msg or "")
    if exc == "WorkerLostError":
        return TaskOutcome(state=CallState.LOST, reason=f"the worker process running this call died ({msg}); "
                                                        "the call may have partially executed")
    if exc == "TimeLimitExceeded":
        return TaskOutcome(state=CallState.TIMED_OUT, reason=f"call exceeded its time limit and was killed ({msg})")
    return TaskOutcome(state=CallState.FAILED, reason=f"call failed on the worker: {exc}: {msg}")


class ResultRouter(Watches):
    """Watches tasks of watched turns. A task sent after `watch` needs nothing more; one that may
    have reported before (a re-dispatch) needs `catch_up`."""

    def __init__(self, url: RedisTarget | str, signer: Signer, *, stream_output: bool = True) -> None:
        self.signer = signer
        """Checks every meta before it counts (toolq/core/signing.py)."""
        self.stream_output = stream_output
        """Also hear the calls' streamed output (toolq/workers/streaming.py), on the same connection."""
        # The subscription holds one connection; catch-up reads take the others.
        self.r = blocking_client(url, "toolq-results", max_connections=8)
        self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        super().__init__()
        self._turns: dict[str, int] = {}
        """Watchers per subscribed turn (0: lingering, see `unwatch_turn`)."""
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        self._dropping: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        """Held while the subscription changes: its first command opens its connection, and two
        opening at once would leave one turn's pattern on a connection nobody reads."""
        self._reader: asyncio.Task | None = None
        self._subscribed = asyncio.Event()
        #: monotonic time of the last reconnect after a lost connection (0: never)
        self.reconnected_at = 0.0
        self.connected = True

    async def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="toolq-results")

    async def aclose(self) -> None:
        for timer in self._lingering.values():
            timer.cancel()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        await self.pubsub.aclose()
        await self.r.aclose()

    async def watch_turn(self, turn_id: str) -> None:
        lingering = self._lingering.pop(turn_id, None)
        if lingering is not None:  # still subscribed (its count is 0): nothing to send
            lingering.cancel()
        # Counted before the await: a reader re-subscribing meanwhile includes this turn.
        self._turns[turn_id] = self._turns.get(turn_id, 0) + 1
        if self._turns[turn_id] == 1 and lingering is None:
            try:
                async with self._lock:
                    await self.pubsub.psubscribe(*self._patterns(turn_id))
            except BaseException:
                self._turns[turn_id] -= 1
                if not self._turns[turn_id]:
                    del self._turns[turn_id]
                raise
            self._subscribed.set()

    def _patterns(self, turn_id: str) -> tuple[str, ...]:
        """A turn's result metas, and its calls' streamed output when that is on."""
        meta = keys.celery_meta_pattern(turn_id)
        return (meta, keys.call_output_pattern(turn_id)) if self.stream_output else (meta,)

    async def unwatch_turn(self, turn_id: str, linger: float = 0.0) -> None:
        """One watcher less. The last one's pattern goes now, or after `linger` seconds unless the
        turn is watched again meanwhile (`Fleet.run_calls` watches once per step: the next step
        of the turn then sends nothing)."""
        self._turns[turn_id] -= 1
        if self._turns[turn_id] > 0:
            return
        if linger > 0:
            self._lingering[turn_id] = asyncio.get_running_loop().call_later(linger, self._linger_over, turn_id)
            return
        await self._drop(turn_id)

    def _linger_over(self, turn_id: str) -> None:
        if self._lingering.pop(turn_id, None) is not None:
            task = asyncio.get_running_loop().create_task(self._drop(turn_id))
            self._dropping.add(task)
            task.add_done_callback(self._dropping.discard)

    async def _drop(self, turn_id: str) -> None:
        if self._turns.get(turn_id) != 0:
            return  # watched again
        del self._turns[turn_id]  # before the await: a watch_turn meanwhile subscribes again, after us
        for task_id in [t for t in self._watches if t.startswith(f"{turn_id}:")]:
            del self._watches[task_id]
        try:
            async with self._lock:
                await self.pubsub.punsubscribe(*self._patterns(turn_id))
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass  # the connection is gone; so is the subscription

    async def catch_up(self, task_ids: list[str] | None = None) -> None:
        ids = [t for t in (task_ids if task_ids is not None else list(self._watches)) if t in self._watches]
        if not ids:
            return
        for task_id, raw in zip(ids, await self.r.mget([keys.celery_meta(t) for t in ids]), strict=True):
            if raw is not None:
                self._deliver(task_id, raw)

    async def has_result(self, task_id: str) -> bool:
        """Whether the backend holds any state (STARTED included) for the task."""
        return bool(await self.r.exists(keys.celery_meta(task_id)))

    def _deliver(self, task_id: str, raw: bytes | str) -> None:
        w = self._watches.get(task_id)
        if w is None or w.done.done():
            return  # the first terminal state wins: a late SUCCESS after REVOKED is not applied
        try:
            meta = json.loads(raw)
        except (TypeError, ValueError):
            log.warning("unreadable result meta for %s", task_id)
            return
        if not self.signer.accept_meta(task_id, meta):  # signing hook: a forged meta is dropped, logged
            return
        status = meta.get("status")
        if status == STARTED and w.hostname is None:
            w.set_started((meta.get("result") or {}).get("hostname"))
        elif status in READY:
            try:
                w.finish(outcome_from_meta(meta))
            except ValueError as e:  # pydantic: a result no toolq worker wrote
                log.warning("unreadable result for %s: %s", task_id, e)

    def _deliver_output(self, task_id: str, raw: bytes | str) -> None:
        """A batch of a running call's output, for the view: signed by a worker, in order, bounded."""
        w = self._watches.get(task_id)
        if w is None or w.on_output is None or w.done.done():
            return
        try:
            message = json.loads(raw)
        except (TypeError, ValueError):
            return
        if not self.signer.output_genuine(task_id, message):  # signing hook: whoever reached Redis
            log.warning("refused an output batch for task %s: its signature does not match", task_id)
            return
        seq = message.get("seq")
        if isinstance(seq, int):
            w.output(seq, message["text"])

    async def _read(self) -> None:
        """Runs as long as the router: a reader that stopped would lose every later result."""
        await self._subscribed.wait()
        delay = 0.1
        lost = False
        while True:
            try:
                if lost:
                    await self._resubscribe()  # raises while Redis is still down
                    lost = False
                    await self._reconnected()
                msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                delay = 0.1
                if msg and msg.get("type") == "pmessage":
                    channel = msg["channel"].decode()
                    if channel.startswith(keys.CALL_OUTPUT):
                        self._deliver_output(channel[len(keys.CALL_OUTPUT):], msg["data"])
                    else:
                        self._deliver(channel[len(keys.CELERY_META):], msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # redis-py's connection errors, and whatever a half-open pubsub raises
                if self.connected:
                    log.warning("lost the result channel (%s); reconnecting", e)
                self.connected, lost = False, True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _resubscribe(self) -> None:
        """A fresh pubsub on every watched turn's pattern (a failed one may be left with no
        connection, and its next read would raise "pubsub connection not set")."""
        async with self._lock:
            old, self.pubsub = self.pubsub, self.r.pubsub(ignore_subscribe_messages=True)
            try:
                await old.aclose()
            except Exception:
                pass
            patterns = [p for t in self._turns for p in self._patterns(t)]
            if patterns:
                await self.pubsub.psubscribe(*patterns)
                return
            self._subscribed.clear()  # under the lock: a watch_turn after it sets it again
        await self._subscribed.wait()  # nothing to listen for until the next turn: its watch_turn subscribes

    async def _reconnected(self) -> None:
        self.connected = True
        self.reconnected_at = time.monotonic()
        log.warning("result channel back; catching up on %d pending calls", len(self._watches))
        await self.catch_up()
