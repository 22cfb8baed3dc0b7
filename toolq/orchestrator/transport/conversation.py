"""A conversation's lease in Redis: while it is refreshed, its exec_command sessions may live.

`Session` takes one at its first turn and gives it back at `close()`; session hosts kill the
sessions of a conversation whose key is gone (toolq/workers/sessions/host.py), so a `toolq run`
that is killed outright loses its sessions within `CONVERSATION_TTL` seconds too.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from redis.exceptions import RedisError

from toolq.core.session_records import CONVERSATION_BEAT, CONVERSATION_TTL, conversation_key
from toolq.orchestrator.turn_scope import stop

log = logging.getLogger("toolq.conversation")


def new_conversation_id() -> str:
    return f"conv_{uuid.uuid4().hex[:16]}"


class ConversationLease:
    def __init__(self, r, conversation: str) -> None:
        self.r, self.id = r, conversation
        self._beat: asyncio.Task | None = None

    async def hold(self) -> None:
        """Take (or keep) the lease; idempotent, so each turn may call it."""
        if self._beat is not None and not self._beat.done():
            return
        await self._refresh()
        self._beat = asyncio.create_task(self._run())

    async def _refresh(self) -> None:
        await self.r.set(conversation_key(self.id), "1", ex=CONVERSATION_TTL)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CONVERSATION_BEAT)
            try:
                await self._refresh()
            except (RedisError, OSError) as e:  # the next beat tries again; the TTL covers a gap
                log.warning("could not refresh conversation %s: %s", self.id, e)

    async def release(self) -> None:
        """The conversation ended: every session of it is killed by the host holding it."""
        if self._beat is None:
            return  # never held (e.g. Redis was unreachable at the first turn): nothing to end
        # Cancelled until it ends: a cancel that landed inside redis-py's send was dropped there
        # (Python 3.11's wait_for), the loop went on, and a `toolq batch` lane waited on it for ever.
        await stop(self._beat)
        self._beat = None
        try:
            await self.r.delete(conversation_key(self.id))
        except (RedisError, OSError) as e:
            log.warning("could not end conversation %s (its sessions end at the TTL): %s", self.id, e)

