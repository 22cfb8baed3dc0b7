"""What the orchestrator and the workers must agree on, importable by both without Celery and
without registering any tool: task names, time-limit margins, and how a failed call travels.

The orchestrator → workers edge goes through this module (and `catalog`, `search`) only; it never
imports `toolq.workers.app`, which builds the Celery app.
"""

from __future__ import annotations

from typing import Any

TASK = "toolq.run"
#: Same body, but a call whose worker died is redelivered (only idempotent tools go here).
TASK_IDEMPOTENT = "toolq.run_idempotent"

#: Slack between a tool's own timeout and Celery's hard kill, and above it for redelivery.
TIME_LIMIT_MARGIN = 5.0

#: A call's live output published at most (worker) and shown at most (orchestrator). Each
#: `item.updated` carries all of it so far (Codex's `aggregated_output`), so what a watcher reads
#: grows with its square: 64 KiB keeps a command that prints a line every 100 ms under ~25 MB of
#: `--json` before its stream stops.
STREAM_BYTES = 64 * 1024


def task_name(idempotent: bool) -> str:
    return TASK_IDEMPOTENT if idempotent else TASK


class ToolCallFailed(Exception):
    """Raised by the task when a call did not complete, so Celery records FAILURE (Flower's
    "Failed" filter lists it) while the result, model-visible output included, travels unchanged.

    Celery's JSON result format keeps `exc_type` and `exc_message` (the args): `args[0]` is the
    `ToolResult` as JSON, which `toolq.orchestrator.transport.results` reads back."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result)
        self.result = result

    def __repr__(self) -> str:
        # What Flower's exception column and the worker's log line show: the state and the exit
        # code, never the output (a command may have printed secrets; the ledger has the rest).
        r = self.result
        code = r.get("exit_code")
        return f"ToolCallFailed({r.get('status')}" + (f", exit code {code})" if code not in (None, 0) else ")")

    __str__ = __repr__
