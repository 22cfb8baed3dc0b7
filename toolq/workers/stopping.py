"""A worker that stops promptly: every embedded `toolq run` that made a call waits for its
workers' warm shutdown before it exits.

Two waits of Celery's prefork worker that no call needs:
- A SIGTERM only sets a flag, which the event loop reads when its poll next returns, up to a
  second later. A pipe in the loop, written to from the shutdown notice (Celery sends it from the
  signal handler), makes the poll return at once.
- billiard's pool child, on its way out, tells the parent it exits and sleeps a second for the
  parent to kill it. In a warm shutdown the parent no longer listens, so each child slept it out.
And one wait of kombu's: the consumer's connection closes after its BRPOP in flight returns
(`TOOLQ_WORKER_POLL`, which the embedded stack sets short).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import bootsteps

_wake: tuple[int, int] | None = None
"""The pipe's (read, write) ends, made when the loop first takes it (in the main process)."""


def _drain() -> None:
    if _wake is not None:
        try:
            os.read(_wake[0], 512)
        except BlockingIOError:
            pass


class Wakeup(bootsteps.StartStopStep):
    """The consumer step that keeps the pipe in the event loop, registered again when the
    consumer restarts (a Redis restart resets the loop)."""

    def register_with_event_loop(self, parent: Any, hub: Any) -> None:
        global _wake
        if _wake is None:
            read, write = os.pipe()
            for fd in (read, write):
                os.set_blocking(fd, False)
            _wake = read, write
        hub.add_reader(_wake[0], _drain)


def wake(**_: Any) -> None:
    """`worker_shutting_down`'s receiver (in the signal handler): the poll returns, and the loop
    sees the flag. Before the loop runs there is no poll to wake."""
    if _wake is None:
        return
    try:
        os.write(_wake[1], b"\0")
    except BlockingIOError:  # already full: the loop wakes anyway
        pass


def exit_without_lingering(exitcode: int = 0, **_: Any) -> None:
    """A pool child's last `worker_process_shutdown` receiver (connected in the child, after every
    other). Exit 0 is the pool closing: nothing is left to do, and the parent, joining its
    children, learns of the exit from waitpid. Any other exit (a child signalled on its own)
    goes billiard's way: the parent is still listening, and replaces the child."""
    if exitcode != 0:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(exitcode)
