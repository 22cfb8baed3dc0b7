"""A client session's calls on the fleet: each request becomes one `Fleet.run_calls([item])` of a
front-door tool, in the session's conversation and environment.

Two turns per session, so long-running processes never starve the session's control calls: a
turn's calls in flight are capped (TOOLQ_MAX_PARALLEL_CALLS), and sixteen running processes on
one turn would hold every `process/write`, `process/terminate` and `fs/*` behind them. Processes
run on the session's turn (`toolq cancel` it to end them all); control calls on its `-control`
turn. Both are recorded in the ledger and shown by `toolq status`."""

from __future__ import annotations

import json
import uuid
from typing import Any

from toolq.orchestrator.environments import Environment
from toolq.orchestrator.fleet import Fleet, new_turn_id


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
                                             conversation=self.conversation, environment=self.environment)
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
