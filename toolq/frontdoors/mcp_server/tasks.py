"""MCP tasks backed by the ledger: a task-augmented `tools/call` answers at once with a task whose
id is the call's turn id, and any replica of the server on the same Redis answers `tasks/get`,
`tasks/result` and `tasks/cancel` for it.

A task's record lives in Redis (`toolq:mcp:task:<turn>`), sealed with the fleet's key (a record
someone wrote into Redis without it is no task), and is kept `ttl` milliseconds after the call
ends (the client asks a ttl; toolq bounds it). While the call runs the ledger is the truth: a turn
cancelled (`toolq cancel`, `tasks/cancel` on any replica) is a cancelled task, and a running turn
whose lease lapsed (the replica running it died) is a failed one.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from mcp import types
from pydantic import BaseModel, ValidationError

from toolq.core import keys
from toolq.core.signing import Signer
from toolq.orchestrator.transport.ledger import ORPHANED, Ledger, mark_orphans

#: Kept this long after the call ends when the client asks no ttl (milliseconds).
DEFAULT_TTL_MS = 3600 * 1000
#: ... and at most this long whatever it asks (the ledger's own records last a week).
MAX_TTL_MS = keys.RECORD_TTL * 1000
#: How often a client is told to poll (milliseconds), and how often `tasks/result` looks.
POLL_MS = 500
#: While the call runs the record's key lives this long past the last look (the runner renews it).
WORKING_TTL = 24 * 3600

#: A task id is a turn id (`new_turn_id`); anything else names no task and costs no Redis lookup.
TASK_ID = re.compile(r"turn-[0-9a-f]{12}")

TERMINAL: frozenset[types.TaskStatus] = frozenset({"completed", "failed", "cancelled"})


def task_key(task_id: str) -> str:
    return f"{keys.PREFIX}:mcp:task:{task_id}"


def _sealed_id(task_id: str) -> str:
    """The id the record is sealed under: never a Celery task id, whose metas the same key seals."""
    return f"mcp-task:{task_id}"


class TaskRecord(BaseModel):
    task_id: str
    status: types.TaskStatus
    message: str | None = None
    created: float
    updated: float
    ttl_ms: int
    result: dict[str, Any] | None = None
    """The `CallToolResult` (wire JSON) once the call ended."""

    def task(self) -> types.Task:
        return types.Task(taskId=self.task_id, status=self.status, statusMessage=self.message,
                          createdAt=_when(self.created), lastUpdatedAt=_when(self.updated), ttl=self.ttl_ms,
                          pollInterval=POLL_MS)


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


class TaskStore:
    def __init__(self, ledger: Ledger, signer: Signer) -> None:
        self.ledger, self.r, self.signer = ledger, ledger.r, signer

    async def _write(self, record: TaskRecord, expire: int) -> None:
        sealed = self.signer.seal_meta({"task_id": _sealed_id(record.task_id), "record": record.model_dump()})
        await self.r.set(task_key(record.task_id), json.dumps(sealed), ex=expire)

    async def _read(self, task_id: str) -> TaskRecord | None:
        raw = await self.r.get(task_key(task_id))
        if raw is None:
            return None
        try:
            sealed = json.loads(raw)
            if self.signer.meta_refusal(_sealed_id(task_id), sealed) is not None:
                return None
            return TaskRecord.model_validate(sealed["record"])
        except (ValueError, KeyError, TypeError, ValidationError, RecursionError):  # deep JSON written to Redis
            return None

    async def create(self, task_id: str, ttl_ms: int | None) -> TaskRecord:
        now = time.time()
        ttl = DEFAULT_TTL_MS if ttl_ms is None else max(1000, min(int(ttl_ms), MAX_TTL_MS))
        record = TaskRecord(task_id=task_id, status="working", created=now, updated=now, ttl_ms=ttl)
        await self._write(record, WORKING_TTL)
        return record

    async def finish(self, task_id: str, status: types.TaskStatus, message: str | None,
                     result: types.CallToolResult) -> None:
        record = await self._read(task_id)
        if record is None:  # expired meanwhile, or forged over: this replica knows what it ran
            now = time.time()
            record = TaskRecord(task_id=task_id, status=status, created=now, updated=now, ttl_ms=DEFAULT_TTL_MS)
        record.status = "cancelled" if record.status == "cancelled" else status
        record.message = record.message or message
        record.updated = time.time()
        record.result = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        await self._write(record, max(1, record.ttl_ms // 1000))

    async def get(self, task_id: str) -> TaskRecord | None:
        """The task as it stands, or None (unknown, expired, not genuine, not a turn id at all)."""
        if not TASK_ID.fullmatch(task_id):
            return None
        record = await self._read(task_id)
        if record is None or record.status in TERMINAL:
            return record
        turn = await self.ledger.turn(task_id)
        await mark_orphans(self.r, [(task_id, turn)])
        if turn.get("state") == "cancelled" or await self.ledger.is_cancelled(task_id):
            record.status, record.message = "cancelled", record.message or "cancelled (toolq cancel)"
        elif turn.get("state") == ORPHANED:
            record.status = "failed"
            record.message = "the toolq mcp-server running this call stopped before it ended"
        return record

    async def cancel(self, task_id: str) -> TaskRecord | None:
        """`toolq cancel` of the task's turn (its running call is revoked, its processes killed, by
        the replica running it); the task is cancelled at once. None: no such task."""
        record = await self.get(task_id)
        if record is None or record.status in TERMINAL:
            return record
        await self.ledger.cancel_turn(task_id, reason="MCP tasks/cancel")
        record.status, record.message, record.updated = "cancelled", "cancelled by the client", time.time()
        await self._write(record, WORKING_TTL)
        return record
