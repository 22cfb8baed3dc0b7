"""A task's return value whose JSON is the full result but whose repr is only its status and sizes.

Celery stores a task's return value as JSON (the orchestrator reads the whole `ToolResult`
from there), but its task-succeeded log line at INFO and the task-succeeded event that Flower
shows as the task's result both carry `saferepr(return value)`. Tool output may hold secrets a
command printed, so by default that repr says what happened, not what was printed; kombu's JSON
encoder calls `__json__` for the stored copy. `TOOLQ_LOG_TOOL_OUTPUT=1` returns the plain dict.
"""

from __future__ import annotations

from typing import Any


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Status and sizes of a `ToolResult` dump: what a log line or Flower may show."""
    out = result.get("output")
    if isinstance(out, str):
        size: dict[str, Any] = {"output_chars": len(out)}
    else:
        parts = out if isinstance(out, list) else []
        size = {"output_parts": len(parts),
                "output_chars": sum(len(p.get("text") or "") for p in parts if isinstance(p, dict))}
    brief = {k: result.get(k) for k in ("status", "success", "exit_code") if result.get(k) is not None}
    if result.get("tools") is not None:
        size["tools"] = len(result["tools"])
    return {**brief, **size}


class Summarised:
    """Stored as `result` (JSON), shown as `summary(result)` (repr)."""

    __slots__ = ("result",)

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result

    def __json__(self) -> dict[str, Any]:
        return self.result

    def __repr__(self) -> str:
        return repr(summary(self.result))


def returned(result: dict[str, Any], log_output: bool) -> dict[str, Any] | Summarised:
    """What the task returns: the dict itself only when the operator asked to see output."""
    return result if log_output else Summarised(result)
