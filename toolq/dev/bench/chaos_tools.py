"""The tools of the fault campaign (`toolq bench chaos`, tests/integration/test_campaign.py),
loaded on both sides with `--tools toolq.dev.bench.chaos_tools`.

None is idempotent, so the fleet never redelivers them, and each leaves its own evidence in the
workspace: a line per execution in `runs-<call_id>.txt` (a call run twice shows two), and the hang
writes its process id to `hang-<call_id>.pid` so the campaign can kill it or check it is gone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, Field

from toolq.core.catalog import ToolContext, tool


def runs_file(workspace: Path, call_id: str) -> Path:
    return workspace / f"runs-{call_id}.txt"


def pid_file(workspace: Path, call_id: str) -> Path:
    return workspace / f"hang-{call_id}.pid"


def end_file(workspace: Path, call_id: str) -> Path:
    """When the hang call finished by itself (a pool child lives on after its call: its pid alone
    cannot tell a call still running from an idle process)."""
    return workspace / f"hang-{call_id}.end"


def _count(ctx: ToolContext) -> None:
    with open(runs_file(ctx.workspace, ctx.call_id), "a") as f:
        f.write(f"{os.getpid()}\n")


class NoArgs(BaseModel):
    pass


@tool(name="chaos_count")
def chaos_count(args: NoArgs, ctx: ToolContext) -> str:
    """Record one execution, then take a little time (a window for faults)."""
    _count(ctx)
    time.sleep(0.2)
    return "counted"


class HangArgs(BaseModel):
    seconds: float = 6.0


@tool(name="chaos_hang", timeout=60)
def chaos_hang(args: HangArgs, ctx: ToolContext) -> str:
    """Record one execution and this process's pid, sleep (the campaign's faults hit it), record the end."""
    _count(ctx)
    pid_file(ctx.workspace, ctx.call_id).write_text(str(os.getpid()))
    time.sleep(args.seconds)
    end_file(ctx.workspace, ctx.call_id).write_text(repr(time.time()))
    return "woke up"


class FloodArgs(BaseModel):
    mib: int = Field(default=10, ge=1, le=64)


@tool(name="chaos_flood")
def chaos_flood(args: FloodArgs, ctx: ToolContext) -> str:
    """Record one execution and return `mib` MiB of output (truncated before the model sees it)."""
    _count(ctx)
    line = "flood " + "x" * 57 + "\n"  # 64 bytes
    return line * (args.mib * 1024 * 1024 // len(line))
