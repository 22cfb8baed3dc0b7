"""What `toolq run` shows: a live line per call transition, or one JSON event per line.

The JSON events follow `codex exec --json` (`turn.started`, `item.started`/`item.updated`/
`item.completed`, `error`, `turn.completed`/`turn.failed`), with toolq's `tool_call` items; the
events are typed in `toolq.orchestrator.turn_events`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import IO

from toolq.cli.terminal import json_line, printable
from toolq.core.states import CallState
from toolq.orchestrator.turn_events import (
    AgentMessageView,
    CommandExecutionView,
    ErrorEvent,
    ItemCompleted,
    ItemUpdated,
    ReasoningView,
    ToolCallView,
    TurnAborted,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnStarted,
)

#: A running command's last output lines the live view shows at each update, each cut to a line.
LAST_LINES = 3
LINE_CHARS = 200

_GLYPH = {CallState.PENDING: "·", CallState.THROTTLED: "‖", CallState.QUEUED: "→", CallState.RUNNING: "▸",
          CallState.COMPLETED: "✓", CallState.FAILED: "✗", CallState.REJECTED: "✗", CallState.TIMED_OUT: "⏱",
          CallState.LOST: "!", CallState.CANCELLED: "⊘"}


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
        except (OSError, ValueError):  # a closed pipe, or a hung-up terminal (EIO after SIGHUP)
            self.out = None  # the turn goes on, unwatched; its outcome is still in the ledger


class JsonView(_View):
    def __call__(self, event: TurnEvent) -> None:
        self.write(json_line(event.to_json()))


class LiveView(_View):
    """One line per transition: glyph, tool, call id, state, durations, worker, why it failed."""

    _last_error: str | None = None
    """The final error comes as `error` then `turn.failed` (as in Codex's JSON); it is shown once."""

    def __init__(self, out: IO[str] = sys.stdout) -> None:
        super().__init__(out)
        self._commands: dict[str, _Shown] = {}

    def write(self, line: str) -> None:
        super().write(printable(line))  # the model's and the tools' words: no escape reaches the terminal

    def __call__(self, event: TurnEvent) -> None:
        line: str | None = None
        item = getattr(event, "item", None)
        if isinstance(event, TurnStarted):
            line = f"toolq turn {event.turn_id}"
        elif isinstance(item, CommandExecutionView):
            self._command(event, item)
        elif isinstance(item, ToolCallView):
            line = self._call_line(item)
        elif isinstance(event, ItemCompleted) and isinstance(item, ReasoningView):
            line = f"  · thinking: {item.text[:200]}"
        elif isinstance(event, ItemCompleted) and isinstance(item, AgentMessageView):
            line = f"\n{item.text}\n"
        elif isinstance(event, ErrorEvent):
            line = f"  ! {event.message}"
            self._last_error = event.message
        elif isinstance(event, TurnCompleted):
            u = event.usage
            line = f"turn completed ({u.get('input_tokens', 0)} input / {u.get('output_tokens', 0)} output tokens)"
        elif isinstance(event, TurnFailed):
            message = event.error.message
            line = "turn failed" if message == self._last_error else f"turn failed: {message}"
        elif isinstance(event, TurnAborted):
            line = "turn cancelled"
        if line is not None:
            self.write(line)

    def _command(self, event: TurnEvent, item: CommandExecutionView) -> None:
        """A command: its line at each transition, its command line once, then its last output lines
        as they come (an update that only brings output prints only those)."""
        seen = self._commands.setdefault(item.id, _Shown())
        if item.state is not seen.state or not isinstance(event, ItemUpdated):
            self.write(self._call_line(item))
        if not seen.command_shown and item.command:  # a write_stdin's is known once it is routed
            self.write(f"    $ {_cut(item.command)}")
            seen.command_shown = True
        seen.state = item.state
        if item.state.terminal:
            self._commands.pop(item.id, None)
            return
        new = item.aggregated_output[seen.shown:]
        seen.shown = len(item.aggregated_output)
        who = f"{item.id} " if len(self._commands) > 1 else ""  # parallel commands: whose line it is
        for text in new.splitlines()[-LAST_LINES:]:
            self.write(f"    {who}│ {_cut(text)}")

    @staticmethod
    def _call_line(item: ToolCallView) -> str:
        parts = [f"  {_GLYPH.get(item.state, '·')} {item.tool:<16} {item.id:<24} {item.state.value:<9}"]
        if item.run_time is not None:
            parts.append(f"ran {_secs(item.run_time)}")
        elif item.round_trip is not None:  # decided by the orchestrator: how long it took to say so
            parts.append(f"after {_secs(item.round_trip)}")
        if item.queue_wait is not None and item.queue_wait >= 0.1:  # only when the queue held it up
            parts.append(f"waited {_secs(item.queue_wait)}")
        if item.worker:
            parts.append(f"on {item.worker}")
        if item.reason:
            parts.append("— " + item.reason)
        return " ".join(parts)


@dataclass
class _Shown:
    """What the live view has shown of a running command."""

    state: CallState | None = None
    shown: int = 0
    command_shown: bool = False


def _cut(text: str) -> str:
    """One line fit for the user's terminal: a command's output is untrusted, and an escape
    sequence in it must not move the cursor, retitle the window or rewrite what was shown."""
    text = printable(text, lines=False)
    return text if len(text) <= LINE_CHARS else text[:LINE_CHARS - 1] + "…"


def _secs(s: float) -> str:
    return f"{s:.2f}s" if s >= 1 else f"{s * 1000:.0f}ms"
