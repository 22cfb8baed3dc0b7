"""Bounded reads from an open file: chunks, and lines cut at a cap however long they are.

A file named by a hostile model may hold one 3 GiB "line"; reading it whole (`for line in f`)
exhausts the worker's memory. These read fixed chunks and keep at most `keep` bytes of a line, so
memory stays O(chunk + keep), and run a caller's check on every chunk (a deadline, a cancel, a
binary test), so time is bounded too.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

CHUNK_BYTES = 1024 * 1024


def chunks(fd: int, check: Callable[[bytes], None] | None = None, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The file's bytes from the current offset, `size` at a time; `check` sees each chunk first."""
    while chunk := os.read(fd, size):
        if check is not None:
            check(chunk)
        yield chunk


def read_at_most(fd: int, limit: int) -> bytes:
    """The file's bytes from the current offset, stopping after `limit` (a caller that reads
    `cap + 1` learns that the file is over its cap without holding more)."""
    data = bytearray()
    for chunk in chunks(fd, size=min(limit, 1024 * 1024) or 1):
        data += chunk[: limit - len(data)]
        if len(data) >= limit:
            break
    return bytes(data)


def bounded_lines(fd: int, keep: int, check: Callable[[bytes], None] | None = None) -> Iterator[bytes]:
    """Each line of the file without its `\\n`, cut to its first `keep` bytes (the rest is read past,
    never stored). A last line without a newline counts; an empty file has no lines."""
    line = bytearray()
    pending = False  # bytes seen since the last newline
    for chunk in chunks(fd, check):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if (room := keep - len(line)) > 0:
                line += chunk[start : min(end, start + room)]
            yield bytes(line)
            line.clear()
            pending = False
            start = end + 1
        if start < len(chunk):
            pending = True
            if (room := keep - len(line)) > 0:
                line += chunk[start : start + room]
    if pending:
        yield bytes(line)
