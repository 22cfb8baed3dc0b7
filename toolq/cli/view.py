"""What `toolq run` shows: a live line per call transition, or one JSON event per line.

The JSON events follow `codex exec --json` (`turn.started`, `item.started`/`item.updated`/
`item.completed`, `error`, `turn.completed`/`turn.failed`), with toolq's `tool_call` items; the
events are typed in `toolq.orchestrator.turn_events`. The live view goes to stderr (stdout holds
the final message alone, as `codex exec` does); on a terminal its last line says which calls are
running and for how long, redrawn each second (`LiveView.tick`).
"""

from __future__ import annotations

import os
import re
import sys
import time
import unicodedata
from collections.abc import Callable
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
#: A finished command's output not shown yet: all of it up to this many lines, else a line that
#: counts the rest and the last lines (`codex exec` shows each command's output, cut, as it ends).
FINAL_LINES = 6
#: The tool column: this wide, wider (up to TOOL_CHARS) once a longer name (an MCP server's
#: `server.tool`) has been shown; a name longer still is cut in its namespace, not its own name.
TOOL_WIDTH = 16
TOOL_CHARS = 32
#: A running command with no new output for this long says so in the status line.
QUIET_SECS = 10.0
#: How often `toolq run` redraws the status line (on a terminal only).
TICK_SECS = 1.0

_GLYPH = {CallState.PENDING: "·", CallState.THROTTLED: "‖", CallState.QUEUED: "→", CallState.RUNNING: "▸",
          CallState.COMPLETED: "✓", CallState.FAILED: "✗", CallState.REJECTED: "✗", CallState.TIMED_OUT: "⏱",
          CallState.LOST: "!", CallState.CANCELLED: "⊘"}
BACKGROUND_GLYPH = "⟳"
#: Back to the start of the line and erase it: the status line goes before any other line is written.
_ERASE = "\r\x1b[K"
#: The status line of exec_command's answer (`workers/exec_output.py`) for a process left running.
_SESSION_LINE = re.compile(r"^Process running with session ID (\d+)$", re.MULTILINE)


class _View:
    """Writes lines; a reader that went away (`toolq run --json | head`) never breaks the turn."""

    def __init__(self, out: IO[str] = sys.stdout) -> None:
        self.out: IO[str] | None = out

    def write(self, line: str) -> None:
        self._put(line + "\n")

    def _put(self, text: str) -> None:
        if self.out is None:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):  # a closed pipe, or a hung-up terminal (EIO after SIGHUP)
            self.out = None  # the turn goes on, unwatched; its outcome is still in the ledger


class JsonView(_View):
    def __call__(self, event: TurnEvent) -> None:
        self.write(json_line(event.to_json()))


class LiveView(_View):
    """One line per transition: glyph, tool, call id, state, durations, worker, why it failed. On
    a terminal (`tty`) a last line, redrawn by `tick`, gives each running call's elapsed time;
    elsewhere (a log file, a pipe) nothing is written but the transitions."""

    _last_error: str | None = None
    """The final error comes as `error` then `turn.failed` (as in Codex's JSON); it is shown once."""

    def __init__(self, out: IO[str] | None = None, *, tty: bool | None = None,
                 clock: Callable[[], float] = time.time, columns: int | None = None) -> None:
        out = sys.stderr if out is None else out
        super().__init__(out)
        self.tty = _isatty(out) if tty is None else tty
        self._clock = clock
        self._columns = columns
        self._commands: dict[str, _Shown] = {}
        self._running: dict[str, _Running] = {}
        self._tool_width = TOOL_WIDTH
        self._status_shown = False
        self._last_about: str | None = None

    def write(self, line: str, about: str | None = None) -> None:
        """`about`: the call the line is about, if any (a command's output lines say whose they are
        when the line above is another's)."""
        self._last_about = about
        line = printable(line)  # the model's and the tools' words: no escape reaches the terminal
        if not self.tty:
            return super().write(line)
        status = self.status_line()
        self._put((_ERASE if self._status_shown else "") + line + "\n" + (status or ""))
        self._status_shown = bool(status)

    def tick(self) -> None:
        """Redraw the status line (on a terminal; elsewhere nothing, so a log holds no ticks)."""
        if not self.tty:
            return
        status = self.status_line()
        if status or self._status_shown:
            self._put(_ERASE + (status or ""))
        self._status_shown = bool(status)

    def close(self) -> None:
        """Erase the status line, so what follows (the final message on stdout) starts clean."""
        if self._status_shown:
            self._put(_ERASE)
            self._status_shown = False

    def status_line(self, now: float | None = None) -> str | None:
        """The running calls, each with how long it has run (and a command, how long it has been
        quiet), cut to the terminal's width; None when no call runs."""
        if not self._running:
            return None
        now = self._clock() if now is None else now
        parts = []
        for call_id, r in self._running.items():
            part = f"{_one_line(r.tool)} {_one_line(call_id)} {_elapsed(now - r.since)}"
            if r.command and now - r.active >= QUIET_SECS:
                part += f" (no output for {_elapsed(now - r.active)})"
            parts.append(part)
        return _fit_width(f"  {_GLYPH[CallState.RUNNING]} " + " · ".join(parts), self._width() - 1)

    def __call__(self, event: TurnEvent) -> None:
        line: str | None = None
        item = getattr(event, "item", None)
        if isinstance(item, ToolCallView):
            self._track(event, item)
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
        if isinstance(event, TurnCompleted | TurnFailed | TurnAborted):
            self._running.clear()  # the turn is over: nothing is shown as running any more
        if line is not None:
            self.write(line)

    def _track(self, event: TurnEvent, item: ToolCallView) -> None:
        """When each running call started running, and a command's output last grew."""
        if item.state is not CallState.RUNNING:
            self._running.pop(item.id, None)
            return
        running = self._running.setdefault(item.id, _Running(item.tool, event.timestamp, event.timestamp,
                                                             isinstance(item, CommandExecutionView)))
        if isinstance(item, CommandExecutionView) and len(item.aggregated_output) != running.output:
            running.output, running.active = len(item.aggregated_output), event.timestamp

    def _command(self, event: TurnEvent, item: CommandExecutionView) -> None:
        """A command: its line at each transition, its command line once, then its last output lines
        as they come (an update that only brings output prints only those), and as it ends what
        of its output was not shown yet, cut."""
        seen = self._commands.setdefault(item.id, _Shown())
        session = background_session(item)
        if session is not None:
            self.write(self._call_line(item, glyph=BACKGROUND_GLYPH, state="background",
                                       note=f"session {session} runs on in the background"), item.id)
        elif item.state is not seen.state or not isinstance(event, ItemUpdated):
            self.write(self._call_line(item), item.id)
        if not seen.command_shown and item.command:  # a write_stdin's is known once it is routed
            self.write(f"    $ {_cut(item.command)}", item.id)
            seen.command_shown = True
        seen.state = item.state
        # Whose output it is, when other commands run or the line above is not this command's.
        alone = len(self._commands) == 1 and self._last_about == item.id
        who = "" if alone else f"{_one_line(item.id)} "
        if item.state.terminal:
            self._commands.pop(item.id, None)
            for text in _final_lines(seen.streamed, item.aggregated_output):
                self.write(f"    {who}│ {text}", item.id)
            return
        new = item.aggregated_output[len(seen.streamed):]
        seen.streamed = item.aggregated_output
        for text in new.splitlines()[-LAST_LINES:]:
            self.write(f"    {who}│ {_cut(text)}", item.id)

    def _call_line(self, item: ToolCallView, *, glyph: str | None = None, state: str | None = None,
                   note: str | None = None) -> str:
        tool = _tool_name(_one_line(item.tool))
        self._tool_width = max(self._tool_width, len(tool))
        parts = [f"  {glyph or _GLYPH.get(item.state, '·')} {tool:<{self._tool_width}} {_one_line(item.id):<24} "
                 f"{state or item.state.value:<9}"]
        if item.run_time is not None:
            parts.append(f"ran {_secs(item.run_time)}")
        elif item.round_trip is not None:  # decided by the orchestrator: how long it took to say so
            parts.append(f"after {_secs(item.round_trip)}")
        if item.queue_wait is not None and item.queue_wait >= 0.1:  # only when the queue held it up
            parts.append(f"waited {_secs(item.queue_wait)}")
        if item.worker:
            parts.append(f"on {item.worker}")
        if note or item.reason:
            parts.append("— " + (note or item.reason or ""))
        return " ".join(parts)

    def _width(self) -> int:
        if self._columns is not None:
            return self._columns
        try:
            return _terminal_columns(self.out)
        except (OSError, ValueError, AttributeError):
            return 80


def background_session(item: CommandExecutionView) -> str | None:
    """The session id of a command still running when its call answered (exec_command's
    `Process running with session ID N`, or a write_stdin's poll of it), read from the header the
    worker writes before the command's own output, so no output can claim it."""
    if item.state is not CallState.COMPLETED or item.exit_code is not None or not item.output:
        return None
    head, sep, _ = item.output.partition("\nOutput:\n")
    if not sep or not head.startswith("Chunk ID: "):
        return None
    found = _SESSION_LINE.search(head)
    return found.group(1) if found else None


@dataclass
class _Shown:
    """What the live view has shown of a running command."""

    state: CallState | None = None
    streamed: str = ""
    command_shown: bool = False


@dataclass
class _Running:
    """A call the status line shows: since when it runs, and (a command) when its output last grew."""

    tool: str
    since: float
    active: float
    command: bool
    output: int = 0


def _final_lines(streamed: str, final: str) -> list[str]:
    """The lines of a finished command's output not shown while it ran (all of it if it ended before
    any output was streamed), at most FINAL_LINES: past that, a line counting the others and the last ones."""
    rest = final[len(streamed):] if final.startswith(streamed) else final
    if streamed and not streamed.endswith("\n") and rest.startswith("\n"):
        rest = rest[1:]  # the end of the line shown last
    lines = rest.splitlines()
    if streamed and not final.startswith(streamed):  # the result's output was cut: its end is what is new
        lines = lines[-LAST_LINES:]
    if len(lines) <= FINAL_LINES:
        return [_cut(t) for t in lines]
    kept = lines[-(FINAL_LINES - 1):]
    return [f"… {len(lines) - len(kept)} more lines", *(_cut(t) for t in kept)]


def _tool_name(tool: str) -> str:
    """A tool's name fit for its column: a namespaced one (`server.tool`) too long for it keeps its
    own name whole and loses the end of its namespace."""
    if len(tool) <= TOOL_CHARS:
        return tool
    _, dot, own = tool.rpartition(".")
    if dot and len(own) + 2 < TOOL_CHARS:
        return tool[:TOOL_CHARS - len(own) - 2] + "…." + own
    return tool[:TOOL_CHARS - 1] + "…"


def _one_line(text: str) -> str:
    return printable(text, lines=False)


def _cut(text: str) -> str:
    """One line fit for the user's terminal: a command's output is untrusted, and an escape
    sequence in it must not move the cursor, retitle the window or rewrite what was shown."""
    text = printable(text, lines=False)
    return text if len(text) <= LINE_CHARS else text[:LINE_CHARS - 1] + "…"


def _fit_width(text: str, columns: int) -> str:
    """`text` cut to `columns` terminal cells (a wide character takes two): the status line must
    not wrap, or erasing it would leave its first part behind."""
    if sum(map(_cells, text)) <= columns:
        return text
    used, kept = 0, []
    for ch in text:
        if used + _cells(ch) > columns - 1:
            break
        used += _cells(ch)
        kept.append(ch)
    return "".join(kept) + "…"


def _cells(ch: str) -> int:
    return 0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1


def _isatty(out: IO[str]) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _terminal_columns(out: IO[str] | None) -> int:
    """The terminal's width (a terminal that says 0, as a bare pty does: $COLUMNS, else 80)."""
    columns = os.get_terminal_size(out.fileno()).columns if out is not None else 0
    if columns <= 0:
        columns = int(os.environ.get("COLUMNS", "") or 0) if os.environ.get("COLUMNS", "").isdigit() else 0
    return columns if columns > 0 else 80


def _secs(s: float) -> str:
    return f"{s:.2f}s" if s >= 1 else f"{s * 1000:.0f}ms"


def _elapsed(s: float) -> str:
    """A running call's age, to the second: 7s, 2m05s, 1h02m."""
    s = max(int(s), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
