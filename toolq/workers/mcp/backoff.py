"""Restart delays after a crash, for an MCP server (in the host) and for the host (in the worker)."""

from __future__ import annotations

from dataclasses import dataclass

#: Doubled after each crash up to the most, and back to the first once it stayed up a while.
FIRST, MOST, STAYED_UP = 0.5, 30.0, 60.0


@dataclass
class Backoff:
    first: float = FIRST
    most: float = MOST
    stayed_up: float = STAYED_UP
    _delay: float = 0.0

    def after_crash(self, was_up_for: float) -> float:
        """How long to wait before the next start, given how long the last one lasted."""
        if not self._delay or was_up_for > self.stayed_up:
            self._delay = self.first
        delay, self._delay = self._delay, min(self._delay * 2, self.most)
        return delay
