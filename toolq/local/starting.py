"""Workers this process started, still booting: what a call waits for instead of "no live worker"."""

from __future__ import annotations

import threading


class WorkersStarting:
    """Workers this process started and has not seen ready yet (the embedded stack's, which boot
    while the first model request goes out). A call waits for them rather than being answered
    "no live worker" after the usual grace; if they fail to start, the call is told why."""

    def __init__(self, what: str = "embedded workers starting") -> None:
        self.what = what
        self.error: str | None = None
        self._done = threading.Event()

    @property
    def booting(self) -> bool:
        return not self._done.is_set()

    def finish(self, error: str | None = None) -> None:
        """Called once, from the thread that watches the boot: all ready (None) or why not."""
        self.error = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
