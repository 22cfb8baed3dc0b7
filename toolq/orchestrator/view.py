"""What `toolq run` shows: a live line per call transition, or one JSON event per line.

The JSON events follow `codex exec --json` (`turn.started`, `item.started`/`item.updated`/
`item.completed`, `error`, `turn.completed`/`turn.failed`), with toolq's `tool_call` items.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

_GLYPH = {"queued": "→", "running": "▸", "completed": "✓", "failed": "✗", "aborted": "⊘", "timed_out": "⏱",
          "lost": "!", "rejected": "✗"}


class _View:
    """Writes lines; a reader that went away (`toolq run --json | head`) never breaks the turn."""

    def __init__(self, out: IO[str] = sys.stdout) -> None:
        self.out: IO[str] | None = out

    def write(self, line: str) -> None:
        if self.out is None:
            return
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (BrokenPipeError, ValueError):
            self.out = None  # the turn goes on, unwatched; its outcome is still in the ledger


class JsonView(_View):
    def __call__(self, event: dict[str, Any]) -> None:
        self.write(json.dumps(event, ensure_ascii=False))


class LiveView(_View):
    """One line per transition: glyph, tool, call id, state, duration, worker."""

    _last_error: str | None = None
    """The final error comes as `error` then `turn.failed` (as in Codex's JSON); it is shown once."""

    def __call__(self, event: dict[str, Any]) -> None:
        kind, item = event["type"], event.get("item") or {}
        line: str | None = None
        if kind == "turn.started":
            line = f"toolq turn {event['turn_id']}"
        elif kind.startswith("item.") and item.get("type") == "tool_call":
            line = self._call_line(item)
        elif kind == "item.completed" and item.get("type") == "reasoning":
            line = f"  · thinking: {item['text'][:200]}"
        elif kind == "item.completed" and item.get("type") == "agent_message":
            line = f"\n{item['text']}\n"
        elif kind == "error":
            line = f"  ! {event['message']}"
            self._last_error = event["message"]
        elif kind == "turn.completed":
            u = event.get("usage") or {}
            line = f"turn completed ({u.get('input_tokens', 0)} input / {u.get('output_tokens', 0)} output tokens)"
        elif kind == "turn.failed":
            message = event["error"]["message"]
            line = "turn failed" if message == self._last_error else f"turn failed: {message}"
        elif kind == "turn.aborted":
            line = "turn cancelled"
        if line is not None:
            self.write(line)

    @staticmethod
    def _call_line(item: dict[str, Any]) -> str:
        status = item.get("status", "")
        parts = [f"  {_GLYPH.get(status, '·')} {item['tool']:<16} {item['id']:<24} {status:<9}"]
        if item.get("duration") is not None:
            parts.append(f"{item['duration']:.2f}s")
        if item.get("worker"):
            parts.append(f"on {item['worker']}")
        if item.get("status") in ("failed", "rejected", "lost", "timed_out") and item.get("output"):
            parts.append("— " + item["output"].splitlines()[0][:120])
        return " ".join(parts)
