"""`toolq batch`'s progress: one line redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import IO

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
        self.failed += status in ("failed", "invalid")
        self.cancelled += status == "cancelled"
        self.show()

    def line(self) -> str:
        filled = BAR * self.done // self.total if self.total else BAR
        return (f"[{'#' * filled}{'.' * (BAR - filled)}] {self.done}/{self.total} turns, {self.running} running, "
                f"{self.failed} failed, {self.cancelled} cancelled; {self.calls} calls, {self.failed_calls} failed; "
                f"{time.monotonic() - self.started:.1f}s")

    def show(self, *, final: bool = False) -> None:
        """Redraw (a terminal), or print a line when one is due (else)."""
        now = time.monotonic()
        try:
            if self.tty:
                self.out.write("\r" + self.line() + "\x1b[K" + ("\n" if final else ""))
            elif final or now - self._last >= PLAIN_EVERY:
                self.out.write(self.line() + "\n")
            else:
                return
            self.out.flush()
            self._last = now
        except (OSError, ValueError):  # stderr went away: the batch goes on, its results are in the file
            pass
