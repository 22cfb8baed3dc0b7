"""Run one ToolInvocation on a worker: the body of the Celery task, without Celery.

Order matters: cancelled? -> already started elsewhere? -> same declaration? -> workspace
visible? -> run. Every path returns a `ToolResult`; nothing raises to Celery except a kill.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

import redis

from toolq.orchestrator import keys
from toolq.orchestrator.calls import CustomPayload, FunctionPayload, ToolInvocation, ToolResult, aborted_text
from toolq.orchestrator.errors import RespondToModel
from toolq.orchestrator.protocol.items import ToolOutputBody
from toolq.workers.catalog import Catalog, ToolContext, ToolReturn, ToolSpec, call_handler, parse_arguments
from toolq.workers.sandbox import CallCancelled

log = logging.getLogger("toolq.worker")

#: Deliveries allowed for an idempotent call before it is given up (poison-loop guard).
MAX_DELIVERIES = 3

# One event loop per worker process for async tools (a pool child runs one call at a time).
_loop: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def is_cancelled(r: redis.Redis, inv: ToolInvocation) -> bool:
    return bool(r.exists(keys.cancel_turn(inv.turn_id), keys.cancel_call(inv.task_id)))


def _result(inv: ToolInvocation, output: ToolOutputBody, status: str, hostname: str, **kw: Any) -> dict:
    now = time.time()
    res = ToolResult(
        call_id=inv.call_id, output=output, status=status, worker=hostname,
        started_at=kw.pop("started_at", now), finished_at=now, **kw,
    )
    return res.model_dump(mode="json")


# KEYS: turn cancel, call cancel, started marker, call record. ARGV: hostname, ttl, started_at, pid.
# Returns {cancelled, first delivery, previous state, previous worker}.
_START = """
local cancelled = redis.call('EXISTS', KEYS[1], KEYS[2])
local first = redis.call('SET', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
local prev = redis.call('HMGET', KEYS[4], 'state', 'worker')
if first == 1 and cancelled == 0 then
    redis.call('HSET', KEYS[4], 'state', 'started', 'worker', ARGV[1], 'started_at', ARGV[3], 'pid', ARGV[4])
    redis.call('EXPIRE', KEYS[4], ARGV[2])
end
return {cancelled, first, prev[1], prev[2]}
"""


def worker_name(raw: bytes | None) -> str:
    """A worker name read back from the ledger, fit to quote in an output. The ledger is unsigned:
    whoever reaches Redis could write a sentence there for the model to read."""
    name = (raw or b"").decode(errors="replace")
    return name if _WORKER_NAME.fullmatch(name) else "?"


_WORKER_NAME = re.compile(r"[\w.@:%+-]{1,200}")


def _may_redeliver(spec: ToolSpec | None, redelivery: bool) -> bool:
    return redelivery and spec is not None and spec.idempotent


def _queue_state(p: redis.client.Pipeline, inv: ToolInvocation, **fields: Any) -> None:
    key = keys.call(inv.task_id)
    p.hset(key, mapping={k: str(v) for k, v in fields.items()})
    p.expire(key, keys.RECORD_TTL)


def _set_state(r: redis.Redis, inv: ToolInvocation, **fields: Any) -> None:
    with r.pipeline(transaction=False) as p:
        _queue_state(p, inv, **fields)
        p.execute()


def execute(raw: dict, *, hostname: str, r: redis.Redis, catalog: Catalog, redelivery: bool = False,
            time_limit_errors: tuple[type[BaseException], ...] = ()) -> dict:
    """`time_limit_errors`: what the pool raises inside a tool at its soft time limit."""
    inv = ToolInvocation.model_validate(raw)
    spec = catalog.get(inv.tool_name)

    # One round trip on every call's path: cancelled? first delivery? then mark it started.
    started_at = time.time()
    cancelled, first, prev_state, prev_worker = r.register_script(_START)(
        keys=[keys.cancel_turn(inv.turn_id), keys.cancel_call(inv.task_id), keys.started(inv.task_id),
              keys.call(inv.task_id)],
        args=[hostname, keys.RECORD_TTL, started_at, os.getpid()],
    )
    prev_state = (prev_state or b"").decode()
    prev_worker = worker_name(prev_worker)

    if cancelled:
        _set_state(r, inv, state="cancelled", worker=hostname, finished_at=time.time())
        log.info("⊘ %s %s cancelled before start", inv.call_id, inv.tool_name)
        return _result(inv, aborted_text(spec is not None and spec.shell_like, 0.0), "aborted", hostname)

    # At most once: a message redelivered after its worker died must not run a second time,
    # unless the tool is idempotent (and then only up to MAX_DELIVERIES).
    if not first:
        if not _may_redeliver(spec, redelivery):
            r.hincrby(keys.call(inv.task_id), "deliveries_refused", 1)
            if prev_state in ("succeeded", "failed", "cancelled", "timed_out"):
                log.warning("↺ %s %s delivered again after it finished on %s; not run again",
                            inv.call_id, inv.tool_name, prev_worker)
                return _result(inv, f"this call already ran on worker {prev_worker}; it was not run again",
                               "rejected", hostname, success=False)
            _set_state(r, inv, state="lost", finished_at=time.time())
            return _result(
                inv,
                f"this call was already started by worker {prev_worker}, which was lost; it was not run again "
                "because the tool is not idempotent (it may have partially executed)",
                "lost", hostname, success=False,
            )
        _set_state(r, inv, state="started", worker=hostname, started_at=started_at, pid=os.getpid())
        deliveries = r.incr(keys.attempts(inv.task_id))
        if deliveries >= MAX_DELIVERIES:
            return _result(inv, f"gave up after {deliveries} deliveries: the worker died each time", "failed",
                           hostname, success=False)

    log.info("→ %s %s started on %s", inv.call_id, inv.tool_name, hostname)

    status, output, extra = _run(inv, spec, r, catalog, hostname, time_limit_errors)
    _set_state(r, inv, state=_LEDGER_STATE[status], finished_at=time.time())
    log.info("← %s %s %s in %.3fs", inv.call_id, inv.tool_name, status, time.time() - started_at)
    return _result(inv, output, status, hostname, started_at=started_at, **extra)


_LEDGER_STATE = {"completed": "succeeded", "failed": "failed", "aborted": "cancelled", "rejected": "failed",
                 "timed_out": "timed_out", "lost": "lost"}


def _run(inv: ToolInvocation, spec: ToolSpec | None, r: redis.Redis, catalog: Catalog, hostname: str,
         time_limit_errors: tuple[type[BaseException], ...]):
    if spec is None:
        return "rejected", f"tool {inv.tool_name} is not loaded on worker {hostname}; not run", {"success": False}
    if spec.digest() != inv.spec_digest:
        return "rejected", (
            f"tool {inv.tool_name} is declared differently on worker {hostname} than in the orchestrator "
            f"(declaration {spec.digest()} != {inv.spec_digest}); not run. Load the same tool modules on both sides."
        ), {"success": False}
    workspace = Path(inv.workspace or os.getcwd())
    if not workspace.is_dir():
        return "rejected", (
            f"workspace {workspace} is not visible on worker {hostname}; not run. "
            "Workers must share the workspace (same host or a shared volume)."
        ), {"success": False}

    started_at = time.time()
    ctx = ToolContext(invocation=inv, workspace=workspace, is_cancelled=lambda: is_cancelled(r, inv), catalog=catalog)
    try:
        if isinstance(inv.payload, FunctionPayload):
            args: Any = parse_arguments(spec, inv.payload.arguments)
        elif isinstance(inv.payload, CustomPayload):
            args = inv.payload.input
        else:
            args = inv.payload
        value = _event_loop().run_until_complete(call_handler(spec, args, ctx))
    except RespondToModel as e:
        return "failed", e.message, {"success": False}
    except CallCancelled:
        return "aborted", aborted_text(spec.shell_like, time.time() - started_at), {"success": False}
    except time_limit_errors:
        return "timed_out", f"call timed out after {spec.timeout:g}s and was stopped", {"success": False}
    except Exception as e:  # a tool's own bug still becomes an output the model can read
        log.error("tool %s raised:\n%s", inv.tool_name, traceback.format_exc())
        return "failed", f"tool {inv.tool_name} failed: {type(e).__name__}: {e}", {"success": False}
    if isinstance(value, ToolReturn):
        return "completed", value.output, {"success": value.success, "exit_code": value.exit_code, "tools": value.tools}
    return "completed", value, {"success": True}
