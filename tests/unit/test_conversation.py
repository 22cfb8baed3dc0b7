"""A conversation's lease (toolq/orchestrator/transport/conversation.py) on a real redis-server."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from toolq.local.embedded import RedisServer
from toolq.orchestrator.transport import conversation
from toolq.orchestrator.transport.conversation import ConversationLease


def test_a_lease_ends_even_when_its_refresh_drops_a_cancel(monkeypatch):
    """Python 3.11's wait_for, inside redis-py's send, can drop a cancel that lands as the send
    ends: the refresh loop went on and `release()` (a `toolq batch` lane closing its session)
    waited on it for ever (found by helper-21 at 1,024 turns)."""
    monkeypatch.setattr(conversation, "CONVERSATION_BEAT", 0.01)
    dropped = []
    refreshing = asyncio.Event()

    class DroppingLease(ConversationLease):
        async def _refresh(self) -> None:
            try:
                await super()._refresh()
                refreshing.set()
                await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                if not dropped:  # the first cancel is lost, as in redis-py under 3.11
                    dropped.append(True)
                    return
                raise

    async def go() -> bool:
        with RedisServer() as server:
            r = aioredis.Redis.from_url(server.url)
            try:
                lease = DroppingLease(r, "conv_test")
                await lease.hold()
                refreshing.clear()
                await asyncio.wait_for(refreshing.wait(), 30)  # the loop's own refresh is under way
                beat = lease._beat
                assert beat is not None
                releasing = asyncio.create_task(lease.release())
                await asyncio.wait({releasing}, timeout=30)  # not wait_for: its own cancel would end the hang
                if not releasing.done():
                    beat.cancel()
                    releasing.cancel()
                    raise AssertionError("release() waited on a refresh loop that had dropped its cancel")
                assert beat.done(), "the refresh loop outlived its lease"
                return bool(await r.exists(conversation.conversation_key("conv_test")))
            finally:
                await r.aclose()

    assert asyncio.run(go()) is False
    assert dropped, "the test's lease never dropped a cancel: it proves nothing"
