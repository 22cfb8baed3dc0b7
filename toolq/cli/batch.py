"""`toolq batch FILE.jsonl --concurrency N --out RESULTS.jsonl`: many turns at once from one process.

Each input line is one turn, `{"prompt": ..., "workspace": ..., "instructions": ...}` (only the
prompt is required). N sessions run at once on one `Runtime` (one fleet connection, one model
client, one result and one cancel subscription for all of them); each turn's result is appended to
RESULTS as soon as it ends (`BatchResult`), so a batch that dies keeps what it did. A line is
known by its number and a hash of its text: running again with the same RESULTS skips the lines
that already have a completed (or failed) result, and runs the rest (never run, cancelled,
invalid). A bad line gets an `invalid` result naming the problem; it never stops the batch.

Ctrl-C, SIGTERM and SIGHUP cancel the running turns as `toolq run` does (the durable record
first, then aborted outputs for their unfinished calls) and start no more; `toolq cancel
TURN_ID` cancels one turn and the batch goes on.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import signal
import sys
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolq.cli.batch_progress import Progress, ended_call
from toolq.cli.exits import EXIT_CANCELLED, EXIT_FAILED
from toolq.cli.run import CANCEL_SIGNALS, default_instructions, with_redis
from toolq.core import trusted_files
from toolq.core.errors import ConfigurationError, problems
from toolq.core.settings import Settings, absolute_workspace, workspace_problem
from toolq.local.starting import WorkersStarting
from toolq.orchestrator.transport.redis_faults import REDIS_FAULTS, RedisUnreachable
from toolq.orchestrator.turn import Runtime, Session, TurnOutcome, new_turn_id

Status = Literal["completed", "failed", "cancelled", "invalid"]


class BatchLine(BaseModel):
    """One input line: a turn to run."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a clear error, not a silent default

    prompt: str = Field(min_length=1)
    workspace: Path | None = None
    """Where its tools work (default: `--workspace`, or the current directory)."""
    instructions: str | None = None


class BatchResult(BaseModel):
    """One output line: how one input line's turn ended."""

    key: str
    """`<line number>:<hash of the line>`: what a re-run matches to skip the line."""
    line: int
    turn_id: str | None = None
    status: Status
    final_message: str | None = None
    usage: dict[str, int] = Field(default_factory=dict)
    error: str | None = None
    calls: int = 0
    failed_calls: int = 0
    started: bool = True
    """False: the turn never reached the fleet (Redis away), so a re-run runs it again."""


class Entry(BaseModel):
    number: int
    key: str
    turn: BatchLine | None = None
    problem: str | None = None
    """Why the line cannot run (then `turn` is None)."""


def line_key(number: int, raw: str) -> str:
    return f"{number}:{hashlib.sha256(raw.strip().encode(errors='surrogateescape')).hexdigest()[:16]}"


#: How refusals name the results file.
OUT = "--out"

def read_lines(path: Path, errors: str = "surrogateescape") -> list[str]:
    """The file's lines, split at newlines only: `str.splitlines` also splits at U+2028, NEL and
    friends, which JSON strings hold unescaped (a final message with one lost its result). Bytes
    that are not UTF-8 are kept as surrogates for `parse_line` to refuse (or `errors` says)."""
    return split_lines(path.read_bytes(), errors)


def split_lines(data: bytes, errors: str = "surrogateescape") -> list[str]:
    lines = data.split(b"\n")
    return [line.decode(errors=errors) for line in (lines[:-1] if lines[-1] == b"" else lines)]


def read_entries(lines: Iterable[str]) -> list[Entry]:
    """Every non-blank line, numbered from 1, parsed or with its problem in one line."""
    entries = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        entries.append(parse_line(number, raw))
    return entries


def parse_line(number: int, raw: str) -> Entry:
    key = line_key(number, raw)
    try:
        raw.encode()
    except UnicodeEncodeError as e:
        return Entry(number=number, key=key, problem=f"line {number}: not UTF-8 text (at character {e.start + 1})")
    try:
        turn = BatchLine.model_validate_json(raw)
    except ValidationError as e:
        said = "; ".join(f"{p.where or 'the line'}: {p.message}" for p in problems(e))
        return Entry(number=number, key=key, problem=f"line {number}: {said}")
    if turn.workspace is not None:
        turn.workspace = absolute_workspace(turn.workspace)
        if problem := workspace_problem(turn.workspace):
            return Entry(number=number, key=key, problem=f"line {number}: {problem}")
    return Entry(number=number, key=key, turn=turn)


def latest_statuses(out: Path) -> dict[str, str]:
    """Each key's latest status in `out`; unreadable lines (a batch killed mid-write) are ignored."""
    latest: dict[str, str] = {}
    data = trusted_files.read_bytes(out, OUT)
    if data is None:
        return latest
    for raw in split_lines(data, errors="replace"):
        try:
            r = BatchResult.model_validate_json(raw)
        except ValidationError:
            continue
        if r.started:
            latest[r.key] = r.status
        else:  # not done: the next run runs it
            latest.pop(r.key, None)
    return latest


class Results:
    """RESULTS, appended to one line per turn as it ends, flushed, so a killed batch keeps them."""

    def __init__(self, path: Path) -> None:
        f = trusted_files.open_append(path, OUT)
        if f.seek(0, 2) and (f.seek(-1, 2), f.read(1))[1] != b"\n":  # a line cut by a killed batch
            f.write(b"\n")  # must not swallow the next one
        self.file: IO[str] = io.TextIOWrapper(f, encoding="utf-8")
        self.statuses: dict[str, str] = {}
        """This run's status per key."""

    def write(self, result: BatchResult) -> None:
        self.file.write(result.model_dump_json() + "\n")
        self.file.flush()
        self.statuses[result.key] = result.status

    def close(self) -> None:
        self.file.close()


class Batch:
    """Runs entries N at a time on one runtime; `interrupt()` cancels the running ones."""

    def __init__(self, runtime: Runtime, settings: Settings, results: Results, progress: Progress,
                 concurrency: int) -> None:
        self.rt, self.settings, self.results, self.progress = runtime, settings, results, progress
        self.concurrency = concurrency
        self.running: dict[str, Session] = {}
        self.stopping: signal.Signals | None = None

    async def run(self, entries: list[Entry]) -> None:
        queue = iter(entries)
        await asyncio.gather(*(self._lane(queue) for _ in range(min(self.concurrency, len(entries)))))

    async def _lane(self, queue: Any) -> None:
        for entry in queue:  # one shared iterator: each entry goes to exactly one lane
            if self.stopping is not None:
                return
            if entry.turn is None:
                self._done(BatchResult(key=entry.key, line=entry.number, status="invalid", error=entry.problem,
                                       started=False))
                continue
            self._done(await self._run_one(entry, entry.turn))

    async def _run_one(self, entry: Entry, line: BatchLine) -> BatchResult:
        workspace = line.workspace or self.settings.workspace
        instructions = line.instructions or self.settings.instructions or default_instructions(
            self.settings.model_copy(update={"workspace": workspace}))
        session = Session(self.rt, instructions=instructions, workspace=workspace)
        turn_id = new_turn_id()
        counted = {"calls": 0, "failed_calls": 0}

        def heard(event: Any) -> None:
            failed = ended_call(event)
            if failed is not None:
                counted["calls"] += 1
                counted["failed_calls"] += failed
                self.progress.call_ended(failed)

        self.running[turn_id] = session
        self.progress.running += 1
        try:
            outcome = await session.run_turn(line.prompt, heard, turn_id=turn_id)
        except Exception as e:  # a bug: this line fails, the batch goes on
            outcome = TurnOutcome(turn_id=turn_id, status="failed", error=f"toolq failed: {type(e).__name__}: {e}")
        finally:
            self.running.pop(turn_id, None)
            self.progress.running -= 1
            await session.close()
        status = outcome.status
        if status == "running":  # run_turn returns an ended turn; were one running, it is not a success
            status = "failed"
        return BatchResult(key=entry.key, line=entry.number, turn_id=turn_id, status=status,
                           final_message=outcome.final_message, usage=outcome.usage.model_dump(),
                           error=outcome.error, started=not outcome.could_not_start, **counted)

    def _done(self, result: BatchResult) -> None:
        self.results.write(result)
        self.progress.turn_ended(result.status)

    def interrupt(self, sig: signal.Signals) -> list[asyncio.Task]:
        """Start no more turns; cancel the running ones (durable record first, as `toolq run`)."""
        self.stopping = sig
        tasks = []
        for turn_id, session in list(self.running.items()):
            tasks.append(asyncio.get_running_loop().create_task(self._record_cancel(turn_id, sig)))
            session.cancel()
        return tasks

    async def _record_cancel(self, turn_id: str, sig: signal.Signals) -> None:
        try:
            await self.rt.fleet.ledger.cancel_turn(turn_id, reason=sig.name)
        except Exception as e:  # Redis away: the turn still ends here, unrecorded
            print(f"toolq batch: could not record the cancel of {turn_id} in Redis: {e}", file=sys.stderr)


def run_batch(settings: Settings, path: Path, out: Path, *, concurrency: int, retry_failed: bool = False,
              progress_to: IO[str] = sys.stderr) -> int:
    """`toolq batch`: exit 0 when every line has a completed result, 1 when one failed or is
    invalid, 130 when interrupted, 2 when nothing could start (bad file, Redis unreachable)."""
    if not path.is_file():
        raise ConfigurationError(f"batch file {path} is not a file")
    if problem := workspace_problem(settings.workspace):
        raise ConfigurationError(problem)
    if not out.parent.is_dir():
        raise ConfigurationError(f"the folder of --out {out} does not exist")
    entries = read_entries(read_lines(path))
    workspaces = [settings.workspace, *(e.turn.workspace for e in entries if e.turn and e.turn.workspace)]
    trusted_files.refuse_inside(out, workspaces, OUT)
    latest = latest_statuses(out)
    done = ("completed",) if retry_failed else ("completed", "failed")
    todo = [e for e in entries if latest.get(e.key) not in done]
    skipped = len(entries) - len(todo)
    if skipped:
        print(f"toolq batch: {skipped} of {len(entries)} turns already done in {out}; running {len(todo)}",
              file=progress_to)
    stopped = False
    if todo:
        with ExitStack() as stack:
            settings, starting = with_redis(settings, stack, quiet=False)
            batch = asyncio.run(_run(settings, todo, out, concurrency, progress_to, starting))
        ran = list(batch.results.statuses.values())
        print(f"toolq batch: {len(ran)} turns: {ran.count('completed')} completed, {ran.count('failed')} failed, "
              f"{ran.count('cancelled')} cancelled, {ran.count('invalid')} invalid; {skipped} skipped (already "
              f"done); results in {out}", file=progress_to)
        latest.update(batch.results.statuses)
        stopped = batch.stopping is not None
    if stopped:
        return EXIT_CANCELLED
    return 0 if all(latest.get(e.key) == "completed" for e in entries) else EXIT_FAILED


async def _run(settings: Settings, todo: list[Entry], out: Path, concurrency: int, progress_to: IO[str],
               starting: WorkersStarting | None) -> Batch:
    try:
        runtime = await Runtime.create(settings)
    except REDIS_FAULTS as e:
        raise RedisUnreachable(settings.redis_url, e) from None
    try:  # not one failed result per line for a Redis that is not there (or refuses us)
        await runtime.fleet.ledger.r.ping()
    except BaseException as e:
        await runtime.aclose()
        if isinstance(e, REDIS_FAULTS):
            raise RedisUnreachable(settings.redis_url, e) from None
        raise
    runtime.fleet.dispatcher.fleet.starting = starting  # a call waits for the embedded workers still booting
    results = Results(out)
    progress = Progress(total=len(todo), out=progress_to)
    batch = Batch(runtime, settings, results, progress, concurrency)
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()

    def interrupt(sig: signal.Signals) -> None:
        for task in batch.interrupt(sig):
            pending.add(task)
            task.add_done_callback(pending.discard)

    for sig in CANCEL_SIGNALS:
        loop.add_signal_handler(sig, interrupt, sig)
    ticker = asyncio.create_task(_tick(progress))
    try:
        await batch.run(todo)
    finally:
        for sig in CANCEL_SIGNALS:
            loop.remove_signal_handler(sig)
        ticker.cancel()
        progress.show(final=True)
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        results.close()
        await runtime.aclose()
    return batch


async def _tick(progress: Progress) -> None:
    """Elapsed time moves on a terminal even while no turn ends."""
    while True:
        await asyncio.sleep(0.5 if progress.tty else 5.0)
        progress.show()


__all__ = ["Batch", "BatchLine", "BatchResult", "read_entries", "run_batch"]
