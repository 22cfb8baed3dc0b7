"""Benchmark: SSE events decoded per second, toolq's `ModelClient` vs the `openai` SDK.

Both read the same recorded transcript (the two-parallel-calls recording, its items repeated to
about `target_events` events in one response) from the same fake server, run in its own process
so it does not share our GIL. One run each; events/s counts every SSE event in the body.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from toolq.core import import_path
from toolq.dev.bench.harness import goal
from toolq.dev.fake_model.render import replay_frames
from toolq.orchestrator.model_client import ModelClient, ModelSettings, build_request

# Package data (a copy of tests/fixtures/sse/sse-parallel-function-calls.txt, source noted there).
FIXTURE = Path(__file__).resolve().parent / "recordings" / "sse-parallel-function-calls.txt"


GOAL = 1.0
"""toolq decodes at least as fast as the official SDK."""


def build_transcript(fixture: Path, target_events: int) -> list[bytes]:
    """The fixture's item events repeated, renumbered, between one `created` and one `completed`."""
    events = [_data(f) for f in replay_frames(fixture)]
    head = [e for e in events if e["type"] in ("response.created", "response.in_progress")]
    tail = [e for e in events if e["type"] == "response.completed"]
    body = [e for e in events if e not in head and e not in tail]
    per_round = max(len({e["output_index"] for e in body if "output_index" in e}), 1)
    rounds = max((target_events - len(head) - len(tail)) // len(body), 1)
    out = list(head)
    for r in range(rounds):
        for e in body:
            e = dict(e)
            if "output_index" in e:
                e["output_index"] += r * per_round
            out.append(e)
    out += tail
    frames = []
    for seq, e in enumerate(out):
        e["sequence_number"] = seq
        frames.append(f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n".encode())
    return frames


def _data(frame: bytes) -> dict[str, Any]:
    line = next(ln for ln in frame.decode().splitlines() if ln.startswith("data:"))
    return json.loads(line[5:])


async def _ours(base_url: str) -> int:
    async with ModelClient(ModelSettings(base_url=base_url, api_key="bench", model="bench")) as client:
        n = 0
        async for _ in client.stream(build_request("bench", [{"role": "user", "content": "go"}], [])):
            n += 1
        return n


async def _sdk(base_url: str) -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    try:
        stream = await client.responses.create(model="bench", input="go", stream=True)
        n = 0
        async for _ in stream:
            n += 1
        return n
    finally:
        await client.close()


def _timed(fn: Any, base_url: str) -> tuple[float, int]:
    start = time.perf_counter()
    n = asyncio.run(fn(base_url))
    return time.perf_counter() - start, n


def run(out: IO[str] = sys.stdout, target_events: int = 20_000) -> dict[str, Any]:
    if not FIXTURE.is_file():
        print(f"decode bench skipped: fixture not found at {FIXTURE}", file=out)
        return {"skipped": True}
    frames = build_transcript(FIXTURE, target_events)
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "transcript.sse"
        body.write_bytes(b"".join(frames))
        script = Path(tmp) / "script.json"
        script.write_text(json.dumps([[{"directive": "replay", "path": str(body)}]] * 2))
        server = subprocess.Popen(
            [*import_path.python_argv("-m", "toolq.cli.main"), "fake-model", "--script", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=import_path.NEUTRAL_CWD,
            text=True,
        )
        try:
            assert server.stdout is not None
            base_url = server.stdout.readline().strip()
            ours_s, ours_n = _timed(_ours, base_url)
            sdk_s, sdk_n = _timed(_sdk, base_url)
        finally:
            server.terminate()
            server.wait(timeout=10)
    n = len(frames)
    result = {
        "events": n,
        "toolq_events_per_s": n / ours_s,
        "sdk_events_per_s": n / sdk_s,
        "ratio": sdk_s / ours_s,
        "toolq_yielded": ours_n,
        "sdk_yielded": sdk_n,
    }
    result["goal_met"], note = goal(result["ratio"], GOAL, at_least=True)
    print(f"decode: {n} SSE events in one response, served by the fake model over TCP", file=out)
    print(f"  toolq ModelClient.stream   {result['toolq_events_per_s']:>10,.0f} events/s  ({ours_s:.3f} s)", file=out)
    print(f"  openai SDK (AsyncOpenAI)   {result['sdk_events_per_s']:>10,.0f} events/s  ({sdk_s:.3f} s)", file=out)
    print(f"  ratio toolq/sdk            {result['ratio']:>10.2f}x  ({note})", file=out)
    return result


if __name__ == "__main__":
    run()
