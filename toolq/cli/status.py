"""`toolq status TURN_ID` and `toolq turns`: what the ledger knows, as a table or JSON lines.

Rendering is pure (rows in, text out); only `status_cmd` and `turns_cmd` touch Redis.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from contextlib import aclosing
from datetime import datetime
from typing import Any, TextIO

from toolq.cli.ledgers import ledgers
from toolq.cli.terminal import json_line, printable
from toolq.core.errors import ConfigurationError
from toolq.core.session_records import SessionRecord
from toolq.core.settings import Settings, mask_url_password
from toolq.core.states import parse_state
from toolq.local.runtime_dir import ledger_urls
from toolq.orchestrator.transport.ledger import mark_orphans
from toolq.orchestrator.transport.redis_faults import reaching
from toolq.orchestrator.transport.session_route import live_sessions

CALL_COLUMNS = ("tool", "call_id", "task_id", "state", "worker", "queue_wait", "run_time")
SESSION_COLUMNS = ("session_id", "worker", "tty", "age", "command")
TURN_COLUMNS = ("turn_id", "state", "started", "duration", "calls", "prompt")
#: A turn's prompt is cut to this many characters in the table (JSON keeps the ledger's 500).
PROMPT_WIDTH = 48
#: The model names a call's id and tool: the table cuts them here (JSON keeps them whole).
MODEL_TEXT_COLUMNS = ("prompt", "tool", "call_id")


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v else None
    except ValueError:
        return None


def elapsed(record: dict[str, str], now: float) -> float | None:
    """finished_at - started_at; a call or turn still running counts up to `now`."""
    started, finished = _float(record.get("started_at")), _float(record.get("finished_at"))
    if started is None:
        return None
    if finished is None:
        state = parse_state(record.get("state"))
        if (state is not None and state.terminal) or record.get("state") == "orphaned":
            return None  # ended (or abandoned) without a recorded end time: no honest duration
        finished = now
    return max(finished - started, 0.0)


def call_row(call: dict[str, str], now: float) -> dict[str, Any]:
    """One ledger call record as a row; empty fields are None (a rejected call has no task id).

    `queue_wait`: from dispatch to a worker starting it; `run_time`: on the worker."""
    d = elapsed(call, now)
    queued, started = _float(call.get("queued_at")), _float(call.get("started_at"))
    wait = None if queued is None or started is None else round(max(started - queued, 0.0), 3)
    return {"tool": call.get("tool") or None, "call_id": call.get("call_id") or None,
            "task_id": call.get("task_id") or None, "state": call.get("state") or None,
            "worker": call.get("worker") or None, "queue_wait": wait, "run_time": None if d is None else round(d, 3)}


def _call_order(call: dict[str, str]) -> tuple[float, float]:
    """Step, then place in the response: the ledger lists calls as they were claimed, which a
    limit or a serial tool reorders."""
    return _float(call.get("step")) or 0.0, _float(call.get("output_index")) or 0.0


def turn_row(turn_id: str, turn: dict[str, str], calls: int, now: float) -> dict[str, Any]:
    d = elapsed(turn, now)
    return {"turn_id": turn_id, "state": turn.get("state") or None, "started_at": _float(turn.get("started_at")),
            "finished_at": _float(turn.get("finished_at")), "duration": None if d is None else round(d, 3),
            "calls": calls, "prompt": turn.get("prompt", ""), "error": turn.get("error") or None}


def _cell(column: str, row: dict[str, Any]) -> str:
    if column == "started":
        ts = row.get("started_at")
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"
    value = row.get(column)
    if value is None:
        return "-"
    if column in ("duration", "queue_wait", "run_time", "age"):  # calls are often milliseconds: keep them visible
        return f"{value:.1f}s" if value >= 10 else f"{value:.2f}s" if value >= 1 else f"{value * 1000:.0f}ms"
    if column in MODEL_TEXT_COLUMNS:  # a 300 KB call_id made a 300 KB wide table
        text = " ".join(str(value).split())
        return text if len(text) <= PROMPT_WIDTH else text[:PROMPT_WIDTH - 1] + "…"
    return str(value)


def render_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    cells = [[_cell(c, r) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    lines = [[c.upper() for c in columns], *cells]
    return "".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=False)).rstrip() + "\n" for line in lines)


def render_json_lines(rows: list[dict[str, Any]], **extra: Any) -> str:
    return "".join(json_line({**extra, **r}) + "\n" for r in rows)


def session_row(s: SessionRecord, now: float) -> dict[str, Any]:
    return {"session_id": s.session_id, "worker": s.hostname, "tty": s.tty,
            "age": round(max(now - s.started_at, 0.0), 3), "command": " ".join(s.command.split())[:PROMPT_WIDTH]}


def render_status(turn_id: str, turn: dict[str, str], calls: list[dict[str, str]], now: float,
                  as_json: bool = False, sessions: Sequence[SessionRecord] = ()) -> str:
    rows = [call_row(c, now) for c in sorted(calls, key=_call_order)]
    live = [session_row(s, now) for s in sessions]
    if as_json:  # sessions as lines of their own, marked, after the calls
        return render_json_lines(rows, turn_id=turn_id) + render_json_lines(live, turn_id=turn_id, type="session")
    head = turn_row(turn_id, turn, len(calls), now)
    line = f"turn {turn_id}  {head['state'] or '?'}  {_cell('duration', head)}  {len(calls)} call(s)\n"
    if head["error"]:
        line += f"error: {head['error']}\n"
    text = line + (render_table(rows, CALL_COLUMNS) if rows else "no calls\n")
    if live:
        text += f"{len(live)} live exec_command session(s) in its conversation {turn.get('conversation')}:\n"
        text += render_table(live, SESSION_COLUMNS)
    return text


def render_turns(rows: list[dict[str, Any]], as_json: bool = False) -> str:
    if as_json:
        return render_json_lines(rows)
    return render_table(rows, TURN_COLUMNS) if rows else "no turns in the ledger\n"


# --- commands (Redis) ------------------------------------------------------------------------


def _ledger_urls(settings: Settings, command: str, err: TextIO) -> list[str] | None:
    """REDIS_URL, else this user's running embedded stacks (runtime_dir.py); None: said why on err."""
    try:
        return ledger_urls(settings.redis_url)
    except ConfigurationError as e:
        print(f"toolq {command}: {e}", file=err)
        return None


def status_cmd(settings: Settings, turn_id: str, *, as_json: bool = False, out: TextIO = sys.stdout,
               err: TextIO = sys.stderr) -> int:
    urls = _ledger_urls(settings, "status", err)
    if urls is None:
        return 2

    async def read() -> tuple[dict[str, str], list[dict[str, str]], list[SessionRecord]]:
        async with aclosing(ledgers(settings.redis_target())) as each:
            async for _, ledger in each:
                turn, calls = await ledger.turn(turn_id), await ledger.calls(turn_id)
                await mark_orphans(ledger.r, [(turn_id, turn)])
                if turn or calls:
                    conversation = turn.get("conversation")
                    sessions = await live_sessions(ledger.r, conversation) if conversation else []
                    return turn, calls, sessions
        return {}, [], []

    with reaching(settings.redis_url):
        turn, calls, sessions = asyncio.run(read())
    if not turn and not calls:
        where = mask_url_password(urls[0]) if settings.redis_url else f"{len(urls)} running embedded stack(s)"
        print(f"toolq status: no turn {turn_id!r} in the ledger at {where} "
              "(records are kept 7 days; `toolq turns` lists recent ones)", file=err)
        return 1
    shown = render_status(turn_id, turn, calls, time.time(), as_json, sessions)
    out.write(shown if as_json else printable(shown))
    return 0


def turns_cmd(settings: Settings, *, limit: int = 20, as_json: bool = False, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr) -> int:
    if limit < 1:
        print("toolq turns: --limit must be at least 1", file=err)
        return 2
    urls = _ledger_urls(settings, "turns", err)
    if urls is None:
        return 2

    async def read() -> list[tuple[str, dict[str, str], int]]:
        found = []
        async with aclosing(ledgers(settings.redis_target())) as each:
            async for _, ledger in each:
                turns = await ledger.recent_turns(limit)
                await mark_orphans(ledger.r, turns)
                counts = [len(await ledger.calls(t)) for t, _ in turns]
                found += [(t, h, n) for (t, h), n in zip(turns, counts, strict=True)]
        return found

    now = time.time()
    with reaching(settings.redis_url):
        found = asyncio.run(read())
    rows = [turn_row(t, h, n, now) for t, h, n in found if h]
    rows = sorted(rows, key=lambda r: r["started_at"] or 0, reverse=True)[:limit]  # newest first, across stacks
    shown = render_turns(rows, as_json)
    out.write(shown if as_json else printable(shown))
    return 0
