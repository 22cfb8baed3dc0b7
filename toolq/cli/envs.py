"""Environments on the command line (issue 28): what `toolq run --upload/--git/--from/--apply/--patch`
and `toolq batch`'s environment lines mean, and `toolq envs` / `toolq envs rm ID`.

The parsing, the checks and the rendering are pure (arguments or records in, text out); only the
`*_cmd` functions touch Redis, through the orchestrator's `Environments`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from toolq.cli.status import render_json_lines
from toolq.cli.terminal import human_age, printable
from toolq.core.environments import BLOB_ID, Checkpoint, EnvironmentRecord, GitSource, TurnDiff
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings, workspace_problem

if TYPE_CHECKING:
    from toolq.cli.view import JsonView, LiveView
    from toolq.local.starting import WorkersStarting
    from toolq.workers.environments.archive import ApplyReport


class PatchFile(Protocol):
    """`--patch`'s file, opened before the turn (`run.LastMessageFile`)."""

    path: Path

    def write(self, text: str) -> None: ...


class ChoiceError(ValueError):
    """Options that do not go together, or a source that cannot be: one line, exit 2."""


@dataclass(frozen=True)
class EnvChoice:
    """Where a turn's environment comes from (exactly one source), and what happens to its changes."""

    upload: Path | None = None
    git: GitSource | None = None
    checkpoint: str | None = None
    apply: bool = False
    """Apply the turn's changes back to `upload` when it ends."""
    patch: Path | None = None
    """Write the turn's unified diff here when it ends."""

    @property
    def label(self) -> str:
        """How `toolq envs` and the status lines name the source."""
        if self.upload is not None:
            return str(self.upload)
        if self.git is not None:
            return git_label(self.git)
        return f"checkpoint {self.checkpoint}"


def git_label(git: GitSource) -> str:
    """The URL (a password or token in it left out: the label reaches the model's instructions,
    stderr and `toolq envs`) and the ref."""
    from toolq.orchestrator.environments import shown_url

    url = shown_url(git.url)
    return url if git.ref == "HEAD" else f"{url}@{git.ref}"


def parse_git(spec: str) -> GitSource:
    """`URL[@REF]`. A URL holds `@` of its own (`git@host:repo`, `https://user@host/repo`): the ref
    is what follows the last `@` only when that leaves a whole URL before it (a scheme URL with a
    path, a `host:path`, a local path) and no `:` after it."""
    spec = spec.strip()
    url, ref = spec, "HEAD"
    at = spec.rfind("@")
    if at > 0:
        left, right = spec[:at], spec[at + 1:]
        whole = ("/" in left.split("://", 1)[1]) if "://" in left else (":" in left or left.startswith(("/", ".")))
        if right and ":" not in right and whole:
            url, ref = left, right
    return check_git(GitSource(url=url, ref=ref))


def check_git(git: GitSource) -> GitSource:
    """Never an option to git, nor a line break in a record (the host runs git with them as arguments)."""
    if not git.url:
        raise ChoiceError("--git needs a repository URL, as URL or URL@REF")
    for what, value in (("URL", git.url), ("ref", git.ref)):
        if value.startswith("-"):
            raise ChoiceError(f"--git: a {what} may not start with '-': {value!r}")
        if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in value):
            raise ChoiceError(f"--git: the {what} {value!r} holds a space or a control character")
    if ".." in git.ref:
        raise ChoiceError(f"--git: {git.ref!r} is not a ref (it holds '..')")
    return git


def parse_checkpoint(text: str) -> str:
    checkpoint = text.strip().lower()
    if not BLOB_ID.match(checkpoint):
        raise ChoiceError(f"--from takes a checkpoint id (64 hex digits, as a turn's `checkpoint` says), "
                          f"not {text!r}")
    return checkpoint


def choose(*, upload: str | None = None, git: str | None = None, checkpoint: str | None = None,
           workspace: str | None = None, apply: bool = False, patch: str | None = None) -> EnvChoice | None:
    """The environment a `toolq run` asks for (None: today's shared workspace), or `ChoiceError`.
    `--upload`, `--git`, `--from` and `--workspace` are exclusive; `--apply` needs `--upload`;
    `--patch` needs one of the three sources."""
    given = [name for name, value in (("--upload", upload), ("--git", git), ("--from", checkpoint),
                                      ("--workspace", workspace)) if value is not None]
    if len(given) > 1:
        raise ChoiceError(f"{' and '.join(given)} are exclusive: give one (--workspace keeps the shared folder; "
                          "the others make an environment on a worker host)")
    if apply and upload is None:
        raise ChoiceError("--apply needs --upload DIR (the folder the turn's changes go back to)")
    if patch is not None and not (upload or git or checkpoint):
        raise ChoiceError("--patch needs --upload, --git or --from (a turn in an environment has a diff)")
    if upload is None and git is None and checkpoint is None:
        return None
    folder = None
    if upload is not None:
        folder = Path(upload).expanduser().absolute()
        if not folder.is_dir():
            raise ChoiceError(f"--upload {upload}: not a folder")
    return EnvChoice(upload=folder, git=parse_git(git) if git is not None else None,
                     checkpoint=parse_checkpoint(checkpoint) if checkpoint is not None else None,
                     apply=apply, patch=Path(patch).expanduser().absolute() if patch is not None else None)


def environment_instructions(choice: EnvChoice) -> str:
    """The default instructions of a turn in an environment: the model is told where its files are."""
    return (
        f"You are a coding agent. Your tools run on a worker host, in an environment holding a copy of "
        f"{choice.label}; relative paths resolve there. Independent tool calls may be made in parallel. "
        "Answer with a short summary once the task is done."
    )


# ---- a turn's outcome: what the environment gives back --------------------------------------------

def diff_fields(environment: str | None, diff: TurnDiff | None) -> dict[str, Any]:
    """What a batch result line carries of the environment, as `turn.completed` does: its id, the
    checkpoint taken at the turn's end, and the diff (checkpoint, patch, binary, deleted, truncated)."""
    if environment is None and diff is None:
        return {}
    return {"environment": environment, "checkpoint": diff.checkpoint if diff else None,
            "diff": diff.model_dump(mode="json") if diff else None}


def diff_summary(diff: TurnDiff) -> str:
    """One line: how much the turn changed, for the live view. The checkpoint whole: it is what
    `--from` takes."""
    files = diff.patch.count("\ndiff --git ") + diff.patch.startswith("diff --git ")
    parts = [f"{files} text file{'s' if files != 1 else ''} in the patch"]
    if diff.binary:
        parts.append(f"{len(diff.binary)} binary")
    if diff.deleted:
        parts.append(f"{len(diff.deleted)} deleted")
    cut = " (patch cut at 1 MiB; the checkpoint holds every change)" if diff.truncated else ""
    return f"checkpoint {diff.checkpoint}: " + ", ".join(parts) + cut


def apply_lines(folder: Path, report: ApplyReport, checkpoint: Checkpoint) -> list[str]:
    """`--apply`'s report: one line of what was applied, then one line per refused file (changed
    in the folder since the upload, under .git, through a link)."""
    applied = set(report.applied)
    counts = [(len(applied & set(paths)), what) for paths, what in
              ((checkpoint.added, "added"), (checkpoint.changed, "changed"), (checkpoint.deleted, "deleted"))]
    line = f"applied to {folder}: " + ", ".join(f"{n} {what}" for n, what in counts)
    if report.refused:
        line += f"; {len(report.refused)} refused:"
    lines = [line, *(f"  refused {path}: {reason}" for path, reason in report.refused)]
    return [printable(one, lines=False) for one in lines]


# ---- a turn in an environment: place it, then deliver what it changed ------------------------------

def _say(view: JsonView | LiveView) -> Callable[[str], None]:
    """Status lines go where the live view goes (stderr); with --json (stdout is the events) to stderr too."""
    from toolq.cli.view import LiveView

    if isinstance(view, LiveView):
        return view.write
    return lambda line: print(printable(line, lines=False), file=sys.stderr, flush=True)


def named_workspace(workspace: Path, env_id: str | None = None) -> Path:
    """The workspace a turn in an environment gives its `Session`: only a name in the ledger (its
    calls run in the environment), so the current folder, or where it cannot be one (a home, a
    folder holding toolq's virtualenv) `/toolq-environment[/ID]`, which nothing reads or writes."""
    if workspace_problem(workspace, must_exist=False) is None:
        return workspace
    return Path("/toolq-environment") / env_id if env_id else Path("/toolq-environment")


@dataclass
class Placed:
    """A `toolq run`'s environment: made before the turn, destroyed when the run ends."""

    choice: EnvChoice
    environments: Any
    """The orchestrator's `Environments`."""
    handle: Any
    """Its `Environment` handle (which owns the environment's owner key)."""
    manifest: dict[str, Any] | None = None
    """The uploaded folder's files as packed: what `--apply` compares the folder with."""

    async def destroy(self) -> None:
        try:
            await asyncio.wait_for(self.handle.destroy(), DESTROY_GRACE)
        except Exception as e:  # the host's reaper destroys it once its owner key is gone
            print(printable(f"toolq run: environment {self.handle.record.id if self.handle.record else ''} not "
                            f"destroyed now ({e}); its host's reaper will", lines=False), file=sys.stderr)

    def session_args(self, settings: Settings) -> dict[str, Any]:
        """`Session`'s keywords: the environment, and a workspace that is only a name in the ledger
        when the current folder could not be one (a home, a folder holding toolq's virtualenv):
        the calls run in the environment, not there."""
        return {"environment": self.handle, "workspace": named_workspace(settings.workspace, self.handle.record.id)}

    async def deliver(self, outcome: Any, view: JsonView | LiveView, patch: PatchFile | None) -> None:
        """At the turn's end (`turn.completed` carried the checkpoint and the diff): `--patch`'s file
        and `--apply`'s changes, each said in one line on stderr."""
        from toolq.cli.view import LiveView

        diff: TurnDiff | None = getattr(outcome, "diff", None)
        env_id = getattr(outcome, "environment", None) or self.handle.record.id
        say = _say(view)
        if diff is None:
            if patch is not None or self.choice.apply:
                say(f"toolq run: the turn left no checkpoint of {env_id}: "
                    + ("nothing applied" if self.choice.apply else f"{patch.path if patch else ''} left empty"))
            return
        if isinstance(view, LiveView):
            say(diff_summary(diff))
        if patch is not None:
            patch.write(diff.patch)
            left = [f"binary, not in it: {_named(diff.binary)}" if diff.binary else "",
                    "cut at 1 MiB" if diff.truncated else ""]
            say(f"wrote the turn's diff to {patch.path}" + "".join(f"; {x}" for x in left if x))
        if self.choice.apply and self.choice.upload is not None:
            for line in await self.apply(self.choice.upload, diff):
                say(line)
        for line in diff.skipped:  # left on the host: neither applied nor in the patch
            say(printable(f"  not carried: {line}", lines=False))

    async def apply(self, folder: Path, diff: TurnDiff) -> list[str]:
        """The checkpoint's changes, applied to `folder` with `archive.apply_delta` (which refuses a
        file changed there since the upload, never writes into .git nor through a link)."""
        from toolq.workers.environments.archive import ArchiveError, apply_delta
        from toolq.workers.store import StoreError

        try:
            checkpoint = await self.environments.read_checkpoint(diff.checkpoint)
            delta = None
            if checkpoint.delta:
                store = await self.environments.store()
                delta = await asyncio.to_thread(store.get, checkpoint.delta)
            report = await asyncio.to_thread(apply_delta, folder, self.manifest or {}, checkpoint, delta)
        except (ArchiveError, StoreError, ConfigurationError, OSError) as e:
            return [f"toolq run: nothing applied to {folder}: {e}"]
        return apply_lines(folder, report, checkpoint)


def _named(paths: list[str], most: int = 5) -> str:
    shown = ", ".join(printable(p, lines=False) for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


#: Destroying the run's environment waits this long at most; the host's reaper does it otherwise.
DESTROY_GRACE = 30.0


async def _host_of(environments: Any, starting: WorkersStarting) -> None:
    """Until a worker this process started advertises its host (its agent starts once it is ready)."""
    if not await asyncio.to_thread(starting.wait, EMBEDDED_HOST_WAIT) or starting.error:
        return  # placement then says no host keeps environments; the boot's own error is logged
    end = time.monotonic() + EMBEDDED_HOST_WAIT
    while not await environments.hosts() and time.monotonic() < end:
        await asyncio.sleep(0.1)


#: How long a run's embedded workers may take to boot and advertise their host.
EMBEDDED_HOST_WAIT = 60.0


async def place(runtime: Any, choice: EnvChoice, view: JsonView | LiveView,
                starting: WorkersStarting | None = None) -> Placed:
    """Upload (if asked), place and make the run's environment; one line names it and its host."""
    from toolq.orchestrator.environments import Environment, source_of

    environments = runtime.fleet.environments
    manifest = None
    if choice.upload is not None:
        upload = await environments.upload(choice.upload)
        source, manifest = upload.source, upload.manifest
    else:
        source = source_of(git=choice.git, checkpoint=choice.checkpoint)
    if starting is not None:  # the embedded stack's workers boot while the folder was packed
        await _host_of(environments, starting)
    handle = await Environment(environments, source)
    record = handle.record
    _say(view)(f"environment {record.id} on host {record.host}" + (f" ({record.mode})" if record.mode else "")
               + f", from {choice.label}")
    return Placed(choice, environments, handle, manifest)


# ---- `toolq envs` ---------------------------------------------------------------------------------

ENV_COLUMNS = ("id", "host", "source", "size", "age", "owner", "state")


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def source_label(record: EnvironmentRecord) -> str:
    source = record.source
    if source.label:
        return source.label
    if source.kind == "git" and source.git is not None:
        return git_label(source.git)
    if source.kind == "checkpoint" and source.checkpoint:
        return f"checkpoint {source.checkpoint[:12]}"
    return source.kind


def env_row(record: EnvironmentRecord, now: float) -> dict[str, Any]:
    return {"id": record.id, "host": record.host, "source": source_label(record), "size": human_size(record.size),
            "age": human_age(now - record.created_at), "owner": record.owner, "state": record.state}


def _shown(record: EnvironmentRecord) -> dict[str, Any]:
    """The record as `--json` prints it: a password or token in a git URL left out, as in the label."""
    from toolq.orchestrator.environments import shown_url

    shown = record.model_dump(mode="json")
    if isinstance(git := shown["source"].get("git"), dict):
        git["url"] = shown_url(git["url"])
    return shown


def render_envs(records: list[EnvironmentRecord], now: float, as_json: bool = False) -> str:
    ordered = sorted(records, key=lambda r: (r.host, r.created_at, r.id))
    if as_json:
        return render_json_lines([{**_shown(r), "age": round(max(now - r.created_at, 0.0), 3)} for r in ordered])
    if not ordered:
        return "no environments (`toolq run --upload DIR` makes one for its turn)\n"
    return _table([env_row(r, now) for r in ordered], ENV_COLUMNS)


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    """`status.render_table`'s layout, with the cells as given (its `age` is a call's seconds)."""
    cells = [[str(row[c]) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    return "".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() + "\n"
                   for line in [[c.upper() for c in columns], *cells])


def _fleet_of(settings: Settings, command: str, err: TextIO) -> Settings | None:
    """REDIS_URL's fleet, else this user's running local one (a warm fleet, `toolq up`, with its
    key, which `rm` signs with; else a running `toolq run`'s embedded stack), as `toolq turns`
    finds it; None: said why on `err`."""
    if settings.redis_url:
        return settings
    from toolq.local import runtime_dir, warm

    try:
        stacks = warm.warm_stacks() or runtime_dir.running_stacks()
    except ConfigurationError as e:
        print(f"toolq {command}: {e}", file=err)
        return None
    if not stacks:
        print(f"toolq {command}: set REDIS_URL (or CELERY_BROKER_URL) to the fleet's Redis; no local fleet of "
              "yours is running (`toolq up` starts one)", file=err)
        return None
    stack = stacks[0]
    key = stack.warm.signing_key if stack.warm is not None else settings.signing_key
    return settings.model_copy(update={"redis_url": stack.redis_url, "signing_key": key})


def envs_cmd(settings: Settings, *, as_json: bool = False, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from toolq.orchestrator.transport.redis_faults import reaching

    out, err = out or sys.stdout, err or sys.stderr

    if (fleet := _fleet_of(settings, "envs", err)) is None:
        return 2
    settings = fleet
    with reaching(settings.redis_url):
        records = asyncio.run(_records(settings))
    shown = render_envs(records, time.time(), as_json)
    out.write(shown if as_json else printable(shown))  # labels and hosts come from the fleet's records
    return 0


def envs_rm_cmd(settings: Settings, env_id: str, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from toolq.orchestrator.transport.redis_faults import reaching

    out, err = out or sys.stdout, err or sys.stderr

    if (fleet := _fleet_of(settings, "envs rm", err)) is None:
        return 2
    settings = fleet
    with reaching(settings.redis_url):
        found = asyncio.run(_remove(settings, env_id))
    if found is None:
        print(f"toolq envs rm: no environment {printable(env_id, lines=False)} (`toolq envs` lists them)", file=err)
        return 2
    said = (f"{found.id} was already {found.state}" if found.state in ("destroyed", "lost")
            else f"destroyed {found.id} on {found.host} ({source_label(found)})")
    print(printable(said, lines=False), file=out)
    return 0


async def _records(settings: Settings) -> list[EnvironmentRecord]:
    async with _environments(settings) as envs:
        return list(await envs.records())


async def _remove(settings: Settings, env_id: str) -> EnvironmentRecord | None:
    async with _environments(settings) as envs:
        record = await envs.record(env_id)
        if record is not None:
            await envs.destroy(env_id)
        return record


@asynccontextmanager
async def _environments(settings: Settings) -> AsyncIterator[Any]:
    """The orchestrator's `Environments` on the settings' Redis (no model client, no fleet catalog)."""
    from toolq.core.signing import signer_for
    from toolq.orchestrator.environments import Environments
    from toolq.workers import redis_clients

    r = redis_clients.async_client(settings.redis_target() or settings.redis_url or "", client_name="toolq-envs")
    try:
        yield Environments(r, settings, signer_for(settings.signing_key))
    finally:
        await r.aclose()


__all__ = ["ChoiceError", "EnvChoice", "choose", "diff_fields", "envs_cmd", "envs_rm_cmd", "parse_git", "render_envs"]
