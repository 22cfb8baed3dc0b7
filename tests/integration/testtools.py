"""Tools the integration tests load on both sides (`--tools tests.integration.testtools`)."""

from __future__ import annotations

import json
import os
import time

from pydantic import BaseModel

from toolq import ToolContext, tool


class SleepArgs(BaseModel):
    ms: int = 0
    text: str = ""


@tool
def sleep_echo(args: SleepArgs, ctx: ToolContext) -> str:
    """Sleep, then report which process ran the call and when."""
    start = time.time()
    time.sleep(args.ms / 1000)
    return json.dumps({"text": args.text, "pid": os.getpid(), "start": start, "end": time.time()})


@tool(parallel=False)
def serial_echo(args: SleepArgs, ctx: ToolContext) -> str:
    """A serial tool: it runs alone, after the calls before it."""
    return sleep_echo(args, ctx)


class NoArgs(BaseModel):
    pass


@tool
def noop(args: NoArgs, ctx: ToolContext) -> str:
    """Do nothing (pipeline overhead benchmarks)."""
    return "ok"


class HangArgs(BaseModel):
    seconds: float = 30.0


@tool(queue="faults", timeout=60)
def hang(args: HangArgs, ctx: ToolContext) -> str:
    """Write this process's pid into the workspace, then sleep (fault tests kill it)."""
    (ctx.workspace / f"hang-{ctx.call_id}.pid").write_text(str(os.getpid()))
    time.sleep(args.seconds)
    return "woke up"


@tool(queue="faults", timeout=5)
def short_hang(args: HangArgs, ctx: ToolContext) -> str:
    """`hang` with a 5 s limit: a fault test whose result never comes back reaches its deadline soon."""
    return hang(args, ctx)


@tool(queue="faults")
def patient(args: HangArgs, ctx: ToolContext) -> str:
    """Write this process's pid into the workspace, then wait, asking every 50 ms whether the call
    was cancelled, as a long tool does (fault tests take Redis away meanwhile)."""
    (ctx.workspace / f"patient-{ctx.call_id}.pid").write_text(str(os.getpid()))
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        if ctx.cancelled():
            return "cancelled"
        time.sleep(0.05)
    return "waited it out"


@tool(queue="faults", timeout=1)
def quick_timeout(args: HangArgs, ctx: ToolContext) -> str:
    """Runs past its own 1 s limit."""
    time.sleep(args.seconds)
    return "should not get here"


@tool
def count_runs(args: NoArgs, ctx: ToolContext) -> str:
    """Append a line per execution to runs-<call_id>.txt in the workspace (at-most-once tests)."""
    with open(ctx.workspace / f"runs-{ctx.call_id}.txt", "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.2)
    return "counted"


class NoteArgs(BaseModel):
    title: str
    type: str = "note"


@tool(namespace="notes")
def file_note(args: NoteArgs, ctx: ToolContext) -> str:
    """Arguments named like JSON Schema keywords (`title`, `type`) under a strict schema."""
    return f"filed {args.type} {args.title!r}"


TAG_PARAMETERS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                  "required": ["tags"], "additionalProperties": False}


@tool(parameters=TAG_PARAMETERS)
def count_tags(args, ctx: ToolContext) -> str:
    """A function tool declared by its JSON Schema alone: the handler gets the parsed dict."""
    return f"{type(args).__name__} with {len(args['tags'])} tags"


# --- limits across the fleet (tests/integration/test_limits.py) ---


@tool(max_concurrency=2)
def limited_sleep(args: SleepArgs, ctx: ToolContext) -> str:
    """At most 2 run at once across the fleet: sleep, then say when it ran."""
    return sleep_echo(args, ctx)


@tool(rate_limit="4/s")
def rated_noop(args: NoArgs, ctx: ToolContext) -> str:
    """At most 4 start per second across the fleet."""
    return json.dumps({"start": time.time()})


@tool(queue="faults", max_concurrency=1, timeout=60)
def limited_hang(args: HangArgs, ctx: ToolContext) -> str:
    """One at a time across the fleet: write this process's pid, then sleep (the test kills it)."""
    return hang(args, ctx)


class TickArgs(BaseModel):
    label: str
    ticks: int = 5


@tool(streams_output=True, flower_args={"label": "value"})
def ticker(args: TickArgs, ctx: ToolContext) -> str:
    """Print a tick every 0.4 s; a watched turn sees them as they come (a user tool that streams)."""
    for i in range(1, args.ticks + 1):
        if ctx.output is not None:
            ctx.output.write(f"{args.label} {i}\n".encode())
        time.sleep(0.4)
    return f"{args.ticks} ticks"
