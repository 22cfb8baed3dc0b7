"""Call states: the one vocabulary of the ledger, the worker, the barrier, `toolq status`, the live
view and `--json` (like celery's `states.py`, arq's `JobStatus`).

Every other vocabulary is a mapping from this one, and each mapping lives here: the status
`codex exec --json` shows (`in_progress` / `completed` / `failed`) and the Celery state a call's
task ends in (what Flower filters on). Importable without Celery.
"""

from __future__ import annotations

from enum import Enum


class CallState(str, Enum):
    """Where one call is, from the model's item to its output."""

    #: Bound and valid, waiting for its turn (a serial call waits for the calls before it).
    PENDING = "pending"
    #: Held back by a limit (the turn's cap on calls in flight, a tool's max_concurrency or rate
    #: limit); not sent yet. It waits, never fails for it; its deadline applies as to a queued call.
    THROTTLED = "throttled"
    #: Sent to the queue; no worker has started it yet.
    QUEUED = "queued"
    #: A worker started it.
    RUNNING = "running"
    #: It ran and the tool reported success.
    COMPLETED = "completed"
    #: It ran and failed: a command exited non-zero, a file tool refused, the tool raised.
    FAILED = "failed"
    #: It never ran: unknown tool, bad arguments, a declaration mismatch, already run elsewhere.
    REJECTED = "rejected"
    #: It hit its deadline or time limit and was stopped.
    TIMED_OUT = "timed_out"
    #: Its worker died or vanished mid-call; it may have partially executed.
    LOST = "lost"
    #: Cancelled (`toolq cancel`, Ctrl-C, a revoke from Flower) before it finished.
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self not in _UNFINISHED

    @property
    def failed(self) -> bool:
        """A terminal state the user should see as a failure (everything but COMPLETED)."""
        return self.terminal and self is not CallState.COMPLETED


_UNFINISHED = frozenset({CallState.PENDING, CallState.THROTTLED, CallState.QUEUED, CallState.RUNNING})
TERMINAL = frozenset(s for s in CallState if s.terminal)


def parse_state(value: str | None) -> CallState | None:
    """A state read back from the ledger (None when absent or unknown)."""
    try:
        return CallState(value) if value else None
    except ValueError:
        return None


def codex_status(state: CallState) -> str:
    """The `status` `codex exec --json` gives an item: in_progress, completed or failed.

    Codex marks a command that exited non-zero `failed` (docs/reference/codex-behaviour.md#exec_command), so every
    terminal state but COMPLETED is `failed` there; toolq's own `state` field says which one."""
    if not state.terminal:
        return "in_progress"
    return "completed" if state is CallState.COMPLETED else "failed"


#: Celery states (celery.states) by name, so this module needs no Celery import.
SUCCESS, FAILURE, REVOKED, STARTED = "SUCCESS", "FAILURE", "REVOKED", "STARTED"


def celery_state(state: CallState) -> str:
    """The Celery state a call's task ends in, which is what Flower shows and filters on.

    Only COMPLETED is SUCCESS; every other outcome a worker produces is FAILURE (the task raises
    `ToolCallFailed` carrying the result), so Flower's "Failed" filter lists failed calls."""
    return SUCCESS if state is CallState.COMPLETED else FAILURE
