"""`toolq batch FILE.jsonl --concurrency N --out RESULTS.jsonl`: many turns at once from one process.

Each input line is one turn, `{"prompt": ..., "workspace": ..., "instructions": ...}` (only the
prompt is required); any other field (`id`, `instance_id`, `metadata`, ...) is copied untouched
into the line's result. N lanes run at once on one `Runtime` (one fleet connection, one model
client, one result and one cancel subscription for all of them). Each turn's result is appended
to RESULTS as soon as it ends, so a batch that dies keeps what it did; at the end RESULTS is
rewritten atomically with one line per key (a re-run replaces a key's line instead of adding a
second one). A line is known by its number and a hash of its text: running again with the same
RESULTS skips the lines that already have a completed (or failed) result, and runs the rest. A
bad line gets an `invalid` result naming the problem; it never stops the batch.

No lane ever awaits something only a library can end. A lane waits on its turn's `settled`
future, which the batch itself sets: when the turn's task ends, when the watchdog gives up on a
turn that ended but whose task did not (`STUCK_AFTER`), or when a signal's grace runs out. That
matters because on Python 3.11 a cancel that lands in a redis-py command can be swallowed
(`asyncio.wait_for` in redis-py's `send_packed_command`, CPython gh-86296), leaving a helper
task that only a cancel ends looping for ever: four lanes of a 1,024-turn batch waited on such a
task in `ConversationLease.release` and the batch never ended, deaf to SIGTERM.

Ctrl-C, SIGTERM and SIGHUP cancel the running turns as `toolq run` does (the durable record
first, then aborted outputs for their unfinished calls) and start no more; a lane whose turn has
not ended `STOP_GRACE` seconds later (or at a second signal) is written `cancelled` and left.
`toolq cancel TURN_ID` cancels one turn and the batch goes on.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import secrets
import signal
import stat
import sys
import time
import types
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from toolq.cli.batch_progress import Progress, ended_call
from toolq.cli.envs import (
    ChoiceError,
    EnvChoice,
    check_git,
    diff_fields,
    environment_instructions,
    named_workspace,
    parse_checkpoint,
)
from toolq.cli.exits import EXIT_CANCELLED, EXIT_FAILED
from toolq.cli.run import CANCEL_SIGNALS, default_instructions, with_redis
from toolq.cli.terminal import printable
from toolq.core import trusted_files, untrusted
from toolq.core.environments import GitSource, TurnDiff
from toolq.core.errors import ConfigurationError, problems
from toolq.core.settings import Settings, absolute_workspace, workspace_problem
from toolq.local.starting import WorkersStarting
from toolq.orchestrator.transport.redis_faults import REDIS_FAULTS, RedisUnreachable
from toolq.orchestrator.turn import Runtime, Session, TurnOutcome, new_turn_id
from toolq.orchestrator.turn_events import (
    AgentMessageView,
    ItemCompleted,
    TurnAborted,
    TurnCompleted,
    TurnFailed,
)
from toolq.orchestrator.turn_scope import stop

Status = Literal["completed", "failed", "cancelled", "invalid"]

#: After a signal, how long the running turns get to cancel themselves (durable record, aborted
#: outputs) before a lane still running is written `cancelled` and left behind.
STOP_GRACE = 5.0
#: How long closing a turn's session (its conversation lease) may take before it is cancelled
#: again: a cancel swallowed inside redis-py leaves the lease's beat running and `close()` waiting
#: on it; a second cancel reaches the beat. Closing takes milliseconds otherwise.
CLOSE_GRACE = 2.0
#: A line's own environment is destroyed in the close: its host unmounts and removes its files,
#: seconds on a loaded host, and a close cut short left it `ready` for the reaper to find later.
ENV_CLOSE_GRACE = 30.0
#: The watchdog names (one line on stderr) and lets go of a lane whose turn ended this long ago
#: but whose task has not: nothing of the turn is lost, its result is written from its end.
STUCK_AFTER = 30.0
#: The last steps (closing the runtime, cancelling what is left) never wait longer than this.
CLEANUP_GRACE = 5.0


#: The most environments one line may fork ("fork": N).
MAX_FORK = 256


class BatchLine(BaseModel):
    """One input line: a turn to run. Other fields pass through to the result (`Entry.extras`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    prompt: str = Field(min_length=1)
    workspace: Path | None = None
    """Where its tools work (default: `--workspace`, or the current directory)."""
    instructions: str | None = None
    upload: Path | None = None
    """The turn runs in an environment on a worker host made from a copy of this folder (issue 28)."""
    git: GitSource | None = None
    """... cloned from `{"url": ..., "ref": ...}` on the host."""
    from_: str | None = Field(default=None, alias="from")
    """... made from an earlier turn's checkpoint."""
    fork: int | None = Field(default=None, ge=1, le=MAX_FORK)
    """With "from": N turns of the line, each in its own environment forked from the checkpoint."""

    @model_validator(mode="after")
    def _one_source(self) -> BatchLine:
        given = [f'"{k}"' for k, v in (("workspace", self.workspace), ("upload", self.upload), ("git", self.git),
                                       ("from", self.from_)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are exclusive: give one")
        if self.fork is not None and self.from_ is None:
            raise ValueError('"fork" needs "from" (N environments forked from that checkpoint)')
        try:
            if self.from_ is not None:
                self.from_ = parse_checkpoint(self.from_)
            if self.git is not None:
                check_git(self.git)
        except ChoiceError as e:
            raise ValueError(str(e).replace("--from", '"from"').replace("--git", '"git"')) from None
        return self

    @property
    def environment(self) -> EnvChoice | None:
        if self.upload is None and self.git is None and self.from_ is None:
            return None
        return EnvChoice(upload=self.upload, git=self.git, checkpoint=self.from_)


#: The input's own names (an alias where the wire's name is a Python keyword: "from").
LINE_FIELDS = frozenset(f.alias or name for name, f in BatchLine.model_fields.items())


#: Written only when set (`BatchResult`'s serializer).
ENV_RESULT_FIELDS = frozenset({"fork", "environment", "checkpoint", "diff"})


class BatchResult(BaseModel):
    """One output line: how one input line's turn ended, with the line's own extra fields."""

    model_config = ConfigDict(extra="allow")  # the input line's `id`, `metadata`, ... kept as given

    key: str
    """`<line number>:<hash of the line>`: what a re-run matches to skip or replace the line."""
    line: int
    turn_id: str | None = None
    status: Status
    prompt: str | None = None
    workspace: str | None = None
    model: str | None = None
    final_message: str | None = None
    usage: dict[str, int] = Field(default_factory=dict)
    error: str | None = None
    calls: int = 0
    failed_calls: int = 0
    duration: float | None = None
    """Seconds from the turn's start to its result."""
    transcript: str | None = None
    """With `--transcripts DIR`: the JSONL file of the turn's whole history, one item per line."""
    started: bool = True
    """False: the turn never reached the fleet (Redis away), so a re-run runs it again."""
    fork: int | None = None
    """A forked line's turn: which of its N (from 0)."""
    environment: str | None = None
    """The environment the turn ran in (an "upload", "git" or "from" line)."""
    checkpoint: str | None = None
    """The checkpoint taken at the turn's end: a later line's "from"."""
    diff: TurnDiff | None = None
    """What the turn changed: a unified diff of text files, binary and deleted files."""

    @model_serializer(mode="wrap")
    def _without_unset_environment(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A line of the shared workspace reads as it always did: no environment fields at all."""
        return {k: v for k, v in handler(self).items() if not (k in ENV_RESULT_FIELDS and v is None)}


#: An input field with one of these names would overwrite toolq's own in the result: refused.
RESERVED = frozenset(BatchResult.model_fields) - LINE_FIELDS


class Entry(BaseModel):
    number: int
    key: str
    fork: int | None = None
    """Which of a forked line's turns (its key ends in `#<fork>`)."""
    turn: BatchLine | None = None
    problem: str | None = None
    """Why the line cannot run (then `turn` is None)."""
    extras: dict[str, Any] = Field(default_factory=dict)
    """The line's fields toolq does not read, copied into its result."""


def line_key(number: int, raw: str) -> str:
    return f"{number}:{hashlib.sha256(raw.strip().encode(errors='surrogateescape')).hexdigest()[:16]}"


#: How refusals name the results file and the transcripts' folder.
OUT = "--out"
TRANSCRIPTS = "--transcripts"


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
        entry = parse_line(number, raw)
        if entry.turn is not None and entry.turn.fork is not None:  # N turns, each known by its own key
            entries += [entry.model_copy(update={"key": f"{entry.key}#{k}", "fork": k}) for k in range(entry.turn.fork)]
        else:
            entries.append(entry)
    return entries


def parse_line(number: int, raw: str) -> Entry:
    key = line_key(number, raw)
    try:
        raw.encode()
    except UnicodeEncodeError as e:
        return Entry(number=number, key=key, problem=f"line {number}: not UTF-8 text (at character {e.start + 1})")
    try:
        data = json.loads(raw)
    except ValueError:
        data = None  # pydantic names the problem below
    extras = {k: v for k, v in data.items() if k not in LINE_FIELDS} if isinstance(data, dict) else {}
    if (bad := untrusted.first_surrogate(extras)) is not None:  # no result could carry it back
        return Entry(number=number, key=key, problem=f"line {number}: {untrusted.describe_surrogate(bad)}")
    if clash := sorted(k for k in extras if k in RESERVED):
        return Entry(number=number, key=key, extras={k: v for k, v in extras.items() if k not in RESERVED},
                     problem=f"line {number}: field{'s' if len(clash) > 1 else ''} {', '.join(clash)} would "
                             "overwrite toolq's own in the result: rename "
                             f"{'them' if len(clash) > 1 else 'it'}")
    try:
        turn = BatchLine.model_validate_json(raw)
    except ValidationError as e:
        said = "; ".join(f"{p.where or 'the line'}: {p.message}" for p in problems(e))
        return Entry(number=number, key=key, extras=extras, problem=f"line {number}: {said}")
    if turn.workspace is not None:
        turn.workspace = absolute_workspace(turn.workspace)
        if problem := workspace_problem(turn.workspace):
            return Entry(number=number, key=key, extras=extras, problem=f"line {number}: {problem}")
    if turn.upload is not None:
        turn.upload = absolute_workspace(turn.upload)
        if not turn.upload.is_dir():
            return Entry(number=number, key=key, extras=extras,
                         problem=f"line {number}: upload {turn.upload}: not a folder")
    return Entry(number=number, key=key, turn=turn, extras=extras)


def _results_in(data: bytes) -> Iterator[tuple[str, BatchResult]]:
    """Each readable result line of a results file, with its text; a line cut by a killed batch,
    or anything that is not a result, is skipped."""
    for raw in split_lines(data, errors="replace"):
        try:
            yield raw, BatchResult.model_validate_json(raw)
        except ValidationError:
            continue


def latest_results(out: Path) -> dict[str, BatchResult]:
    """Each key's latest result in `out`; results of turns that never started do not count (the
    next run runs them)."""
    latest: dict[str, BatchResult] = {}
    data = trusted_files.read_bytes(out, OUT)
    for _, r in _results_in(data or b""):
        if r.started:
            latest[r.key] = r
        else:
            latest.pop(r.key, None)
    return latest


def latest_statuses(out: Path) -> dict[str, str]:
    """Each key's latest status in `out`; unreadable lines (a batch killed mid-write) are ignored."""
    return {key: r.status for key, r in latest_results(out).items()}


def replace_durably(path: Path, data: bytes, what: str) -> None:
    """`path` now holds `data`, whole or not at all, even across a crash: written to a new name
    beside it that nobody could have prepared (O_EXCL, O_NOFOLLOW), fsynced, renamed over it (a
    link at `path` is replaced, never followed), and the folder fsynced so the rename lasts."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        # 0600: a transcript holds every command's output, a result the final message
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ConfigurationError(f"cannot write {what} {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def compact(out: Path) -> None:
    """Rewrite `out` with one line per key, its latest, in line order (a re-run's result replaces
    the earlier one); cut and unreadable lines go. Untouched when it already reads so."""
    data = trusted_files.read_bytes(out, OUT)
    if data is None:
        return
    latest: dict[str, tuple[str, BatchResult]] = {}
    for raw, r in _results_in(data):
        latest.pop(r.key, None)  # a later result of the key takes the place of the earlier one
        latest[r.key] = (raw, r)
    ordered = sorted(latest.values(), key=lambda pair: pair[1].line)  # stable: older keys keep their order
    new = "".join(raw + "\n" for raw, _ in ordered).encode(errors="surrogateescape")
    if new != data:
        replace_durably(out, new, OUT)


class Results:
    """Where results go: appended to RESULTS one line per turn as it ends, flushed, so a killed
    batch keeps them (`close()` then rewrites the file with one line per key); or, with no path
    (`--out -`), written to `stream`."""

    def __init__(self, path: Path | None, stream: IO[str] | None = None) -> None:
        self.path = path
        self.file: IO[bytes] | None = None
        self.stream = stream
        if path is not None:
            f = trusted_files.open_append(path, OUT, 0o600)  # final messages: the user's own
            if f.seek(0, 2) and (f.seek(-1, 2), f.read(1))[1] != b"\n":  # a line cut by a killed batch
                f.write(b"\n")  # must not swallow the next one
            self.file = f
        self.statuses: dict[str, str] = {}
        """This run's status per key."""
        self.closed = False

    def write(self, result: BatchResult) -> None:
        if self.closed:
            raise RuntimeError("a result came after the results file was closed")
        text = result.model_dump_json() + "\n"
        if self.file is not None:
            self.file.write(text.encode(errors="surrogateescape"))
            self.file.flush()
        elif self.stream is not None:
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # stdout closed (`| head`): the turns still run and end
                pass
        self.statuses[result.key] = result.status

    def close(self) -> None:
        self.closed = True
        if self.file is not None:
            self.file.close()
            self.file = None
            if self.path is not None:
                compact(self.path)


@dataclass
class Lane:
    """One turn on its way: what the batch knows of it, whatever its task is doing."""

    entry: Entry
    line: BatchLine
    turn_id: str
    session: Session | None = None
    task: asyncio.Task | None = None
    settled: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Set by the batch once the turn's result is written: all a lane ever awaits."""
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    """When the turn's terminal event was heard (or its result written)."""
    status: Status | None = None
    """The terminal event's status, for a result written without the task's outcome."""
    error: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    final_message: str | None = None
    calls: int = 0
    failed_calls: int = 0
    written: bool = False


class Batch:
    """Runs entries N at a time on one runtime; `interrupt()` cancels the running ones."""

    def __init__(self, runtime: Runtime, settings: Settings, results: Results, progress: Progress,
                 concurrency: int, transcripts: Path | None = None, warn: IO[str] = sys.stderr) -> None:
        self.rt, self.settings, self.results, self.progress = runtime, settings, results, progress
        self.concurrency = concurrency
        self.transcripts = transcripts
        self.unwritten = 0
        """Results that could not be written (each said in one line): the batch exits 1."""
        self.warn = warn
        self.lanes: dict[str, Lane] = {}
        """The turns started and not yet let go of, by turn id."""
        self.stopping: signal.Signals | None = None
        self.background: set[asyncio.Task] = set()
        """Cancel records, and the tasks of turns the batch let go of (cancelled, maybe still ending)."""
        self._forcing: asyncio.TimerHandle | None = None

    @property
    def model(self) -> str:
        return self.rt.client.settings.model

    async def run(self, entries: list[Entry]) -> None:
        queue = iter(entries)  # one shared iterator: each entry goes to exactly one lane
        lanes = [asyncio.create_task(self._lane(queue)) for _ in range(min(self.concurrency, len(entries)))]
        await asyncio.gather(*lanes)

    async def _lane(self, queue: Iterator[Entry]) -> None:
        for entry in queue:
            if self.stopping is not None:
                return
            if entry.turn is None:
                try:
                    self._write(BatchResult(key=entry.key, line=entry.number, status="invalid", error=entry.problem,
                                            started=False, **entry.extras))
                except Exception as e:  # as in `_write_lane`: one line, and the batch goes on
                    self.unwritten += 1
                    self._say(f"could not write the result of line {entry.number}: {type(e).__name__}: {e}")
                continue
            lane = Lane(entry=entry, line=entry.turn, turn_id=new_turn_id())
            self.lanes[lane.turn_id] = lane
            self._count_running()
            lane.task = asyncio.create_task(self._run_one(lane))
            lane.task.add_done_callback(functools.partial(self._task_ended, lane))
            await lane.settled  # never hangs: see the module's docstring
            self.lanes.pop(lane.turn_id, None)
            self._count_running()

    async def _run_one(self, lane: Lane) -> None:
        if self.stopping is not None:  # a signal came between the task's creation and its start
            self._write_lane(lane, "cancelled", error=self._stopped_error(lane, "before it started"), started=False)
            return
        line = lane.line
        workspace = line.workspace or self.settings.workspace
        environment = line.environment
        instructions = line.instructions or self.settings.instructions or (
            environment_instructions(environment) if environment is not None else
            default_instructions(self.settings.model_copy(update={"workspace": workspace})))
        # A line's environment is its turn's own (made at the turn's start, owned by its conversation)
        # and destroyed when the turn's session closes.
        session = lane.session = Session(self.rt, instructions=instructions,
                                         workspace=named_workspace(workspace) if environment else workspace,
                                         upload=line.upload, git=line.git, from_checkpoint=line.from_)

        def heard(event: Any) -> None:
            failed = ended_call(event)
            if failed is not None:
                lane.calls += 1
                lane.failed_calls += failed
                self.progress.call_ended(failed)
            elif isinstance(event, ItemCompleted) and isinstance(event.item, AgentMessageView):
                lane.final_message = event.item.text
            elif isinstance(event, (TurnCompleted, TurnFailed, TurnAborted)):
                lane.ended = time.monotonic()
                if isinstance(event, TurnCompleted):
                    lane.status, lane.usage = "completed", dict(event.usage)
                elif isinstance(event, TurnFailed):
                    lane.status, lane.error = "failed", event.error.message
                else:
                    lane.status = "cancelled"

        try:
            try:
                outcome = await session.run_turn(line.prompt, heard, turn_id=lane.turn_id)
            except Exception as e:  # a bug: this line fails, the batch goes on
                outcome = TurnOutcome(turn_id=lane.turn_id, status="failed",
                                      error=f"toolq failed: {type(e).__name__}: {e}")
            status = outcome.status if outcome.status != "running" else "failed"  # an ended turn is no success
            self._write_lane(lane, status, error=outcome.error, final_message=outcome.final_message,
                             usage=outcome.usage.model_dump(), started=not outcome.could_not_start,
                             changes=diff_fields(outcome.environment, outcome.diff))
        finally:
            # Not when a task that never ended is destroyed with the loop at exit (no loop to close
            # it on): its conversation's key then expires by itself.
            if _loop_running():
                await self._close(session)

    async def _close(self, session: Session) -> None:
        """End the turn's conversation (its exec_command sessions), bounded: see `CLOSE_GRACE`.
        A close cut short leaves the conversation's key to expire by itself (seconds)."""
        closing = asyncio.create_task(session.close())
        await asyncio.wait({closing}, timeout=CLOSE_GRACE if session.environment is None else ENV_CLOSE_GRACE)
        if not closing.done():
            await stop(closing)  # cancelled until it ends; the cancel reaches the beat it awaits

    def _write_lane(self, lane: Lane, status: Status, *, error: str | None = None,
                    final_message: str | None = None, usage: dict[str, int] | None = None,
                    started: bool = True, changes: dict[str, Any] | None = None) -> None:
        """The lane's one result (a second call does nothing), its transcript, and the lane let go."""
        if lane.written:
            return
        lane.written = True
        lane.ended = lane.ended or time.monotonic()
        self._count_running()
        entry = lane.entry
        try:
            transcript = self._transcript(lane) if started else None
            self._write(BatchResult(
                key=entry.key, line=entry.number, turn_id=lane.turn_id, status=status, prompt=lane.line.prompt,
                workspace=str(lane.session.workspace) if lane.session else None, model=self.model,
                final_message=final_message if final_message is not None else lane.final_message,
                usage=usage if usage is not None else lane.usage, error=error, calls=lane.calls,
                failed_calls=lane.failed_calls, duration=round(time.monotonic() - lane.started, 3),
                transcript=transcript, started=started, fork=entry.fork, **(changes or {}), **entry.extras))
        except Exception as e:  # a full disk, an unwritable value: said once, the batch goes on and exits 1
            self.unwritten += 1
            self._say(f"could not write the result of line {entry.number} ({lane.turn_id}): {type(e).__name__}: {e}")
        finally:  # whatever happened above, nothing waits on this lane any more
            if not lane.settled.done():
                lane.settled.set_result(None)

    def _transcript(self, lane: Lane) -> str | None:
        """The turn's whole history, one item per line (as Codex's rollout files), in `--transcripts`."""
        if self.transcripts is None or lane.session is None:
            return None
        path = self.transcripts / f"{lane.turn_id}.jsonl"
        data = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in lane.session.history.to_json())
        try:
            replace_durably(path, data.encode(errors="surrogateescape"), TRANSCRIPTS)
        except (OSError, ConfigurationError) as e:  # the result still says how the turn ended
            self._say(f"could not write the transcript of {lane.turn_id} to {path}: {e}")
            return None
        return str(path)

    def _task_ended(self, lane: Lane, task: asyncio.Task) -> None:
        """The turn's task ended; had it not written the result (cancelled, or a bug in writing
        it), the result comes from what the lane heard."""
        if task.cancelled():
            self._write_lane(lane, "cancelled", error=self._stopped_error(lane, "its turn's task was cancelled"))
        elif (e := task.exception()) is not None:
            self._write_lane(lane, lane.status or "failed", error=f"toolq failed: {type(e).__name__}: {e}")
        elif not lane.written:
            self._write_lane(lane, lane.status or "failed", error=lane.error)

    def _write(self, result: BatchResult) -> None:
        self.results.write(result)
        self.progress.turn_ended(result.status)

    def _count_running(self) -> None:
        self.progress.running = sum(not lane.written for lane in self.lanes.values())

    # --- the watchdog -------------------------------------------------------------------------

    def watch(self) -> None:
        """Name (one line on stderr) and let go of each lane whose turn ended `STUCK_AFTER` seconds
        ago but whose task has not: the batch goes on, the result is written from the turn's end."""
        now = time.monotonic()
        for lane in list(self.lanes.values()):
            task = lane.task
            if lane.ended is None or now - lane.ended < STUCK_AFTER or task is None or task.done():
                continue
            self._say(f"line {lane.entry.number} ({lane.turn_id}) ended {now - lane.ended:.0f}s ago but its lane is "
                      f"stuck at {where(task)}; letting it go (result from the turn's end)")
            self._let_go(lane, lane.status or "failed", lane.error)

    def _let_go(self, lane: Lane, status: Status, error: str | None) -> None:
        """Write the lane's result if it has none, settle it, and cancel its task in the background."""
        self._write_lane(lane, status, error=error)
        self.lanes.pop(lane.turn_id, None)
        self._count_running()
        if lane.task is not None and not lane.task.done():
            self._background(stop(lane.task))

    # --- signals ------------------------------------------------------------------------------

    def interrupt(self, sig: signal.Signals) -> None:
        """First signal: start no more turns, cancel the running ones (durable record first, as
        `toolq run`), and let go of those still running `STOP_GRACE` seconds later. A second
        signal lets go of them at once."""
        if self.stopping is not None:
            self._say(f"{sig.name} again: letting go of the turns still running")
            self.force()
            return
        self.stopping = sig
        for turn_id, lane in list(self.lanes.items()):
            if lane.ended is None:
                self._background(self._record_cancel(turn_id, sig))
            if lane.session is not None:
                lane.session.cancel()
        self._forcing = asyncio.get_running_loop().call_later(STOP_GRACE, self.force)

    def force(self) -> None:
        """Every lane still running is written `cancelled` and let go of: the batch ends now."""
        if self._forcing is not None:
            self._forcing.cancel()
            self._forcing = None
        for lane in list(self.lanes.values()):
            where_ = f"its lane was stuck at {where(lane.task)}" if lane.task and not lane.task.done() else None
            self._let_go(lane, "cancelled", self._stopped_error(lane, where_))

    def _stopped_error(self, lane: Lane, why: str | None) -> str:
        by = f"by {self.stopping.name}" if self.stopping else "by the batch"
        return f"turn cancelled {by} after {time.monotonic() - lane.started:.1f}s" + (f"; {why}" if why else "")

    async def _record_cancel(self, turn_id: str, sig: signal.Signals) -> None:
        try:
            await self.rt.fleet.ledger.cancel_turn(turn_id, reason=sig.name)
        except Exception as e:  # Redis away: the turn still ends here, unrecorded
            self._say(f"could not record the cancel of {turn_id} in Redis: {e}")

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _say(self, text: str) -> None:
        try:
            self.warn.write(("\n" if self.progress.tty else "") + "toolq batch: " + printable(text, lines=False) + "\n")
            self.warn.flush()
        except (OSError, ValueError):
            pass


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def where(task: asyncio.Task | None) -> str:
    """The innermost place outside asyncio itself where a task waits, following its coroutines'
    awaits and then the task it waits on, if any (`file:line in function`): what the watchdog names."""
    place = "an unknown place"
    for _ in range(50):  # chains are short; a cycle is not followed for ever
        if task is None:
            break
        awaited: Any = task.get_coro()
        for _ in range(200):
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if isinstance(frame, types.FrameType) and not frame.f_code.co_filename.startswith(_ASYNCIO):
                place = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_qualname}"
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
            if awaited is None:
                break
        # Awaiting a task leaves a future iterator in `cr_await`; the task's waiter is that task.
        waiter = getattr(task, "_fut_waiter", None)
        task = waiter if isinstance(waiter, asyncio.Task) else None
    return place


_ASYNCIO = os.path.dirname(asyncio.__file__)


def _short(filename: str) -> str:
    marker = f"{os.sep}toolq{os.sep}"
    return "toolq/" + filename.rsplit(marker, 1)[1] if marker in filename else filename


def run_batch(settings: Settings, path: Path, out: Path | None, *, concurrency: int, retry_failed: bool = False,
              transcripts: Path | None = None, progress_to: IO[str] = sys.stderr,
              results_to: IO[str] = sys.stdout) -> int:
    """`toolq batch`: exit 0 when every line has a completed result, 1 when one failed or is
    invalid, 130 when interrupted, 2 when nothing could start (bad file, Redis unreachable).
    `out` None: results go to `results_to` (`--out -`), and nothing is skipped."""
    if not path.is_file():
        raise ConfigurationError(f"batch file {path} is not a file")
    if out is not None and not out.parent.is_dir():
        raise ConfigurationError(f"the folder of --out {out} does not exist")
    if transcripts is not None:
        transcripts = absolute_workspace(transcripts)
        if not transcripts.parent.is_dir() or (transcripts.exists() and not transcripts.is_dir()):
            raise ConfigurationError(f"--transcripts {transcripts} is not a folder (its parent must exist)")
    entries = read_entries(read_lines(path))
    # The default workspace only where a line runs in it (not in a workspace or environment of its own).
    if any(e.turn is None or (e.turn.workspace is None and e.turn.environment is None) for e in entries) and \
            (problem := workspace_problem(settings.workspace)):
        raise ConfigurationError(problem)
    workspaces = [settings.workspace, *(e.turn.workspace for e in entries if e.turn and e.turn.workspace)]
    if out is not None:
        trusted_files.refuse_inside(out, workspaces, OUT)
    if transcripts is not None:
        _refuse_folder_inside(transcripts, workspaces)
        transcripts.mkdir(mode=0o700, exist_ok=True)
        _refuse_folder_not_mine(transcripts)
    latest = latest_statuses(out) if out is not None else {}
    done = ("completed",) if retry_failed else ("completed", "failed")
    todo = [e for e in entries if latest.get(e.key) not in done]
    skipped = len(entries) - len(todo)
    if not todo:
        _nothing_to_do(entries, latest, out, progress_to)
        if out is not None:
            compact(out)  # a killed run's second lines of a key go
    elif skipped:
        print(f"toolq batch: {skipped} of {len(entries)} turns already done in {out}; running {len(todo)}",
              file=progress_to)
    stopped = False
    if todo:
        with ExitStack() as stack:
            settings, starting = with_redis(settings, stack, quiet=False)
            batch = _run_bounded(_run(settings, todo, out, concurrency, progress_to, results_to, starting,
                                      transcripts))
        ran = list(batch.results.statuses.values())
        print(f"toolq batch: {len(ran)} turns: {ran.count('completed')} completed, {ran.count('failed')} failed, "
              f"{ran.count('cancelled')} cancelled, {ran.count('invalid')} invalid; {skipped} skipped (already "
              f"done); results in {out if out is not None else 'stdout'}", file=progress_to)
        latest.update(batch.results.statuses)
        stopped = batch.stopping is not None
        if batch.unwritten:
            return EXIT_FAILED
    if stopped:
        return EXIT_CANCELLED
    return 0 if all(latest.get(e.key) == "completed" for e in entries) else EXIT_FAILED


def _refuse_folder_not_mine(folder: Path) -> None:
    """Transcripts go only into a folder of the user's own that nobody else may write (another
    user could otherwise read them, or plant names in it)."""
    st = os.stat(folder, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigurationError(f"{TRANSCRIPTS} {folder} must be a folder of yours that no one else may write "
                                 "(mode 755 or 700)")


def _refuse_folder_inside(folder: Path, workspaces: list[Path]) -> None:
    """The transcripts' folder may be neither a workspace nor in one: the model's commands could
    plant links there for toolq to write through (`refuse_inside` checks a file's folder)."""
    where = os.path.realpath(folder)
    for workspace in workspaces:
        root = os.path.realpath(workspace)
        if where == root or where.startswith(root.rstrip("/") + "/"):
            raise ConfigurationError(f"{TRANSCRIPTS} {folder} is inside the workspace {workspace}, where the model's "
                                     "commands could plant links in it: keep it outside the workspace")


def _nothing_to_do(entries: list[Entry], latest: dict[str, str], out: Path | None, to: IO[str]) -> None:
    """One line: nothing left to run, and which lines failed (`--retry-failed` runs them)."""
    failed = [e.number for e in entries if latest.get(e.key) == "failed"]
    said = f"toolq batch: all {len(entries)} turns already have a result in {out}; nothing to run"
    if failed:
        shown = ", ".join(map(str, failed[:10])) + (f" and {len(failed) - 10} more" if len(failed) > 10 else "")
        said += (f"; {len(failed)} failed (line{'s' if len(failed) > 1 else ''} {shown}): "
                 "--retry-failed runs them again")
    print(said, file=to)


def _run_bounded(main: Coroutine[Any, Any, Batch]) -> Batch:
    """`asyncio.run`, except that the tasks left at the end get a bounded wait: `asyncio.run`
    waits for every cancelled task to end, and one that swallows its cancel (see the module's
    docstring) would hang the exit after every result was written."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if left:
                loop.run_until_complete(_cancel_all(left))
            loop.run_until_complete(asyncio.wait({loop.create_task(loop.shutdown_asyncgens())},
                                                 timeout=CLEANUP_GRACE))
        finally:
            # A task that never ended is destroyed with the loop: the watchdog or the stop already
            # named it, so not again as a "destroyed but pending" traceback.
            loop.set_exception_handler(_quiet_about_left_tasks)
            asyncio.set_event_loop(None)
            loop.close()


def _quiet_about_left_tasks(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if not str(context.get("message", "")).startswith("Task was destroyed but it is pending"):
        loop.default_exception_handler(context)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    await asyncio.wait({asyncio.create_task(stop(t)) for t in tasks}, timeout=CLEANUP_GRACE)


async def _bounded(coro: Coroutine[Any, Any, Any], what: str, warn: Callable[[str], None]) -> None:
    """Await `coro` at most `CLEANUP_GRACE` seconds, then leave it (cancelled)."""
    task = asyncio.create_task(coro)
    await asyncio.wait({task}, timeout=CLEANUP_GRACE)
    if not task.done():
        warn(f"{what} did not finish within {CLEANUP_GRACE:g}s; leaving it")
        await stop(task)
    elif not task.cancelled() and (e := task.exception()) is not None:
        warn(f"{what} failed: {type(e).__name__}: {e}")


async def _run(settings: Settings, todo: list[Entry], out: Path | None, concurrency: int, progress_to: IO[str],
               results_to: IO[str], starting: WorkersStarting | None, transcripts: Path | None) -> Batch:
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
    results = Results(out, stream=results_to)
    progress = Progress(total=len(todo), out=progress_to)
    batch = Batch(runtime, settings, results, progress, concurrency, transcripts, warn=progress_to)
    loop = asyncio.get_running_loop()
    for sig in CANCEL_SIGNALS:
        loop.add_signal_handler(sig, batch.interrupt, sig)
    ticker = asyncio.create_task(_tick(batch))
    try:
        await batch.run(todo)
    finally:
        ticker.cancel()
        progress.show(final=True)
        try:
            results.close()
        finally:
            # The cancel records go first (at most a grace); then what is left of let-go turns, then the runtime.
            if batch.background:
                await asyncio.wait(set(batch.background), timeout=CLEANUP_GRACE)
            await _bounded(runtime.aclose(), "closing the runtime", batch._say)
            for sig in CANCEL_SIGNALS:
                loop.remove_signal_handler(sig)
    return batch


async def _tick(batch: Batch) -> None:
    """Elapsed time moves on a terminal even while no turn ends; the watchdog looks every second."""
    progress = batch.progress
    while True:
        await asyncio.sleep(0.5 if progress.tty else 1.0)
        batch.watch()
        progress.show()


__all__ = ["Batch", "BatchLine", "BatchResult", "read_entries", "run_batch"]
