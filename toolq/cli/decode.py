"""`toolq decode FILE`: the committed items of a recorded SSE body, one JSON object per line.

Only `response.output_item.done` items are printed (the commit point); a one-line summary goes
to stderr: events read, items, how the response ended, and skipped frames by reason.
"""

from __future__ import annotations

from typing import IO

from toolq.cli.terminal import json_line, printable
from toolq.orchestrator.protocol.events import EventDecoder, iter_sse_data


def decode_file(path: str, out: IO[str], err: IO[str]) -> int:
    try:
        with open(path, "rb") as f:
            body = f.read()
    except OSError as e:
        print(f"toolq decode: {e}", file=err)
        return 1
    decoder = EventDecoder()
    n_events = n_items = 0
    end = "none (stream ended without a terminal event)"
    for data in iter_sse_data(body):
        n_events += 1
        event = decoder.decode(data)
        if event is None:
            continue
        if event.kind == "item_done":
            n_items += 1
            out.write(json_line(event.item.to_wire()) + "\n")
        elif event.kind == "completed":
            end = "completed"
        elif event.kind in ("failed", "error"):
            end = f"{event.kind} ({event.code or 'no code'}: {event.message or 'no message'})"
        elif event.kind == "incomplete":
            end = f"incomplete ({event.reason or 'unknown'})"
    skipped = ", ".join(f"{reason}={n}" for reason, n in sorted(decoder.skipped.items())) or "none"
    # The server's failure text is the server's: shown, never obeyed.
    print(printable(f"{_count(n_events, 'event')}, {_count(n_items, 'item')}, end: {end}; skipped: {skipped}",
                    lines=False), file=err)
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
