"""A worker's side of a call's max_concurrency permit (toolq/core/permits.py).

The orchestrator took the permit before it sent the call; the worker confirms it as the call
starts (the same script: held, so it is renewed), renews it from a thread while the handler runs,
and releases it when the call ends. Only after a crash does the confirmation have to wait: the
orchestrator died with the call queued and its lease lapsed, and the fleet is at the limit. Then
this pool child waits (sleeps with backoff, never past the call's deadline) rather than run one
call too many or fail the call for the limit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from toolq.core import keys
from toolq.core.calls import ToolInvocation
from toolq.core.permits import ACQUIRE, RELEASE, RENEW, Permit

log = logging.getLogger("toolq.worker")

#: Backoff of a pool child waiting for a permit after a crash (seconds).
FIRST_RETRY, MAX_RETRY = 0.05, 1.0


def confirm(r: redis.Redis, inv: ToolInvocation, on_wait: Callable[[], None] = lambda: None) -> float | None:
    """Hold the call's permit before it runs: the seconds it waited for it (0.0: held at once), or
    None if the call's deadline passed first."""
    permit = inv.permit
    assert permit is not None
    acquire = r.register_script(ACQUIRE)
    began, delay = time.monotonic(), FIRST_RETRY
    while not acquire(keys=[permit.key], args=[inv.task_id, permit.limit, permit.lease_ms]):
        if delay == FIRST_RETRY:
            log.warning("‖ %s %s waits for a %s permit (its orchestrator's lease lapsed)", inv.call_id,
                        inv.tool_name, permit.tool)
            on_wait()
        if time.time() + delay > inv.deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, MAX_RETRY)
    _RENEWER.hold(r, inv.task_id, permit)
    return time.monotonic() - began if delay != FIRST_RETRY else 0.0


def release(r: redis.Redis, inv: ToolInvocation) -> None:
    """Give the permit back (the orchestrator does too when it hears the outcome: whichever is first)."""
    permit = inv.permit
    assert permit is not None
    _RENEWER.drop(inv.task_id)
    try:
        r.register_script(RELEASE)(keys=[permit.key], args=[inv.task_id, keys.LIMIT_RELEASED, permit.tool])
    except redis.RedisError as e:  # its lease lapses by itself
        log.warning("could not release %s's permit for %s: %s", permit.tool, inv.task_id, e)


class _Renewer:
    """One thread per pool child renews the permits of the call it runs (a sync handler blocks the
    main thread). Started at the first limited call after the fork."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[redis.Redis, Permit]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, r: redis.Redis, task_id: str, permit: Permit) -> None:
        with self._lock:
            self._held[task_id] = (r, permit)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="toolq-permit-renew", daemon=True)
                self._thread.start()

    def drop(self, task_id: str) -> None:
        with self._lock:
            self._held.pop(task_id, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                held = list(self._held.items())
            every = min((p.renew_every for _, (_, p) in held), default=1.0)
            self._wake.wait(every)
            for task_id, (r, permit) in held:
                with self._lock:
                    if task_id not in self._held:
                        continue
                try:
                    r.register_script(RENEW)(keys=[permit.key], args=[task_id, permit.lease_ms])
                except redis.RedisError as e:  # the orchestrator renews it too while it waits
                    log.warning("renewing %s's permit for %s failed: %s", permit.tool, task_id, e)


_RENEWER = _Renewer()
