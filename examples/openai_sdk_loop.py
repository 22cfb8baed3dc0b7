"""Drive the model with the official `openai` SDK; let toolq run the tool calls on its fleet.

    toolq fake-model --port 8765 &            # a scripted Responses API (or use the real one)
    OPENAI_BASE_URL=http://127.0.0.1:8765/v1 OPENAI_API_KEY=fake python examples/openai_sdk_loop.py

With no REDIS_URL, `Fleet.connect()` starts an embedded Redis-protocol server and two workers
for the run, as `toolq run` does; with one, it uses the workers already serving that Redis.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

from openai import AsyncOpenAI

from toolq import Fleet


async def main(prompt: str) -> str:
    client = AsyncOpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    workspace = os.environ.get("TOOLQ_WORKSPACE") or tempfile.mkdtemp(prefix="toolq-example-")
    async with Fleet.connect(redis_url=os.environ.get("REDIS_URL"), workspace=workspace) as fleet:
        input_items: list = [{"role": "user", "content": prompt}]
        while True:
            # toolq sends `store: false`, so the whole history goes back each time.
            stream = await client.responses.create(model=os.environ.get("TOOLQ_MODEL", "gpt-5.5"), input=input_items,
                                                   tools=fleet.tool_specs(), store=False, stream=True)
            response = None
            async for event in stream:
                if event.type == "response.completed":
                    response = event.response
            assert response is not None, "the stream ended without response.completed"
            input_items += [item.model_dump(exclude_none=True) for item in response.output]
            outputs = await fleet.run_calls(response.output)  # one output per call, in call order
            if not outputs:
                return response.output_text  # no calls: the model's final answer
            for out in outputs:
                print(f"  {out['call_id']}: {str(out.get('output', ''))[:60]!r}", file=sys.stderr)
            input_items += outputs


if __name__ == "__main__":
    print(asyncio.run(main(" ".join(sys.argv[1:]) or "Show me what toolq can do.")))
