"""Many turns at once from one process: concurrent `Session`s on one `Runtime`, as `toolq batch` runs them.

    toolq fake-model --port 8765 &            # a scripted Responses API (or use the real one)
    OPENAI_BASE_URL=http://127.0.0.1:8765/v1 OPENAI_API_KEY=fake python examples/many_sessions.py "list the files" "say hi"

With no REDIS_URL, `Runtime.connect()` starts an embedded Redis-protocol server and two workers
for the run, as `toolq run` does; with one, it uses the workers already serving that Redis.
Each session is one conversation; `workspace=` gives one its own folder (default: TOOLQ_WORKSPACE,
or the current directory).
"""

from __future__ import annotations

import asyncio
import sys

from toolq import Runtime, Session


async def main(prompts: list[str]) -> list:
    async with Runtime.connect() as runtime:  # the model and Redis from the environment

        async def one(prompt: str):
            session = Session(runtime)
            try:
                return await session.run_turn(prompt)  # a TurnOutcome: status, final_message, usage, error
            finally:
                await session.close()

        return await asyncio.gather(*(one(p) for p in prompts))


if __name__ == "__main__":
    for outcome in asyncio.run(main(sys.argv[1:] or ["list the files", "say hi"])):
        print(f"{outcome.turn_id} {outcome.status}: {outcome.final_message or outcome.error}")
