"""`turn_scope.stop` ends a helper task even when its first cancel is swallowed, as a redis-py command
may swallow it (a one-request `toolq run` waited out the whole grace at exit, every other run)."""

from __future__ import annotations

import asyncio

from toolq.orchestrator import turn_scope


async def swallows_one_cancel() -> None:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass  # swallowed where a redis-py command was awaited
    await asyncio.sleep(30)  # the helper's next wait


def test_a_helper_that_swallows_a_cancel_is_cancelled_again_until_it_ends(monkeypatch):
    monkeypatch.setattr(turn_scope, "STOP_GRACE", 1.0)

    async def run() -> bool:
        task = asyncio.create_task(swallows_one_cancel())
        await asyncio.sleep(0)
        await turn_scope.stop(task)
        done = task.done()
        task.cancel()
        return done

    assert asyncio.run(run())
