"""One call sent as the orchestrator sends it, without an orchestrator: bound against its
declaration, signed with the suite's fleet key, put on a queue, its Celery result waited for.
For tests that drive workers directly (environments, traces, the red team)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import redis
from celery import Celery

from tests.integration.conftest import SIGNING_KEY
from toolq.core import keys
from toolq.core.calls import FunctionPayload, ToolCall, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolSpec
from toolq.core.contracts import TASK
from toolq.core.settings import Settings
from toolq.core.signing import Signer
from toolq.orchestrator.binding import StepContext
from toolq.orchestrator.registry import Registry

SIGNER = Signer(SIGNING_KEY)


def bound(spec: ToolSpec, arguments: dict[str, Any], *, timeout: float, workspace: str, name: ToolName | None = None,
          turn_prefix: str = "turn-t", **fields: Any) -> ToolInvocation:
    """`spec`'s call with `arguments`, bound as the registry binds it; `fields` set on the invocation
    afterwards (environment, conversation, trace, sent_at...)."""
    call = ToolCall(tool_name=name or spec.tool_name, call_id="call_" + secrets.token_hex(4),
                    payload=FunctionPayload(arguments=json.dumps(arguments)))
    step = StepContext(turn_prefix + secrets.token_hex(4), 0, time.time() + timeout, workspace)
    inv = Registry(Catalog([spec])).bind(call, step, 0)
    return inv.model_copy(update=fields) if fields else inv


def run_signed(redis_url: str, inv: ToolInvocation, queue: str, *, timeout: float = 60) -> dict[str, Any]:
    """Send `inv` signed to `queue` (`tool_queue(spec)`, or a host's) and wait for its end: its
    result (a failed call's ToolResult too)."""
    body = inv.model_dump(mode="json")
    app = Celery("signedtest", broker=redis_url, set_as_current=False)
    try:
        app.send_task(TASK, args=[body], kwargs={"signature": SIGNER.sign_invocation(TASK, inv.task_id, body)},
                      task_id=inv.task_id, queue=queue)
    finally:
        app.close()
    results = redis.Redis.from_url(Settings(redis_url=redis_url).result_backend_url() or redis_url)
    try:
        end = time.monotonic() + timeout
        while (raw := results.get(keys.celery_meta(inv.task_id))) is None or json.loads(raw)["status"] not in (
                "SUCCESS", "FAILURE"):
            assert time.monotonic() < end, "the call never ended"
            time.sleep(0.05)
    finally:
        results.close()
    meta = json.loads(raw)
    result = meta["result"]
    if meta["status"] == "FAILURE":  # ToolCallFailed carries the ToolResult
        result = result["exc_message"][0] if isinstance(result.get("exc_message"), list) else result
    return result
