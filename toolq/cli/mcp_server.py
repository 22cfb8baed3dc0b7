"""`toolq mcp-server`: the fleet's tools as an MCP server (toolq/frontdoors/mcp_server), over stdio
(the default: an MCP client starts it) or streamable HTTP (`--listen http://HOST:PORT`).

With no REDIS_URL it starts an embedded Redis-protocol server and two workers, as `toolq run`
does. Listening on a non-loopback address needs a bearer token (`--token-file FILE` or
TOOLQ_MCP_SERVER_TOKEN); without one it refuses to start, in one line.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from contextlib import ExitStack

from toolq.cli.envs import EnvChoice
from toolq.cli.run import with_redis
from toolq.cli.terminal import log_to_stderr
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings, workspace_problem
from toolq.frontdoors.listening import Listen, parse_listen, read_token_file
from toolq.frontdoors.mcp_server import MCP_PATH, McpFrontDoor, serve_http, serve_stdio
from toolq.local.starting import WorkersStarting
from toolq.orchestrator.environments import Environment
from toolq.orchestrator.fleet import Fleet
from toolq.orchestrator.transport.redis_faults import reaching

#: The variable holding the bearer token when no --token-file is given (`Settings.mcp_server_token`).
TOKEN_ENV = "TOOLQ_MCP_SERVER_TOKEN"


def read_token(token_file: str | None, configured: str | None) -> str | None:
    """The bearer token: --token-file's, else TOOLQ_MCP_SERVER_TOKEN (`configured`), else None."""
    if token_file is None:
        return configured or None
    try:
        return read_token_file(token_file)
    except ValueError as e:
        raise ConfigurationError(str(e)) from None


def mcp_server_cmd(settings: Settings, *, listen: str, environment: EnvChoice | None,
                   token_file: str | None) -> int:
    try:
        where = parse_listen(listen, "http", paths=("", "/", MCP_PATH))
    except ValueError as e:
        raise ConfigurationError(str(e)) from None
    log_to_stderr()  # a client's text is in the log lines: no escape sequence reaches the terminal
    # The SDK logs a client's ordinary goodbye (an HTTP session deleted while its stream was open)
    # as an error with a traceback; what toolq's side of a call does wrong is logged by toolq.
    logging.getLogger("mcp").setLevel(logging.CRITICAL)
    token = read_token(token_file, settings.mcp_server_token)
    if where is not None and not where.loopback and token is None:
        raise ConfigurationError(f"toolq mcp-server listens on {where.host}, not a loopback address: give a "
                                 f"bearer token (--token-file FILE or {TOKEN_ENV})")
    if environment is None and (problem := workspace_problem(settings.workspace)):
        raise ConfigurationError(problem)
    with ExitStack() as stack:
        settings, starting = with_redis(settings, stack, quiet=False)
        with reaching(settings.redis_url):  # Redis away: one line naming it, exit 2
            asyncio.run(_serve(settings, starting, where, environment, token))
    return 0


async def _serve(settings: Settings, starting: WorkersStarting | None, where: Listen | None,
                 environment: EnvChoice | None, token: str | None) -> None:
    def make_environment(fleet: Fleet) -> Environment:
        assert environment is not None
        return fleet.environment(upload=environment.upload, git=environment.git, checkpoint=environment.checkpoint)

    fleet = await Fleet.open(settings)
    fleet.dispatcher.fleet.starting = starting  # a call waits for the embedded workers still booting
    door = McpFrontDoor(fleet, make_environment=make_environment if environment is not None else None)
    try:
        if where is None:
            serving = asyncio.current_task()
            assert serving is not None
            loop = asyncio.get_running_loop()
            stopping: list[asyncio.Task[None]] = []

            async def stop() -> None:
                try:  # the calls in flight are cancelled and answered (aborted) while stdout is open
                    await door.stop_calls()
                finally:
                    serving.cancel()

            def on_signal() -> None:
                if stopping:  # a second signal: stop now
                    serving.cancel()
                else:
                    stopping.append(asyncio.create_task(stop()))

            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # serve_http stops on its own
                loop.add_signal_handler(sig, on_signal)
            try:
                await serve_stdio(door)
            except asyncio.CancelledError:
                pass
        else:
            await serve_http(door, where.host, where.port, token=token, loopback=where.loopback,
                             listening=lambda url: print(f"toolq mcp-server: listening on {url}", file=sys.stderr,
                                                         flush=True))
    finally:
        await door.aclose()
        await fleet.aclose()
