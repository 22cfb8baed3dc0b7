"""Bounded reads from an open file: chunks, and lines cut at a cap however long they are.

A file named by a hostile model may hold one 3 GiB "line"; reading it whole (`for line in f`)
exhausts the worker's memory. These read fixed chunks and keep at most `keep` bytes of a line, so
memory stays O(chunk + keep), and run a caller's check on every chunk (a deadline, a cancel, a
binary test), so time is bounded too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

CHUNK_BYTES = 1024 * 1024


def chunks(fd: int, check: Callable[[bytes], None] | None = None, size: int | None = None) -> Iterator[bytes]:
    """The file's bytes from the current offset, `size` (a chunk) at a time; `check` sees each first."""
    while chunk := os.read(fd, size or CHUNK_BYTES):
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


def line_blocks(fd: int, keep: int, check: Callable[[bytes], None] | None = None) -> Iterator[bytes]:
    """The file's lines, many at a time: each block is whole lines joined by `\n` (no final one),
    a line longer than `keep` cut to its first `keep` bytes. For a search that looks at a
    megabyte at once instead of one line at a time; `keep` must be at least a chunk, so only a line
    that spans chunks can need cutting."""
    if keep < CHUNK_BYTES:
        raise ValueError("line_blocks keeps at least a chunk of each line")
    head = bytearray()  # the line in progress, which began in an earlier chunk
    pending = False
    for chunk in chunks(fd, check):
        last = chunk.rfind(b"\n")
        if last < 0:
            head += chunk[: max(0, keep - len(head))]
            pending = True
            continue
        first = chunk.find(b"\n")
        head += chunk[: min(first, max(0, keep - len(head)))]
        yield bytes(head) + chunk[first:last]
        head = bytearray(chunk[last + 1 :])  # shorter than a chunk: never over `keep`
        pending = bool(head)
    if pending:
        yield bytes(head)
