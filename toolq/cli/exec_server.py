"""`toolq exec-server`: Codex's exec-server protocol on the fleet (toolq/frontdoors/exec_server).

`toolq exec-server --listen ws://127.0.0.1:PORT` prints `toolq exec-server: listening on URL` as
its first line of stdout (port 0: the port it got), then serves until SIGINT/SIGTERM; `--listen
stdio` speaks on stdin/stdout and ends with stdin. Without REDIS_URL it uses your warm fleet
(`toolq up`) or starts an embedded one, as `toolq run` does."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path

from toolq.cli.envs import ChoiceError, EnvChoice, choose
from toolq.cli.terminal import log_to_stderr
from toolq.core.settings import Settings, workspace_problem
from toolq.frontdoors.exec_server.paths import Root
from toolq.frontdoors.exec_server.server import (
    Listen,
    ListenError,
    Sessions,
    parse_listen,
    serve_stdio,
    serve_websocket,
)
from toolq.frontdoors.exec_server.session import Context
from toolq.frontdoors.listening import read_token_file
from toolq.local.starting import WorkersStarting

log = logging.getLogger("toolq.exec_server")

PREFIX = "toolq exec-server"


class Refused(Exception):
    """Bad options: one line on stderr, exit 2."""


def plan(settings: Settings, *, listen: str, upload: str | None, git: str | None, checkpoint: str | None,
         workspace: str | None, root: str | None, token_file: str | None
         ) -> tuple[Listen | None, EnvChoice | None, Root, str | None]:
    """The checked options: where to listen, the environment each session gets, the client's root, the token."""
    try:
        where = parse_listen(listen)
        choice = choose(upload=upload, git=git, checkpoint=checkpoint, workspace=workspace)
    except (ValueError, ChoiceError) as e:
        raise Refused(str(e)) from None
    token = read_token(token_file) if token_file else settings.exec_server_token
    if where is not None and not where.loopback and not token:
        raise Refused(f"listening on {where.host} (not loopback) needs a token: --token-file FILE or "
                      "TOOLQ_EXEC_SERVER_TOKEN (clients then connect with ?token=TOKEN in the URL)")
    if choice is None and (problem := workspace_problem(settings.workspace)):
        raise Refused(problem)
    if root is None:
        if choice is not None and choice.upload is None:
            raise Refused("--git and --from need --root PATH: the folder your client (Codex's -C) names the "
                          "workspace by")
        root = str(choice.upload if choice is not None and choice.upload is not None else settings.workspace)
    if not root.startswith("/"):
        root = str(Path(root).absolute())
    return where, choice, Root(root), token


def read_token(path: str) -> str:
    try:
        return read_token_file(path)
    except ValueError as e:
        raise Refused(str(e)) from None


def exec_server_cmd(settings: Settings, *, listen: str, upload: str | None = None, git: str | None = None,
                    checkpoint: str | None = None, workspace: str | None = None, root: str | None = None,
                    token_file: str | None = None) -> int:
    try:
        where, choice, client_root, token = plan(settings, listen=listen, upload=upload, git=git,
                                                 checkpoint=checkpoint, workspace=workspace, root=root,
                                                 token_file=token_file)
    except Refused as e:
        print(f"{PREFIX}: {e}", file=sys.stderr)
        return 2
    log_to_stderr()  # a client's text is in the log lines: no escape sequence reaches the terminal
    log.setLevel(logging.INFO)
    from toolq.cli.run import with_redis

    with ExitStack() as stack:
        settings, starting = with_redis(settings, stack, quiet=where is None)
        try:
            asyncio.run(_serve(settings, starting, where, choice, client_root, token))
        except KeyboardInterrupt:
            pass
        except ListenError as e:
            print(f"{PREFIX}: {e}", file=sys.stderr)
            return 2
    return 0


#: toolq's reason, on each live process's stderr, when the server is stopped (SIGINT, SIGTERM).
STOPPED = "toolq exec-server stopped"


async def _serve(settings: Settings, starting: WorkersStarting | None, where: Listen | None, choice: EnvChoice | None,
                 root: Root, token: str | None) -> None:
    from toolq.core.signing import required_signer
    from toolq.orchestrator.environments import pending_source
    from toolq.orchestrator.fleet import Fleet
    from toolq.orchestrator.transport.redis_faults import reaching
    from toolq.workers.redis_clients import async_client

    fleet = await Fleet.open(settings, read_fleet_tools=False)
    if starting is not None:
        fleet.dispatcher.fleet.starting = starting  # calls wait for them, not the grace
    streams = async_client(settings.redis_target() or settings.redis_url or "")
    source = pending_source(choice.upload, choice.git, choice.checkpoint) if choice is not None else None
    signer = required_signer(settings.signing_key, "toolq exec-server")
    sessions = Sessions(Context(fleet, root, source, streams, signer, settings.exec_server_resume))
    serving = asyncio.current_task()
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    async def stop() -> None:
        try:  # while the connections are open: each client is told how its processes ended
            await sessions.stop_all(STOPPED)
        finally:
            if serving is not None:
                serving.cancel()

    def on_signal() -> None:
        if stopping and serving is not None:  # a second signal: stop now
            serving.cancel()
        elif not stopping:
            stopping.append(asyncio.create_task(stop()))

    for sig in (signal.SIGINT, signal.SIGTERM):
        with suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    try:
        with reaching(settings.redis_url):  # a wrong REDIS_URL: one line now, not a failure at each request
            await streams.ping()
        if where is None:
            await serve_stdio(sessions)
        else:
            await serve_websocket(sessions, where, token, _listening(root))
    except asyncio.CancelledError:
        pass
    finally:
        await sessions.close_all()
        await streams.aclose()
        await fleet.aclose()


def _listening(root: Root) -> Callable[[str], None]:
    def say(url: str) -> None:
        print(f"{PREFIX}: listening on {url}", flush=True)  # the first line of stdout: tests and scripts read it
        print(f"{PREFIX}: serving the workspace {root.path}; point Codex at it with CODEX_EXEC_SERVER_URL={url}",
              file=sys.stderr, flush=True)
    return say

