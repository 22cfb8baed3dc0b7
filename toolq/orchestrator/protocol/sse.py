"""SSE framing with a bound on each event: bytes in, each event's `data` (or `Oversize`) out.

httpx-sse buffers a line, and an event, whole, however long it gets: a 200 MiB event was 200 MiB
of memory, then a 200 MiB string for `json.loads`. `SSEReader` splits the bytes itself and stops
keeping an event once it passes `max_event_bytes`: the rest of it is only counted, and it comes
out as one `Oversize` that keeps the event's first bytes, so the decoder can tell what was cut.

Framing follows the SSE spec as httpx-sse does (lines end in CRLF, LF or CR; `data` lines are
joined with LF; a blank line ends an event; an unterminated last event is dropped); `event:`,
`id:` and `retry:` are read but not kept, since toolq dispatches on the JSON `type`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass

import httpx

from toolq.core.settings import DEFAULT_MAX_EVENT_BYTES

#: The default bound (TOOLQ_MAX_SSE_EVENT_BYTES): far above any real event (a response.completed
#: repeats the whole output), far below what would hurt a small orchestrator.
#: How much of a cut event is kept: enough to read its `type`, which servers send first.
HEAD_BYTES = 512

_TYPE = re.compile(rb'"type"\s*:\s*"([^"\\]{1,200})"')


@dataclass(frozen=True)
class Oversize:
    """An event over the bound, dropped: only its size and its first bytes are kept."""

    size: int
    head: bytes

    @property
    def type(self) -> str | None:
        """The first JSON `type` in the event's first bytes: the event's own, as servers order it."""
        m = _TYPE.search(self.head)
        return m.group(1).decode("utf-8", "replace") if m else None


Frame = str | Oversize


class SSEReader:
    """Incremental, bounded SSE framing: `feed(chunk)` returns the events the chunk completed."""

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._cr = False  # the last chunk ended in CR: an LF starting the next one belongs to it
        self._line: list[bytes] = []  # pieces of an unfinished line, while the event is in bounds
        self._line_len = 0
        self._data: list[bytes] = []
        self._fields = False  # an event:/id:/retry: line was seen (httpx-sse yields those too)
        self._size = 0
        self._over = False
        self._head = b""

    def feed(self, chunk: bytes) -> list[Frame]:
        if self._cr:
            self._cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if b"\r" in chunk:
            self._cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = chunk.split(b"\n")
        unfinished = lines.pop()
        out: list[Frame] = []
        for line in lines:
            if self._line_len or self._over:  # the slow path: a line split across chunks, or a cut event
                self._take(line)
                finished = self._finish_line()
                if finished is None:
                    continue
                line = finished
            if not line:
                frame = self._end_event()
                if frame is not None:
                    out.append(frame)
                continue
            size = self._size + len(line) + 1
            if size > self.max_event_bytes:
                self._cut([line], size)
                continue
            self._size = size
            self._field(line)
        if unfinished:
            self._take(unfinished)
        return out

    def _take(self, piece: bytes) -> None:
        """Part of a line: kept while the event is in bounds, else only counted."""
        self._line_len += len(piece)
        if self._over:
            self._size += len(piece)
            return
        if self._size + self._line_len > self.max_event_bytes:
            self._cut([*self._line, piece], self._size + self._line_len)
            return
        self._line.append(piece)

    def _cut(self, pending: list[bytes], size: int) -> None:
        """The event passed the bound: from here on it is only counted, so memory stays at what
        was kept so far; its first bytes are kept to tell its type."""
        self._head = _first_bytes([*self._data, *pending], HEAD_BYTES)
        self._over = True
        self._size = size
        self._line.clear()
        self._data.clear()

    def _finish_line(self) -> bytes | None:
        """The line the pieces made; in a cut event None, or b"" for the blank line that ends it."""
        if self._over:
            if self._line_len == 0:
                return b""
            self._size += 1
            self._line_len = 0
            return None
        line = self._line[0] if len(self._line) == 1 else b"".join(self._line)
        self._line.clear()
        self._line_len = 0
        return line

    def _field(self, line: bytes) -> None:
        if line.startswith(b":"):
            return  # a comment (keep-alive)
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name in (b"event", b"id", b"retry"):
            self._fields = True

    def _end_event(self) -> Frame | None:
        frame: Frame | None
        if self._over:
            frame = Oversize(self._size, self._head)
        elif self._data or self._fields:
            frame = b"\n".join(self._data).decode("utf-8", "replace")
        else:
            frame = None
        self._data.clear()
        self._fields = self._over = False
        self._size = 0
        self._head = b""
        return frame


def _first_bytes(parts: list[bytes], n: int) -> bytes:
    out = b""
    for part in parts:
        out += part[: n - len(out)]
        if len(out) >= n:
            break
    return out


def iter_frames(chunks: Iterable[bytes], max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> Iterable[Frame]:
    reader = SSEReader(max_event_bytes)
    for chunk in chunks:
        yield from reader.feed(chunk)


async def aiter_frames(response: httpx.Response,
                       max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> AsyncGenerator[Frame, None]:
    """The frames of a streamed response, read with bounded memory."""
    reader = SSEReader(max_event_bytes)
    async for chunk in response.aiter_bytes():
        for frame in reader.feed(chunk):
            yield frame
