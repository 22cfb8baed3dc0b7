"""What a file tool may spend on one call: the memory and the time a command would get.

File tools (apply_patch, read_file, list_dir, grep_files, view_image) run in the worker's pool
process, outside the sandbox, on files the model chose: a 64 MiB file to patch grew a pool
process by 1.7 GB and kept a core busy for a minute. So they are held to the sandbox's limits
for a command: what they keep in memory at once is charged against the policy's memory limit
(`TOOLQ_SANDBOX_MEMORY_MB`), and their loops check the call's deadline and cancel.
"""

from __future__ import annotations

import time

from toolq.core.catalog import ToolContext
from toolq.core.errors import RespondToModel
from toolq.workers import isolation
from toolq.workers.processes import CallCancelled

MIB = 1024 * 1024


class CallBudget:
    def __init__(self, ctx: ToolContext, tool: str, *, seconds: float | None = None) -> None:
        self._ctx = ctx
        self._tool = tool
        self.memory = isolation.current().policy.limits.memory_mb * MIB
        """Bytes the call may hold at once, as a command may (the sandbox's per-call limit)."""
        self.spent = 0
        self.seconds = ctx.remaining() if seconds is None else min(seconds, ctx.remaining())
        self._deadline = time.monotonic() + self.seconds

    def check(self, *_: object) -> None:
        """In every loop over the model's data (a chunk read, a line compared): stop a cancelled
        call, and one past its deadline with the model's error."""
        if self._ctx.cancelled():
            raise CallCancelled(f"{self._tool} cancelled")
        if time.monotonic() > self._deadline:
            raise RespondToModel(f"{self._tool} timed out after {self.seconds:.0f} seconds")

    def charge(self, need: int, what: str) -> None:
        """Count `need` bytes held until the call ends; refuse (the model's error) past the limit."""
        if self.spent + need > self.memory:
            raise RespondToModel(f"{what} needs about {(self.spent + need + MIB - 1) // MIB} MiB in "
                                 f"memory; the sandbox limits a call to {self.memory // MIB} MiB")
        self.spent += need
