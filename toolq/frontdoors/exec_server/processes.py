"""One process's events as the client sees them: `process/output`, `process/exited` and
`process/closed` under one seq counter from 1, gap-free, `closed` always last and always sent.

Codex publishes events by seq (a gap stalls the stream, seq 0 is lost) and completes a command on
`closed`. The log numbers the events, keeps the recent ones for `process/read` (a resumed client
catches up with it; at most `retain_bytes` of output, the oldest dropped first), and remembers how
far the attached client has been sent (`sent`). Pure: no I/O, so its rules are unit-tested alone."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from toolq.core.front_doors import CHUNK_BYTES
from toolq.frontdoors.exec_server.protocol import b64

#: Output bytes one process keeps for `process/read` (a resumed client's catch-up).
RETAIN_BYTES = 4 << 20

Kind = Literal["output", "exited", "closed"]


@dataclass(frozen=True)
class Event:
    seq: int
    kind: Kind
    stream: str | None = None
    data: bytes = b""
    exit_code: int | None = None

    def notification(self, process_id: str) -> tuple[str, dict[str, Any]]:
        """The method and params of the notification pushing it."""
        if self.kind == "output":
            return "process/output", {"processId": process_id, "seq": self.seq, "stream": self.stream,
                                      "chunk": b64(self.data)}
        if self.kind == "exited":
            return "process/exited", {"processId": process_id, "seq": self.seq, "exitCode": self.exit_code,
                                      "sandboxDenied": False}
        return "process/closed", {"processId": process_id, "seq": self.seq}


class ProcessLog:
    def __init__(self, process_id: str, retain_bytes: int = RETAIN_BYTES) -> None:
        self.process_id = process_id
        self.retain_bytes = retain_bytes
        self.events: deque[Event] = deque()
        """The retained events, in seq order (output dropped from the front past `retain_bytes`)."""
        self.retained = 0
        self.last_seq = 0
        self.exit_code: int | None = None
        self.exited = False
        self.closed = False
        self.sent = 0
        """The last seq the attached client was sent (or caught up to with `process/read`)."""
        self.changed = asyncio.Event()
        """Set at each new event (a long-polling `process/read` waits on it), cleared by `wait`."""

    def _add(self, event: Event) -> Event:
        self.last_seq = event.seq
        self.events.append(event)
        self.retained += len(event.data)
        while self.retained > self.retain_bytes and self.events and self.events[0].kind == "output":
            self.retained -= len(self.events.popleft().data)
        self.changed.set()
        return event

    def output(self, stream: str, data: bytes) -> list[Event]:
        """`data` as output events of at most CHUNK_BYTES each; nothing once closed."""
        if self.closed or not data:
            return []
        return [self._add(Event(self.last_seq + 1, "output", stream, data[at:at + CHUNK_BYTES]))
                for at in range(0, len(data), CHUNK_BYTES)]

    def exit(self, exit_code: int) -> list[Event]:
        """The exited event (once: a second exit is ignored)."""
        if self.exited or self.closed:
            return []
        self.exited, self.exit_code = True, exit_code
        return [self._add(Event(self.last_seq + 1, "exited", exit_code=exit_code))]

    def close(self, exit_code: int = -1) -> list[Event]:
        """The closed event, after an exited one (with `exit_code` when none came); once."""
        if self.closed:
            return []
        events = self.exit(exit_code)
        self.closed = True
        return [*events, self._add(Event(self.last_seq + 1, "closed"))]

    def unsent(self) -> list[Event]:
        """The retained events past `sent`, marked sent."""
        events = [e for e in self.events if e.seq > self.sent]
        self.sent = max(self.sent, self.last_seq)
        return events

    def read(self, after_seq: int | None, max_bytes: int | None) -> dict[str, Any]:
        """`process/read`'s result: the output chunks after `after_seq` (at least one whole chunk,
        then up to `max_bytes`), and where the process stands."""
        after = after_seq or 0
        chunks: list[dict[str, Any]] = []
        size = 0
        next_seq = self.last_seq + 1
        for event in self.events:
            if event.seq <= after or event.kind != "output":
                continue
            if chunks and max_bytes is not None and size + len(event.data) > max_bytes:
                next_seq = event.seq
                break
            chunks.append({"seq": event.seq, "stream": event.stream, "chunk": b64(event.data)})
            size += len(event.data)
        if next_seq > self.last_seq:  # read to the end: the client has what there is
            self.sent = max(self.sent, self.last_seq)
        return {"chunks": chunks, "nextSeq": next_seq, "exited": self.exited, "exitCode": self.exit_code,
                "closed": self.closed, "failure": None, "sandboxDenied": False}

    async def wait(self, after_seq: int | None, seconds: float) -> None:
        """Until an event past `after_seq` is there, or `seconds` have passed."""
        if self.last_seq > (after_seq or 0) or self.closed or seconds <= 0:
            return
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), seconds)
        except TimeoutError:
            pass
