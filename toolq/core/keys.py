"""Every Redis key and channel toolq uses, in one place (like arq's `constants.py`).

Celery's own keys (`celery-task-meta-<task id>`) belong to Celery; these are ours. All are
written by the orchestrator, the workers and `toolq cancel`, so they must agree.
"""

import re
from collections.abc import Mapping

PREFIX = "toolq"


def text(raw: object) -> str:
    """A key or value as Redis gave it (bytes: toolq's clients do not decode), as text. (redis-py
    types every reply as any of its shapes; a member or a field is one of these two.)"""
    if isinstance(raw, bytes):
        return raw.decode()
    if isinstance(raw, str):
        return raw
    raise TypeError(f"expected a Redis string, got {type(raw).__name__}")


def record(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A HASH as Redis gave it (HGETALL), as text."""
    return {text(k): text(v) for k, v in raw.items()}


def worker_name(raw: bytes | str | None) -> str:
    """A worker name read back from the ledger, fit to quote in an output. The ledger is unsigned:
    whoever reaches Redis could write a sentence there for the model to read."""
    name = raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")
    return name if _WORKER_NAME.fullmatch(name) else "?"


_WORKER_NAME = re.compile(r"[\w.@:%+-]{1,200}")


#: ZSET of turn ids scored by start time, for `toolq turns`.
TURNS = f"{PREFIX}:turns"

#: Celery result meta: the backend publishes each state change on a channel of the same name.
CELERY_META = "celery-task-meta-"


def turn(turn_id: str) -> str:
    """HASH: the turn's own record (state, started_at, finished_at, prompt, error)."""
    return f"{PREFIX}:turn:{turn_id}"


def turn_calls(turn_id: str) -> str:
    """LIST of the turn's task ids in dispatch order."""
    return f"{PREFIX}:turn:{turn_id}:calls"


def turn_items(turn_id: str) -> str:
    """LIST of the turn's committed items and outputs as they happened (JSON), for `toolq resume`."""
    return f"{PREFIX}:turn:{turn_id}:items"


def turn_lease(turn_id: str) -> str:
    """STRING with a TTL: the token of the orchestrator driving the turn; lapses when it dies."""
    return f"{PREFIX}:turn:{turn_id}:lease"


def turn_steps(turn_id: str) -> str:
    """Counter of the turn's steps handed out by the ledger (task ids embed the step)."""
    return f"{PREFIX}:turn:{turn_id}:steps"


def call(task_id: str) -> str:
    """HASH: one call's ledger record (call_id, tool, state, worker, times)."""
    return f"{PREFIX}:call:{task_id}"


def call_ids(turn_id: str) -> str:
    """HASH call_id -> space-separated task ids (two calls may share a call_id)."""
    return f"{PREFIX}:turn:{turn_id}:call_ids"


def started(task_id: str) -> str:
    """STRING set once, NX, by the first worker to start the call (at-most-once guard)."""
    return f"{PREFIX}:started:{task_id}"


def attempts(task_id: str) -> str:
    """Counter of deliveries for idempotent calls (redelivery cap)."""
    return f"{PREFIX}:attempts:{task_id}"


def cancel_turn(turn_id: str) -> str:
    """The durable cancel record of a turn: workers check it before starting a call."""
    return f"{PREFIX}:cancel:{turn_id}"


def cancel_call(task_id: str) -> str:
    """The durable cancel record of one call."""
    return f"{PREFIX}:cancel-call:{task_id}"


def cancel_channel(turn_id: str) -> str:
    """Pub/sub channel: the orchestrator running the turn hears cancels here at once."""
    return f"{PREFIX}:cancel-events:{turn_id}"


#: One pattern subscription per runtime hears every turn's cancel (cancel_listener.py).
CANCEL_CHANNELS = cancel_channel("*")


def draining(hostname: str) -> str:
    """STRING set while a worker is in warm shutdown: it finishes its calls but stops answering
    pings, so the watchdog must not call them lost."""
    return f"{PREFIX}:draining:{hostname}"


#: Pub/sub channels of running calls' output (toolq/workers/streaming.py), one per task id.
CALL_OUTPUT = f"{PREFIX}:output:"


def call_output(task_id: str) -> str:
    return f"{CALL_OUTPUT}{task_id}"


def call_output_pattern(turn_id: str) -> str:
    """Like the result metas: one pattern per turn covers its calls' output channels."""
    return f"{CALL_OUTPUT}{turn_id}:*"


def celery_meta(task_id: str) -> str:
    return f"{CELERY_META}{task_id}"


def celery_meta_pattern(turn_id: str) -> str:
    """One pattern subscription per turn covers all its calls (task ids start with the turn id)."""
    return f"{CELERY_META}{turn_id}:*"


#: How long ledger and cancel records live: well beyond any turn.
RECORD_TTL = 7 * 24 * 3600


# --- the fleet catalog: what each live worker serves (toolq/workers/presence.py writes it) ---

#: SET of worker instance ids that have advertised; an id whose record expired is pruned by readers.
FLEET_WORKERS = f"{PREFIX}:fleet:workers"


def fleet_worker(instance: str) -> str:
    """STRING (JSON `WorkerAdvert`) with a TTL the worker's heartbeat refreshes: one process instance."""
    return f"{PREFIX}:fleet:worker:{instance}"


def fleet_tool(digest: str) -> str:
    """STRING (JSON `ToolAdvert`): one tool declaration, addressed by its digest, shared by every
    worker that serves it; refreshed by their heartbeats like their own records."""
    return f"{PREFIX}:fleet:tool:{digest}"


# --- limits across the fleet (toolq/core/permits.py, limits.py) ---


def limit_holders(tool: str) -> str:
    """ZSET of task ids holding one of the tool's max_concurrency permits, scored by lease expiry (ms)."""
    return f"{PREFIX}:limit:{tool}:holders"


def limit_starts(tool: str) -> str:
    """ZSET of task ids started within the tool's rate-limit window, scored by start time (ms)."""
    return f"{PREFIX}:limit:{tool}:starts"


#: Pub/sub channel: a permit was released (the message is the tool); waiting orchestrators retry.
LIMIT_RELEASED = f"{PREFIX}:limit-released"
