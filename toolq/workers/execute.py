"""Run one ToolInvocation on a worker: the body of the Celery task, without Celery.

Order matters: cancelled? -> already started elsewhere? -> same declaration? -> workspace
visible? -> run. Every path returns a `ToolResult`; nothing raises to Celery except a kill.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from toolq.core import keys
from toolq.core.calls import CustomPayload, FunctionPayload, ToolInvocation, ToolResult, aborted_text
from toolq.core.catalog import Catalog, ToolContext, ToolReturn, ToolSpec, call_handler, parse_arguments
from toolq.core.errors import RespondToModel, ToolTimedOut
from toolq.core.honest import InfrastructureLost, interrupted, not_run
from toolq.core.items import ToolOutputBody
from toolq.core.settings import workspace_problem
from toolq.core.signing import Signer
from toolq.core.states import TERMINAL, CallState, parse_state
from toolq.core.truncate import bound_output
from toolq.workers import permit, spans
from toolq.workers.environments import agent as environments
from toolq.workers.environments.host import update_record
from toolq.workers.processes import CallCancelled
from toolq.workers.streaming import OutputStream

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


def cancel_check(r: redis.Redis, inv: ToolInvocation) -> Callable[[], bool]:
    """What a running tool polls (`ctx.cancelled`). Redis away means no cancel can be heard, not
    that the tool failed: the tool runs on (a revoke still kills it) and its result is its output.
    Raising here ended commands that had run as "failed: ConnectionError" (the fault campaign)."""
    warned = False

    def check() -> bool:
        nonlocal warned
        try:
            return is_cancelled(r, inv)
        except redis.RedisError as e:
            if not warned:
                warned = True
                log.warning("%s %s runs on without hearing cancels: Redis does not answer (%s)",
                            inv.call_id, inv.tool_name, e)
            return False

    return check


def tool_result(inv: ToolInvocation, output: ToolOutputBody, status: CallState, hostname: str,
                **kw: Any) -> ToolResult:
    """How a call ended, as the worker that ran it (or refused it) says it: ends now."""
    now = time.time()
    return ToolResult(call_id=inv.call_id, output=output, status=status, worker=hostname,
                      started_at=kw.pop("started_at", now), finished_at=now, **kw)


def _result(inv: ToolInvocation, output: ToolOutputBody, status: CallState, hostname: str, **kw: Any) -> dict:
    return tool_result(inv, output, status, hostname, **kw).model_dump(mode="json")


async def run_in_process(inv: ToolInvocation, spec: ToolSpec | None, catalog: Catalog, hostname: str) -> ToolResult:
    """One call in this process, through the worker's checks and handler call but no queue (the
    in-memory transport, `toolq.testing`)."""
    started = time.time()
    state, output, extra = refusal(inv, spec, hostname) or await call_tool(inv, spec, catalog)  # type: ignore[arg-type]
    return tool_result(inv, output, state, hostname, started_at=started, **extra)


# KEYS: turn cancel, call cancel, started marker, call record. ARGV: hostname, ttl, started_at, pid, state.
# Returns {cancelled, first delivery, previous state, previous worker, previous pid}.
_START = """
local cancelled = redis.call('EXISTS', KEYS[1], KEYS[2])
local first = redis.call('SET', KEYS[3], ARGV[1], 'NX', 'EX', ARGV[2]) and 1 or 0
local prev = redis.call('HMGET', KEYS[4], 'state', 'worker', 'pid')
if first == 1 and cancelled == 0 then
    redis.call('HSET', KEYS[4], 'state', ARGV[5], 'worker', ARGV[1], 'started_at', ARGV[3], 'pid', ARGV[4])
    redis.call('EXPIRE', KEYS[4], ARGV[2])
end
return {cancelled, first, prev[1], prev[2], prev[3]}
"""


class StillRunning(Exception):
    """A second delivery of a call whose first one still runs: acked with no result (Celery's Ignore)."""


def _still_running(r: redis.Redis, worker: str, pid: bytes | None, hostname: str) -> bool:
    """Whether the worker that started the call may still be running it: on this node, its pool
    child is alive; elsewhere, the fleet catalog lists a live instance under its name."""
    if worker == hostname:
        try:
            os.kill(int(pid or b"0"), 0)
            return int(pid or b"0") > 0
        except (OSError, ValueError):
            return False
    ids = [keys.text(i) for i in r.smembers(keys.FLEET_WORKERS)]
    for raw in r.mget([keys.fleet_worker(i) for i in ids]) if ids else []:
        try:
            if raw is not None and json.loads(raw).get("hostname") == worker:
                return True
        except (ValueError, AttributeError):
            continue
    return False


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


#: How long the end of a call is retried while Redis is away (a Sentinel failover takes seconds;
#: the result store behind it retries too). Past it the ledger keeps saying `running`.
RECORD_END_FOR = 10.0


def _record_end(r: redis.Redis, inv: ToolInvocation, status: CallState) -> None:
    """The call ran: its result is its output even when the ledger cannot hear of it (Redis
    restarting). Raising here answered a call that had completed as `failed` (the fault campaign);
    one try left a call that completed during a failover `running` in `toolq status` for good."""
    end, delay = time.monotonic() + RECORD_END_FOR, 0.1
    while True:
        try:
            _set_state(r, inv, state=status, finished_at=time.time())
            return
        except redis.RedisError as e:
            if time.monotonic() + delay > end:
                log.warning("%s %s ended %s, but Redis could not record it (%s); its result is returned",
                            inv.call_id, inv.tool_name, status, e)
                return
        try:
            time.sleep(delay)
        except Exception:  # the task's soft time limit: the result goes back unrecorded, not lost
            return
        delay = min(delay * 2, 1.0)


def execute(raw: dict, *, hostname: str, r: redis.Redis, catalog: Catalog, redelivery: bool = False,
            time_limit_errors: tuple[type[BaseException], ...] = (), signer: Signer | None = None) -> dict:
    """`time_limit_errors`: what the pool raises inside a tool at its soft time limit. `signer`
    seals the batches of a call that streams its output."""
    picked_at = time.time()
    inv = ToolInvocation.model_validate(raw)
    spec = catalog.get(inv.tool_name)
    if spans.begin_call(inv):  # tracing on: this call's spans hang under its signed invocation's
        spans.queue_wait(inv, picked_at)
    try:
        started = _start(inv, spec, r, hostname, redelivery)
    except redis.RedisError as e:  # nothing ran: say so, never the exception's name as the tool's failure
        log.warning("%s %s not run: Redis did not answer as it started (%s)", inv.call_id, inv.tool_name, e)
        return _result(inv, not_run(inv.tool_name, f"the worker lost Redis as it started the call ({e})"),
                       CallState.REJECTED, hostname, success=False)
    if isinstance(started, dict):
        return started
    started_at = started

    touch_environment(r, inv)
    # DEBUG: Celery's own lines (received, succeeded in) say as much at INFO, once per call.
    log.debug("→ %s %s started on %s", inv.call_id, inv.tool_name, hostname)
    stream = output_stream(inv, spec, r, signer)
    try:
        with spans.tool(inv, spec is not None, hostname) as span:
            status, output, extra = run_invocation(inv, spec, catalog, hostname, cancel_check(r, inv),
                                                   time_limit_errors, stream)
            spans.ended(span, status)
        if stream is not None:  # what a tool wrote last goes out before its result
            stream.flush()
        _record_end(r, inv, status)
    finally:
        if inv.permit is not None:  # after finished_at is written: the next holder starts after it
            permit.release(r, inv)
    log.debug("← %s %s %s in %.3fs", inv.call_id, inv.tool_name, status, time.time() - started_at)
    return _result(inv, output, status, hostname, started_at=started_at, **extra)


def _start(inv: ToolInvocation, spec: ToolSpec | None, r: redis.Redis, hostname: str,
           redelivery: bool) -> float | dict:
    """Everything before the handler runs: the start time, or the result of a call not to run.
    A Redis error raised from here means the tool never started (`execute` says so)."""
    # One round trip on every call's path: cancelled? first delivery? then mark it started.
    started_at = time.time()
    cancelled, first, prev_state, prev_worker, prev_pid = r.register_script(_START)(
        keys=[keys.cancel_turn(inv.turn_id), keys.cancel_call(inv.task_id), keys.started(inv.task_id),
              keys.call(inv.task_id)],
        args=[hostname, keys.RECORD_TTL, started_at, os.getpid(), CallState.RUNNING.value],
    )
    prev_state = (prev_state or b"").decode()
    prev_worker = keys.worker_name(prev_worker)

    if cancelled:
        _set_state(r, inv, state=CallState.CANCELLED, worker=hostname, finished_at=time.time())
        log.info("⊘ %s %s cancelled before start", inv.call_id, inv.tool_name)
        return _result(inv, aborted_text(spec is not None and spec.shell_like, 0.0), CallState.CANCELLED, hostname,
                       success=False)

    # At most once: a message redelivered after its worker died must not run a second time,
    # unless the tool is idempotent (and then only up to MAX_DELIVERIES).
    if not first:
        if not _may_redeliver(spec, redelivery):
            r.hincrby(keys.call(inv.task_id), "deliveries_refused", 1)
            if parse_state(prev_state) in TERMINAL - {CallState.LOST}:
                log.warning("↺ %s %s delivered again after it finished on %s; not run again",
                            inv.call_id, inv.tool_name, prev_worker)
                return _result(inv, f"this call already ran on worker {prev_worker}; it was not run again",
                               CallState.REJECTED, hostname, success=False)
            if parse_state(prev_state) is CallState.RUNNING and _still_running(r, prev_worker, prev_pid, hostname):
                # Redelivered while the first delivery runs on (a Redis restart with AOF restores the
                # unacked message): its own result is the call's output; this copy says nothing.
                log.warning("↺ %s %s delivered again while it runs on %s; not run again, no result",
                            inv.call_id, inv.tool_name, prev_worker)
                raise StillRunning(prev_worker)
            _set_state(r, inv, state=CallState.LOST, finished_at=time.time())
            return _result(
                inv,
                f"this call was already started by worker {prev_worker}, which was lost; it was not run again "
                "because the tool is not idempotent (it may have partially executed)",
                CallState.LOST, hostname, success=False,
            )
        _set_state(r, inv, state=CallState.RUNNING, worker=hostname, started_at=started_at, pid=os.getpid())
        deliveries = r.incr(keys.attempts(inv.task_id))
        if deliveries >= MAX_DELIVERIES:
            return _result(inv, f"gave up after {deliveries} deliveries: the worker died each time", CallState.FAILED,
                           hostname, success=False)

    if inv.permit is not None:  # limits hook (toolq/workers/permit.py): the max_concurrency permit
        waited = permit.confirm(r, inv, on_wait=lambda: _set_state(r, inv, state=CallState.THROTTLED))
        if waited is None:
            _set_state(r, inv, state=CallState.TIMED_OUT, finished_at=time.time())
            return _result(inv, f"call stopped: the turn's deadline passed while it waited for a max_concurrency "
                                f"permit of {inv.permit.tool}; it was not run", CallState.TIMED_OUT, hostname,
                           success=False)
        if waited:  # it starts now, not when it was taken off the queue
            started_at = time.time()
            _set_state(r, inv, state=CallState.RUNNING, started_at=started_at)
    return started_at


def output_stream(inv: ToolInvocation, spec: ToolSpec | None, r: redis.Redis,
                  signer: Signer | None) -> OutputStream | None:
    """Where the call's output streams while it runs, if its turn is watched and its declaration
    streams (toolq/workers/streaming.py)."""
    if not inv.stream_output or signer is None or spec is None or not spec.streams_output:
        return None
    return OutputStream(r.publish, signer, inv.task_id, keys.call_output(inv.task_id))


Outcome = tuple[CallState, Any, dict[str, Any]]
"""(state, model-visible output, further `ToolResult` fields)"""


def run_invocation(inv: ToolInvocation, spec: ToolSpec | None, catalog: Catalog, hostname: str,
                   is_cancelled: Callable[[], bool] = lambda: False,
                   time_limit_errors: tuple[type[BaseException], ...] = (),
                   output: OutputStream | None = None) -> Outcome:
    """Check the call against this worker, then run its handler (a pool child runs one at a time)."""
    refused = refusal(inv, spec, hostname)
    if refused is not None:
        return refused
    assert spec is not None
    return _event_loop().run_until_complete(call_tool(inv, spec, catalog, is_cancelled, time_limit_errors, output))


def refusal(inv: ToolInvocation, spec: ToolSpec | None, hostname: str) -> Outcome | None:
    """Why this worker must not run the call (not loaded, declared differently, no workspace), if so."""
    if spec is None:
        not_loaded = f"tool {inv.tool_name} is not loaded on worker {hostname}; not run"
        return CallState.REJECTED, not_loaded, {"success": False}
    if spec.digest() != inv.spec_digest:
        return CallState.REJECTED, (
            f"tool {inv.tool_name} is declared differently on worker {hostname} than in the orchestrator "
            f"(declaration {spec.digest()} != {inv.spec_digest}); not run. Load the same tool modules on both sides."
        ), {"success": False}
    if inv.environment is not None and (refused := environment_refusal(inv, hostname)):
        return CallState.REJECTED, refused, {"success": False}
    workspace = workspace_of(inv)
    # Checked here too, where the call runs: the orchestrator checked the path when the turn began,
    # and a symlink put there since (or a forged resumed turn) led the commands into /etc.
    if problem := workspace_problem(workspace, must_exist=False):
        return CallState.REJECTED, f"{problem}; not run on worker {hostname}", {"success": False}
    if not workspace.is_dir():
        return CallState.REJECTED, (
            f"workspace {workspace} is not visible on worker {hostname}; not run. "
            "Workers must share the workspace (same host or a shared volume)."
        ), {"success": False}
    return None


def workspace_of(inv: ToolInvocation) -> Path:
    """Where the call runs: its environment's workspace on this host, else the shared workspace."""
    if inv.environment is not None:
        envs = environments.current()
        if envs is not None:
            return envs.path(inv.environment.id)
    return Path(inv.workspace or os.getcwd())


#: A call of an environment touches its record's `used_at` (its idle limit) at most this often.
TOUCH_EVERY = 10.0
_touched: dict[str, float] = {}


def environment_refusal(inv: ToolInvocation, hostname: str) -> str | None:
    """Why the call cannot run in its environment here (another host's, or not here), if so."""
    assert inv.environment is not None
    env = inv.environment
    envs = environments.current()
    if envs is None:
        return not_run(inv.tool_name, f"environment {env.id} is on host {env.host}, and worker {hostname} serves "
                                      "no environments")
    if env.host != envs.host:
        return not_run(inv.tool_name, f"environment {env.id} is on host {env.host}, not on this worker's host "
                                      f"{envs.host} (worker {hostname})")
    if not envs.present(env.id):
        return not_run(inv.tool_name, f"environment {env.id} is not present on host {envs.host} (destroyed, or "
                                      "lost with its host's disk)")
    return None


def touch_environment(r: redis.Redis, inv: ToolInvocation) -> None:
    """Keep the environment from its idle limit: its record's `used_at`, now and then."""
    if inv.environment is None:
        return
    now = time.monotonic()
    if now - _touched.get(inv.environment.id, -TOUCH_EVERY) < TOUCH_EVERY:
        return
    _touched[inv.environment.id] = now
    try:
        update_record(r, inv.environment.id, used_at=time.time())
    except redis.RedisError:
        pass  # the idle limit is hours; the next call tries again


async def call_tool(inv: ToolInvocation, spec: ToolSpec, catalog: Catalog,
                    is_cancelled: Callable[[], bool] = lambda: False,
                    time_limit_errors: tuple[type[BaseException], ...] = (),
                    stream: OutputStream | None = None) -> Outcome:
    """Parse the arguments and run the handler; every error becomes an outcome the model can read.
    The output is cut to what history keeps here, on the worker, so it travels bounded (built-in,
    user and MCP tools alike), unless the tool declares `whole_output` (it bounds its own).

    Shared by the worker and the in-memory fleet (`toolq.testing`), so a test sees what a worker would."""
    state, output, extra = await _run_handler(inv, spec, catalog, is_cancelled, time_limit_errors, stream)
    return state, output if spec.whole_output else bound_output(output), extra


async def _run_handler(inv: ToolInvocation, spec: ToolSpec, catalog: Catalog, is_cancelled: Callable[[], bool],
                       time_limit_errors: tuple[type[BaseException], ...], stream: OutputStream | None) -> Outcome:
    started_at = time.time()
    workspace = workspace_of(inv)
    ctx = ToolContext(invocation=inv, workspace=workspace, is_cancelled=is_cancelled, catalog=catalog, output=stream)
    try:
        if isinstance(inv.payload, FunctionPayload):
            args: Any = parse_arguments(spec, inv.payload.arguments)
        elif isinstance(inv.payload, CustomPayload):
            args = inv.payload.input
        else:
            args = inv.payload
        value = await call_handler(spec, args, ctx)
    except RespondToModel as e:
        return CallState.FAILED, e.message, {"success": False}
    except CallCancelled:
        return CallState.CANCELLED, aborted_text(spec.shell_like, time.time() - started_at), {"success": False}
    except ToolTimedOut as e:  # the tool's own limit (an MCP call's tool_timeout_sec)
        return CallState.TIMED_OUT, e.message, {"success": False}
    except InfrastructureLost as e:  # toolq's own plumbing lost the call, not the tool's failure
        log.warning("%s %s: %s", inv.call_id, inv.tool_name, e.what)
        if e.started:
            return CallState.LOST, interrupted(inv.tool_name, e.what), {"success": False}
        return CallState.REJECTED, not_run(inv.tool_name, e.what), {"success": False}
    except time_limit_errors:
        return CallState.TIMED_OUT, ToolTimedOut(spec.timeout).message, {"success": False}
    except Exception as e:  # a tool's own bug still becomes an output the model can read
        log.error("tool %s raised:\n%s", inv.tool_name, traceback.format_exc())
        return CallState.FAILED, f"tool {inv.tool_name} failed: {type(e).__name__}: {e}", {"success": False}
    if isinstance(value, ToolReturn):
        # A tool that says it did not succeed (a command exiting non-zero) failed: the user sees
        # it so, and Flower lists it; the model reads the same output either way.
        state = CallState.COMPLETED if value.success else CallState.FAILED
        return state, value.output, {"success": value.success, "exit_code": value.exit_code, "tools": value.tools}
    return CallState.COMPLETED, value, {"success": True}
