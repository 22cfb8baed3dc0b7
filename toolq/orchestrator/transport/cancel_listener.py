"""Hear `toolq cancel` for every turn of a runtime on ONE pattern subscription.

A subscription per running turn held a Redis connection per turn: at 128 turns the pool ran out
(`Too many connections`) and turns failed to start (issue 14). One PSUBSCRIBE on every turn's
cancel channel serves them all; each waiting turn is a future. A turn checks the durable cancel
record once the subscription is confirmed, so a cancel sent before it listened counts too; after
a lost connection the listener re-subscribes and checks the records of every waiting turn again
(a cancel published meanwhile was missed, its record was not). While the subscription stays up,
a turn's record is read once (`Fleet.run_calls` waits once per step): a cancel published later
is heard, by a waiter or into `_heard` for the turn's next wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from toolq.core import keys
from toolq.workers.redis_clients import dedicated_pool

log = logging.getLogger("toolq.cancels")

#: The name its connection shows in CLIENT LIST.
CLIENT_NAME = "toolq-cancels"
_PREFIX = keys.CANCEL_CHANNELS[:-1]
#: Turns remembered as heard-cancelled or record-checked (oldest forgotten first: then read again).
REMEMBERED = 10_000


class CancelListener:
    def __init__(self, r: aioredis.Redis, is_cancelled: Callable[[str], Awaitable[bool]],
                 is_call_cancelled: Callable[[str], Awaitable[bool]]) -> None:
        # Its own connection, under its own name: never one the ledger's commands wait for.
        self._pool = dedicated_pool(r, CLIENT_NAME)
        self._is_cancelled = is_cancelled
        self._is_call_cancelled = is_call_cancelled
        """A call's cancel is acted on once its durable record is read: a message alone is only a
        publish, which anyone who reaches Redis can send."""
        self._confirming: set[asyncio.Task] = set()
        self._waiters: dict[str, set[asyncio.Future]] = {}
        self._heard: OrderedDict[str, None] = OrderedDict()
        """Turns whose cancel was published while this subscription was up."""
        self._checked: OrderedDict[str, None] = OrderedDict()
        """Turns whose durable record was read (not cancelled) since the subscription was taken."""
        self._calls: dict[str, list[Callable[[str], None]]] = {}
        """Per turn, who is told the task id of each call cancelled alone (`toolq cancel --call`)."""
        self._subscribed = asyncio.Event()
        self._reader: asyncio.Task | None = None

    def on_call(self, turn_id: str, heard: Callable[[str], None]) -> Callable[[], None]:
        """Tell `heard` the task id of each of the turn's calls cancelled alone, while the turn's
        cancel is waited for (`wait` keeps the subscription); returns what stops it. A call still
        queued when a cancel was missed is stopped by the worker, which reads its durable record."""
        self._calls.setdefault(turn_id, []).append(heard)

        def stop() -> None:
            hearing = self._calls.get(turn_id, [])
            if heard in hearing:
                hearing.remove(heard)
            if not hearing:
                self._calls.pop(turn_id, None)

        return stop

    async def wait(self, turn_id: str) -> None:
        """Return once the turn is cancelled from any process. While Redis is away it waits for
        the listener to be back (a cancel in the meantime is found in its durable record)."""
        heard = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(turn_id, set()).add(heard)
        try:
            if self._reader is None or self._reader.done():
                self._reader = asyncio.create_task(self._read(), name="toolq-cancels")
            await self._subscribed.wait()  # from here on a published cancel reaches `heard`
            if turn_id in self._heard:
                return
            if turn_id not in self._checked:
                if await self._is_cancelled(turn_id):
                    return
                _remember(self._checked, turn_id)
            await heard
        finally:
            waiting = self._waiters.get(turn_id, set())
            waiting.discard(heard)
            if not waiting:
                self._waiters.pop(turn_id, None)

    def _hear(self, turn_id: str) -> None:
        forgotten = _remember(self._heard, turn_id)
        if forgotten is not None:  # its record is read again at its next wait
            self._checked.pop(forgotten, None)
        for heard in self._waiters.get(turn_id, ()):
            if not heard.done():
                heard.set_result(None)

    async def _read(self) -> None:
        """Runs as long as the listener; a lost connection is retried on a fresh subscription."""
        delay, first, connected = 0.1, True, True
        while True:
            pubsub = PubSub(self._pool)
            try:
                await pubsub.psubscribe(keys.CANCEL_CHANNELS)
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    me = asyncio.current_task()
                    if me is not None and me.cancelling():  # redis-py can swallow a cancel during a read
                        raise asyncio.CancelledError
                    if msg is None:
                        continue
                    if msg["type"] == "psubscribe":
                        if not first:  # cancels published while we were away: their records
                            await self._check_records()
                            log.warning("cancel channel back")
                        first, connected, delay = False, True, 0.1
                        self._subscribed.set()
                    elif msg["type"] == "pmessage":
                        # Whatever a publisher sent, the subscription goes on (a channel name that
                        # was not UTF-8 was taken for a lost connection).
                        turn_id = msg["channel"].decode(errors="replace")[len(_PREFIX):]
                        self._dispatch(turn_id, _message(msg["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # redis-py's connection errors, and whatever a half-open pubsub raises
                if connected:
                    log.warning("lost the cancel channel (%s); reconnecting", e)
                connected = False
                self._subscribed.clear()
                self._checked.clear()  # a cancel published while we are away is only in its record
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    def _dispatch(self, turn_id: str, message: dict) -> None:
        if message.get("scope") == "turn":
            self._hear(turn_id)
        elif message.get("scope") == "call" and isinstance(message.get("task_id"), str) and turn_id in self._calls:
            task = asyncio.create_task(self._call_cancelled(turn_id, message["task_id"]))
            self._confirming.add(task)
            task.add_done_callback(self._confirming.discard)

    async def _call_cancelled(self, turn_id: str, task_id: str) -> None:
        try:
            if not await self._is_call_cancelled(task_id):
                log.warning("ignored a cancel of call %s of %s with no durable record", task_id, turn_id)
                return
            for heard in list(self._calls.get(turn_id, ())):
                heard(task_id)
        except Exception:  # the turn's bug or Redis away: the call goes on, its worker reads the record
            log.exception("handling the cancel of call %s of %s failed", task_id, turn_id)

    async def _check_records(self) -> None:
        for turn_id in list(self._waiters):
            if await self._is_cancelled(turn_id):
                self._hear(turn_id)

    async def aclose(self) -> None:
        for task in list(self._confirming):
            task.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait({self._reader}, timeout=2.0)
        await self._pool.aclose()


def _remember(seen: OrderedDict[str, None], turn_id: str) -> str | None:
    """Add `turn_id`; returns the one forgotten to stay within `REMEMBERED`, if any."""
    seen[turn_id] = None
    seen.move_to_end(turn_id)
    return seen.popitem(last=False)[0] if len(seen) > REMEMBERED else None


def _message(data: bytes | str) -> dict:
    try:
        message = json.loads(data)
    except (TypeError, ValueError):
        return {}
    return message if isinstance(message, dict) else {}
