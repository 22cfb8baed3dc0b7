"""The processes a campaign looks at: the hang call's pid, whether it still lives, what the
campaign left running, and the stranded calls the fleet requeued (counted from its log)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# --- processes -----------------------------------------------------------------------------------


class _Count(logging.Handler):
    def __init__(self, tally: Any) -> None:
        super().__init__(logging.WARNING)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        self.tally.requeued += 1


@contextmanager
def counting(logger: logging.Logger, tally: Any) -> Iterator[None]:
    """Count the stranded calls requeued (one warning each), whatever the bench's log level."""
    handler, level = _Count(tally), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)



def output_text(output: Any) -> str:
    """A history output's text: a string, or its content parts' texts."""
    if isinstance(output, list):
        return "".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
    return "" if output is None else str(output)


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else None


def wait_until(ready: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not ready() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(ready())


def wait_for_pid(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> int | None:
    """The pid the hang call wrote, once it runs; None if it did not within `timeout` (or `proc`,
    the orchestrator, ended first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and (proc is None or proc.poll() is None):
        pid = read_pid(path)
        if pid is not None:
            return pid
        time.sleep(0.02)
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[-1][:1] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


def processes_under(path: Path) -> list[tuple[int, str]]:
    """Live processes whose command line names `path` (the campaign's workers, orchestrators, Redis)."""
    found = []
    marker = str(path)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and not wait_gone(int(entry.name), 5):
            found.append((int(entry.name), cmd.strip()[:200]))
    return found
