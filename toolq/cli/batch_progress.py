"""`toolq batch`'s progress: one line redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO

from toolq.cli.terminal import printable
from toolq.orchestrator.turn_events import ItemCompleted, ToolCallView, TurnEvent

#: Without a terminal (a log file, CI) a line at most this often, and one at the end.
PLAIN_EVERY = 5.0
BAR = 20


def ended_call(event: TurnEvent) -> bool | None:
    """For a call's last event, whether it failed (as the live view shows it); else None."""
    if isinstance(event, ItemCompleted) and isinstance(event.item, ToolCallView):
        return event.item.status == "failed"
    return None


@dataclass
class Progress:
    total: int
    """Turns this run will run (the ones already done are not counted)."""
    out: IO[str] = field(default=sys.stderr)
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    invalid: int = 0
    running: int = 0
    calls: int = 0
    failed_calls: int = 0
    started: float = field(default_factory=time.monotonic)
    _last: float = 0.0

    def __post_init__(self) -> None:
        try:
            self.tty = self.out.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def call_ended(self, failed: bool) -> None:
        self.calls += 1
        self.failed_calls += failed

    def turn_ended(self, status: str) -> None:
        self.done += 1
        self.failed += status == "failed"
        self.cancelled += status == "cancelled"
        self.invalid += status == "invalid"
        self.show()

    def line(self, width: int | None = None) -> str:
        """The progress, fitted to `width` columns if given (the bar goes first, then the calls)."""
        filled = BAR * self.done // self.total if self.total else BAR
        bar = f"[{'#' * filled}{'.' * (BAR - filled)}] "
        counts = (f"{self.done}/{self.total} turns, {self.running} running, {self.failed} failed, "
                  f"{self.cancelled} cancelled{f', {self.invalid} invalid' if self.invalid else ''}; "
                  f"{self.calls} calls, {self.failed_calls} failed; {time.monotonic() - self.started:.1f}s")
        if width is None or len(bar) + len(counts) < width:
            return bar + counts
        if len(counts) < width:
            return counts
        brief = (f"{self.done}/{self.total} turns {self.running} run {self.failed} fail {self.cancelled} canc"
                 f"{f' {self.invalid} inv' if self.invalid else ''} {time.monotonic() - self.started:.0f}s")
        return brief[:width - 1]  # the turns' counts first: a narrow terminal loses the calls

    def _width(self) -> int:
        """The terminal's columns: a line that wraps is not redrawn in place by a carriage return."""
        try:
            columns = os.get_terminal_size(self.out.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        return columns if columns > 0 else 80  # a pty with no size set says 0

    def show(self, *, final: bool = False) -> None:
        """Redraw (a terminal), or print a line when one is due (else)."""
        now = time.monotonic()
        try:
            if self.tty:
                line = printable(self.line(self._width()), lines=False)
                self.out.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
            elif final or now - self._last >= PLAIN_EVERY:
                self.out.write(printable(self.line(), lines=False) + "\n")
            else:
                return
            self.out.flush()
            self._last = now
        except (OSError, ValueError):  # stderr went away: the batch goes on, its results are in the file
            pass
