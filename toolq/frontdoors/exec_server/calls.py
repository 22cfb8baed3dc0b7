"""A client session's calls on the fleet: each request becomes one `Fleet.run_calls([item])` of a
front-door tool, in the session's conversation and environment.

Two turns per session, so long-running processes never starve the session's control calls: a
turn's calls in flight are capped (TOOLQ_MAX_PARALLEL_CALLS), and sixteen running processes on
one turn would hold every `process/write`, `process/terminate` and `fs/*` behind them. Processes
run on the session's turn (`toolq cancel` it to end them all); control calls on its `-control`
turn. Both are recorded in the ledger and shown by `toolq status`."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from toolq.orchestrator.environments import Environment
from toolq.orchestrator.fleet import Fleet, new_turn_id

#: Bytes of file contents one server lets travel through the fleet's Redis at once, over all its
#: sessions: a writeFile's data is its call's arguments and a readFile's content its result (up to
#: 64 MiB, 85 MiB in base64, each), and a client may pipeline as many as it likes.
PAYLOAD_BUDGET = 64 << 20
#: What a readFile holds of the budget before its size is known: at most two at once.
READ_SHARE = PAYLOAD_BUDGET // 2


class PayloadBudget:
    """The file contents in flight through Redis: a call waits until its share fits (one larger
    than the whole budget goes alone), so Redis holds a bounded amount whatever is pipelined."""

    def __init__(self, limit: int = PAYLOAD_BUDGET) -> None:
        self.limit, self.used = limit, 0
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        size = min(size, self.limit)
        async with self._changed:
            await self._changed.wait_for(lambda: self.used + size <= self.limit)
            self.used += size
        try:
            yield
        finally:
            async with self._changed:
                self.used -= size
                self._changed.notify_all()


def new_call_id() -> str:
    return f"fd_{uuid.uuid4().hex[:20]}"


class Calls:
    def __init__(self, fleet: Fleet, conversation: str, environment: Environment | None) -> None:
        self.fleet = fleet
        self.conversation = conversation
        self.environment = environment
        self.turn_id = new_turn_id()
        """The processes' turn: `toolq cancel` it and every process of the session ends."""
        self.control_turn = f"{self.turn_id}-control"
        """Writes, terminations and file operations: never queued behind the processes' cap."""

    async def run(self, tool: str, args: dict[str, Any], *, control: bool = True,
                  call_id: str | None = None) -> tuple[str, Any]:
        """The call's output text, and its JSON when the text is JSON (else None: toolq's reason the
        call did not run or failed, in words)."""
        item = {"type": "function_call", "call_id": call_id or new_call_id(), "name": tool,
                "arguments": json.dumps(args, separators=(",", ":"))}
        outputs = await self.fleet.run_calls([item], turn_id=self.control_turn if control else self.turn_id,
                                             conversation=self.conversation, environment=self.environment,
                                             label="(exec-server: file operations and stdin)" if control
                                             else "(exec-server: processes)")
        output = outputs[0].get("output", "") if outputs else "(toolq gave this call no output)"
        text = output if isinstance(output, str) else json.dumps(output)
        try:
            return text, json.loads(text)
        except ValueError:
            return text, None

    async def cancel_call(self, call_id: str) -> None:
        """Stop one process call that has not started yet (queued, or throttled behind the cap)."""
        ledger = self.fleet.ledger
        tasks = [c["task_id"] for c in await ledger.calls(self.turn_id)
                 if c.get("call_id") == call_id and c.get("task_id")]
        for task_id in tasks:
            await ledger.cancel_call(self.turn_id, task_id)
        if tasks:
            await self.fleet.dispatcher.revoke(tasks, terminate=True)

    async def end(self) -> None:
        for turn in (self.turn_id, self.control_turn):
            await self.fleet.end_turn(turn)
