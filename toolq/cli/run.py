"""`toolq run` and `toolq demo`: settings + (embedded stack) + runtime + session + view.

As `codex exec` does, stdout holds only the turn's final message (or, with `--json`, the events),
and the live view and every status line go to stderr; `-o FILE` writes the final message to FILE.

Ctrl-C, SIGTERM and SIGHUP (a closed terminal, `timeout`, systemd, a deleted Kubernetes Job)
cancel the turn the way `toolq cancel` does: the durable record first (so no worker starts a
call of this turn), then the running calls are revoked and given aborted outputs, and the session
is written. SIGKILL leaves no handler: the embedded stack dies by its parent-death signal.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import stat
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from toolq.cli.envs import EnvChoice, Placed, environment_instructions, place
from toolq.cli.exits import exit_status
from toolq.cli.terminal import printable
from toolq.cli.view import TICK_SECS, JsonView, LiveView
from toolq.core import trusted_files
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings, absolute_workspace, workspace_problem
from toolq.local.starting import WorkersStarting
from toolq.orchestrator.history import History, pairing_problems
from toolq.orchestrator.transport.durable import TurnSettings, TurnStore
from toolq.orchestrator.transport.redis_faults import reaching
from toolq.orchestrator.turn import Runtime, Session, TurnOutcome, new_turn_id

#: How refusals name the conversation's file.
SESSION = "session file"
#: How refusals name the final message's file.
LAST_MESSAGE = "--output-last-message"
#: ... and the turn's diff's file.
PATCH = "--patch"


def run_prompt(settings: Settings, prompt: str, *, json_events: bool = False, session_file: Path | None = None,
               last_message_file: Path | None = None, environment: EnvChoice | None = None) -> int:
    """`environment`: the turn runs in an environment on a worker host (`--upload`, `--git`,
    `--from`) instead of the shared workspace, which is then neither checked nor used."""
    if environment is None and (problem := workspace_problem(settings.workspace)):
        raise ConfigurationError(problem)
    # Where toolq's own files may not lie: the model's commands write in the shared workspace;
    # with --apply toolq writes the turn's changes into the uploaded folder.
    guarded: list[Path] = [settings.workspace] if environment is None else \
        [environment.upload] if environment.apply and environment.upload else []
    if session_file:
        trusted_files.refuse_inside(session_file, guarded, SESSION)
    history = load_session(session_file) if session_file else None
    with ExitStack() as stack:
        answer = stack.enter_context(LastMessageFile.open(last_message_file, guarded)) \
            if last_message_file else None
        patch = stack.enter_context(LastMessageFile.open(environment.patch, guarded, PATCH)) \
            if environment is not None and environment.patch else None
        settings, starting = with_redis(settings, stack, json_events)
        outcome, history = asyncio.run(_run(settings, prompt, json_events, history, starting=starting,
                                            environment=environment, patch=patch))
        if session_file:
            save_session(session_file, history)
        if outcome.could_not_start and json_events:  # stdout is the events; the one line goes to stderr
            print(f"toolq run: {printable(str(outcome.error), lines=False)}", file=sys.stderr)
        deliver(outcome, json_events, answer)
    return exit_status(outcome)


class LastMessageFile:
    """`-o FILE`: opened before the turn starts (a refusal costs no turn) and emptied, so it never
    holds an earlier run's answer; the final message is written at the end, if the turn completed.
    Never through a link (O_NOFOLLOW), never inside the workspace, never a file that is not a
    regular file of ours: the same rules as `--session`'s file."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open(cls, path: Path, workspace: Path | list[Path], what: str = LAST_MESSAGE) -> LastMessageFile:
        trusted_files.refuse_inside(path, workspace if isinstance(workspace, list) else [workspace], what)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigurationError(f"{what} {path} is a symbolic link; toolq does not write "
                                         "through one") from None
            if e.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK: the open does not wait for one)
                raise ConfigurationError(f"{what} {path} is not a regular file") from None
            raise ConfigurationError(f"{what} {path}: {e.strerror}") from None
        st = os.fstat(fd)
        problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
                   else f"belongs to uid {st.st_uid}, not you" if st.st_uid != os.geteuid() else None)
        if problem:  # checked before it is emptied: another user's file is left as it was
            os.close(fd)
            raise ConfigurationError(f"{what} {path} {problem}")
        os.ftruncate(fd, 0)
        return cls(fd, path)

    def write(self, text: str) -> None:
        data = text.encode()
        while data:
            data = data[os.write(self.fd, data):]

    def __enter__(self) -> LastMessageFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def deliver(outcome: TurnOutcome, json_events: bool, answer: LastMessageFile | None) -> None:
    """The final message of a completed turn: on stdout (unless stdout is the events, or stdout and
    stderr are both terminals, where the live view already showed it), and in `-o`'s file as the
    model wrote it. On stdout it goes through `printable`: a pipe's reader is often a terminal too."""
    message = outcome.final_message if outcome.status == "completed" else None
    if answer is not None and outcome.status == "completed":
        if message is None:
            print(f"toolq: no final message; {answer.path} is left empty", file=sys.stderr)
        answer.write(message or "")
    if message is None or json_events or (_isatty(sys.stdout) and _isatty(sys.stderr)):
        return
    text = printable(message)
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # a reader that went away
        pass


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def load_session(path: Path) -> History:
    """A conversation saved by an earlier `toolq run --session` (empty if the file is new)."""
    data = trusted_files.read_bytes(path, SESSION)
    if data is None:
        return History()
    try:
        items = json.loads(data)
        if not isinstance(items, list):
            raise ValueError("not a JSON list of items")
    except ValueError as e:
        raise ConfigurationError(f"session file {path} is not a toolq session: {e}") from None
    return History(items)


def save_session(path: Path, history: History) -> None:
    """Paired before it is written, so the next turn starts from a valid history."""
    trusted_files.replace(path, json.dumps(history.for_prompt(), indent=1).encode(), SESSION)


def run_demo(settings: Settings, *, json_events: bool = False, workspace: Path | None = None,
             last_message_file: Path | None = None) -> int:
    from toolq.dev.fake_model.server import FakeModel

    if workspace is not None:
        workspace = absolute_workspace(workspace)
        if problem := workspace_problem(workspace):
            raise ConfigurationError(problem)
    with ExitStack() as stack:
        temporary = workspace is None
        if workspace is None:
            workspace = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="toolq-demo-")))
        fake = stack.enter_context(FakeModel())
        settings = settings.model_copy(update={"openai_base_url": fake.base_url, "openai_api_key": "demo",
                                               "workspace": workspace})
        answer = stack.enter_context(LastMessageFile.open(last_message_file, workspace)) \
            if last_message_file else None
        settings, starting = with_redis(settings, stack, json_events)
        outcome, _ = asyncio.run(_run(settings, "Show me what toolq can do.", json_events, starting=starting))
        if not json_events:  # the demo's own report: status lines, on stderr with the view
            created = workspace / "hello.txt"
            where = f"workspace {workspace}" + (" (a temporary folder, removed as the demo ends)" if temporary else "")
            print(f"\n{where}: hello.txt = {created.read_text().strip()!r}"
                  if created.exists() else f"\n{where}: hello.txt was not created", file=sys.stderr)
            problems = [p for body in fake.requests for p in pairing_problems(body.get("input", []))]
            paired = f"PAIRING PROBLEMS: {problems}" if problems else "every call was paired with exactly one output."
            print(f"{len(fake.requests)} model requests; {paired}", file=sys.stderr)
        deliver(outcome, json_events, answer)
    return exit_status(outcome)


def with_redis(settings: Settings, stack: ExitStack, quiet: bool) -> tuple[Settings, WorkersStarting | None]:
    """No REDIS_URL: start a private server and workers for this run (stopped on exit). The
    workers boot while the first model request goes out (the first call waits for them), except
    with MCP servers configured: the model's first tool list needs their tools, which the workers
    advertise when ready."""
    if settings.redis_url:
        return settings, None
    from toolq.local import warm
    from toolq.local.embedded import EmbeddedStack

    found = None if settings.mcp or settings.mcp_config else warm.find(settings)
    if found is not None and found.warm is not None:  # `toolq up` left one for these tools: no boot to wait for
        return settings.model_copy(update={"redis_url": found.redis_url, "signing_key": found.warm.signing_key}), None

    if not quiet:
        print("no REDIS_URL: starting an embedded Redis-protocol server and 2 workers...", file=sys.stderr)
    embedded = stack.enter_context(EmbeddedStack(workers=2, concurrency=4, tools=settings.tools,
                                                 wait_for_workers=bool(settings.mcp or settings.mcp_config)))
    settings = settings.model_copy(update={"redis_url": embedded.url, "signing_key": embedded.signing_key})
    return settings, embedded.starting


def default_instructions(settings: Settings) -> str:
    return (
        f"You are a coding agent. Your tools run on a fleet of workers that share the workspace "
        f"{settings.workspace}; relative paths resolve there. Independent tool calls may be made in "
        "parallel. Answer with a short summary once the task is done."
    )


def resume_turn(settings: Settings, turn_id: str, *, json_events: bool = False,
                session_file: Path | None = None, last_message_file: Path | None = None) -> int:
    """`toolq resume TURN_ID`: finish an orphaned turn (its orchestrator died) from Redis alone."""
    if not settings.redis_url:
        raise ConfigurationError("toolq resume needs REDIS_URL: an embedded stack's Redis ends with its `toolq run`")
    with reaching(settings.redis_url):
        saved = asyncio.run(_saved_settings(settings, turn_id))
    if saved is not None:  # the tools, workspace and model the turn was started with
        settings = settings.model_copy(update={"tools": saved.tools, "workspace": Path(saved.workspace),
                                               "model": saved.model})
    if session_file:
        trusted_files.refuse_inside(session_file, [settings.workspace], SESSION)
    with ExitStack() as stack:
        answer = stack.enter_context(LastMessageFile.open(last_message_file, settings.workspace)) \
            if last_message_file else None
        outcome, history = asyncio.run(_run(settings, "", json_events, turn_id=turn_id, resume=True))
        if session_file:
            save_session(session_file, history)
        deliver(outcome, json_events, answer)
    return exit_status(outcome)


async def _saved_settings(settings: Settings, turn_id: str) -> TurnSettings | None:
    from toolq.orchestrator.transport.ledger import Ledger

    ledger = Ledger.from_url(settings.redis_target() or "")
    try:
        return (await TurnStore(ledger.r, settings.turn_lease).load(turn_id))[1]
    finally:
        await ledger.aclose()


async def _run(settings: Settings, prompt: str, json_events: bool, history: History | None = None, *,
               turn_id: str | None = None, resume: bool = False, starting: WorkersStarting | None = None,
               environment: EnvChoice | None = None,
               patch: LastMessageFile | None = None) -> tuple[TurnOutcome, History]:
    view: Any = JsonView() if json_events else LiveView()  # JSON on stdout; the live view on stderr
    emit: Any = _WithTraceLink(view, settings.trace_url) if isinstance(view, LiveView) and settings.trace_url \
        else view
    runtime = await Runtime.create(settings)
    runtime.fleet.dispatcher.fleet.starting = starting  # a call waits for the embedded workers still booting
    placed: Placed | None = None
    try:
        if environment is not None:
            placed = await place(runtime, environment, view, starting)
        instructions = settings.instructions or (
            environment_instructions(environment) if environment is not None else default_instructions(settings))
        session = Session(runtime, instructions=instructions, **placed.session_args(settings) if placed else {})
    except BaseException:  # a refused workspace (a resumed turn's) or environment: the one line, nothing left open
        if placed is not None:
            await placed.destroy()
        await runtime.aclose()
        raise
    if history is not None:
        session.history = history
    turn_id = turn_id or new_turn_id()
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()

    def interrupt(sig: signal.Signals) -> None:
        # Durable first, so a call still in the queue never starts; then stop this turn.
        task = loop.create_task(_record_cancel(runtime, turn_id, sig))
        pending.add(task)
        task.add_done_callback(pending.discard)
        session.cancel()

    for sig in CANCEL_SIGNALS:
        loop.add_signal_handler(sig, interrupt, sig)
    ticker = loop.create_task(_tick(view)) if isinstance(view, LiveView) and view.tty else None
    try:
        if resume:
            return await session.resume(turn_id, emit), session.history
        outcome = await session.run_turn(prompt, emit, turn_id=turn_id)
        if placed is not None:  # `turn.completed` carried the checkpoint and the diff; now --patch, --apply
            await placed.deliver(outcome, view, patch)
        return outcome, session.history
    finally:
        if ticker is not None:
            ticker.cancel()
        if isinstance(view, LiveView):
            view.close()
        for sig in CANCEL_SIGNALS:
            loop.remove_signal_handler(sig)
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        await session.close()  # the conversation ends with `toolq run`: so do its sessions
        if placed is not None:
            await placed.destroy()  # and so does its environment
        await runtime.aclose()
        flush_traces()  # the command line exits with os._exit: no atexit hook would export them


def flush_traces() -> None:
    """Export the run's spans, and its OTLP metric points, before the process exits (no-ops when
    off): the command line exits with os._exit, so neither SDK's exit hook runs; each is waited for
    at most 5 s against a collector that does not answer."""
    if "toolq.telemetry.tracing" in sys.modules:  # imported by the turn: never loaded here for nothing
        from toolq.telemetry import tracing

        tracing.flush()
        if "toolq.telemetry.metrics" in sys.modules:
            from toolq.telemetry import metrics

            if metrics.on():
                tracing.within(metrics.flush, 5.0)


class _WithTraceLink:
    """The live view, and once a turn has started, its trace's address (`TOOLQ_TRACE_URL`) on a
    line of its own, when tracing is on."""

    def __init__(self, view: LiveView, url: str) -> None:
        self._view, self._url = view, url

    def __call__(self, event: Any) -> None:
        self._view(event)
        trace_id = getattr(event, "trace_id", None)
        if event.type == "turn.started" and trace_id:
            from toolq.telemetry.tracing import trace_link

            self._view.write(f"trace {trace_link(trace_id, self._url)}")


async def _tick(view: LiveView) -> None:
    """Redraw the live view's status line (running calls and their elapsed time) each second."""
    while True:
        await asyncio.sleep(TICK_SECS)
        view.tick()


#: Each cancels the turn as Ctrl-C does (the exit status is then 130, `exits.exit_status`).
CANCEL_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


async def _record_cancel(runtime: Runtime, turn_id: str, sig: signal.Signals) -> None:
    """The durable cancel record; with Redis down the turn still ends here, unrecorded."""
    try:
        await runtime.fleet.ledger.cancel_turn(turn_id, reason=sig.name)
    except Exception as e:
        print(f"toolq run: could not record the cancel in Redis: {e}", file=sys.stderr)
