"""Keep a worker alive when its consumer restarts (a Redis restart) just after a pool child died.

Celery's prefork pool stops watching a child that exited by setting its `_sentinel_poll` to
None; until the pool's maintenance drops it, the child stays in the pool's list. A consumer that
restarts in that window registers every listed child with the event loop again, hands the hub
`None` for the dead one, and `ValueError: file descriptor is None` escapes (only OSError and
AttributeError are caught there): "Unrecoverable error", the main process exits and its running
calls are lost. Found by the fault campaign (a SIGKILLed pool child, then a Redis restart). A
child already known to have exited is skipped: the maintenance starts its replacement.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("toolq.worker")


def install() -> None:
    from celery.concurrency import asynpool

    pool = asynpool.AsynPool
    original = pool._track_child_process
    if getattr(original, "_toolq_guarded", False):
        return

    def track(self: Any, proc: Any, hub: Any) -> None:
        if getattr(proc, "_sentinel_poll", 0) is None:  # exited and untracked: nothing to watch
            log.info("pool child %s already exited; not watched again", getattr(proc, "pid", "?"))
            return
        original(self, proc, hub)

    track._toolq_guarded = True  # type: ignore[attr-defined]
    pool._track_child_process = track
