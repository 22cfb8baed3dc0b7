"""Environments: a conversation's workspace placed on one worker host (issue 28). No I/O here.

An environment is made from a *source* (an uploaded folder, a git commit, a checkpoint, or
nothing) and lives on one *host*: every worker process on that machine shares the host's
environments, and every call of the environment's conversation is routed to that host's queues.
On the host a *base* (a content-addressed tar, unpacked once into a read-only cache) is overlaid
by the environment's own writes; a *checkpoint* is the environment's changes against its base,
stored content-addressed in the workspace store, so a host that dies loses at most the changes
since the last checkpoint and another host can take the environment up from it.

What both ends share lives here: the records, the requests the orchestrator sends to a host and
the replies, the Redis keys and the host queues. The host side is `toolq.workers.environments`;
the store, `toolq.workers.store`; the orchestrator's side, `toolq.orchestrator.environments`.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

#: A blob's address in the workspace store: the sha256 of its bytes, in hex.
BLOB_ID = re.compile(r"\A[0-9a-f]{64}\Z")
#: The base of an environment made from nothing (no blob: an empty folder).
EMPTY_BASE = "empty"
#: A host id names queues and keys: letters, digits, `.`, `_`, `-`.
HOST_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")

EnvState = Literal["creating", "ready", "destroying", "destroyed", "lost", "failed"]
EnvMode = Literal["overlay", "copy"]


def blob_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_environment_id() -> str:
    return f"env_{uuid.uuid4().hex[:16]}"


class GitSource(BaseModel):
    url: str
    ref: str = "HEAD"


class EnvSource(BaseModel):
    """Where an environment's files come from: exactly one of the fields below, or none (empty)."""

    kind: Literal["upload", "git", "checkpoint", "empty"]
    blob: str | None = None
    """upload: the store id of the folder's tar (packed by the orchestrator)."""
    git: GitSource | None = None
    """git: cloned on the host (outside any sandbox), cached by commit."""
    checkpoint: str | None = None
    """checkpoint: the store id of a `Checkpoint` record."""
    label: str = ""
    """What a person recognises in `toolq envs`: the folder, the URL@ref, the checkpoint id."""


class Checkpoint(BaseModel):
    """An environment's files as its changes against its base. Stored in the workspace store as the
    canonical JSON of this model; its id is that blob's sha256."""

    base: str
    """The base blob's id (a tar), or `EMPTY_BASE`."""
    delta: str | None = None
    """The store id of a tar holding every added and changed file (None when only deletions)."""
    added: list[str] = Field(default_factory=list)
    changed: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    """Relative POSIX paths; a deleted directory is listed once, with nothing under it."""
    created_at: float = Field(default_factory=time.time)


class TurnDiff(BaseModel):
    """What a turn changed, as its outcome carries it (`--json`, batch results, `TurnOutcome`)."""

    checkpoint: str
    patch: str = ""
    """A unified diff of the text files (git's `a/` `b/` prefixes), cut at `MAX_PATCH_BYTES`."""
    binary: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    truncated: bool = False
    skipped: list[str] = Field(default_factory=list)
    """What the commands left that no checkpoint carries, one line each (a socket, a FIFO, a
    device, a link leading out, a name that is not UTF-8): it stays on the host, never comes back."""


#: At most this many `skipped` lines in a diff; the last says how many more there were.
MAX_SKIPPED_LINES = 50


def said_skipped(lines: list[str]) -> list[str]:
    if len(lines) <= MAX_SKIPPED_LINES:
        return list(lines)
    return [*lines[:MAX_SKIPPED_LINES - 1], f"and {len(lines) - MAX_SKIPPED_LINES + 1} more"]


#: The diff a turn's outcome carries is cut here; the checkpoint holds every change whole.
MAX_PATCH_BYTES = 1 << 20


class EnvRef(BaseModel):
    """What a call carries (`ToolInvocation.environment`): the worker runs it in that environment,
    and only a worker on `host` may."""

    id: str
    host: str


class EnvironmentRecord(BaseModel):
    """The ledger's record of one environment (`env_key(id)`), written by the orchestrator at
    placement and by the host as it changes state."""

    id: str
    host: str
    source: EnvSource
    base: str
    """The base blob id the host overlays (for a checkpoint source: the checkpoint's base)."""
    start: str | None = None
    """A checkpoint id whose delta is laid over the base at creation (a `--from`, or a recreation
    after its host died)."""
    owner: str
    """A Redis key that exists while the owner lives (a conversation's lease, a batch line's or an
    API handle's own key): the host's reaper destroys the environment once it is gone."""
    state: EnvState = "creating"
    mode: EnvMode | None = None
    created_at: float = Field(default_factory=time.time)
    used_at: float = Field(default_factory=time.time)
    idle_limit: float = 3600.0
    lifetime: float = 86400.0
    checkpoint: str | None = None
    """The newest checkpoint taken (at the end of each turn)."""
    size: int = 0
    """Bytes the environment's own writes use on its host."""
    error: str = ""

    def ref(self) -> EnvRef:
        return EnvRef(id=self.id, host=self.host)


class EnvRequest(BaseModel):
    """What the orchestrator asks of a host (`host_requests_key(host)`, signed by the fleet key).
    Any worker process on the host takes it; the reply goes to `reply_key(id)`."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    op: Literal["create", "checkpoint", "destroy"]
    env: EnvironmentRecord
    deadline: float
    """Epoch seconds: a request taken after it is dropped (the orchestrator stopped waiting)."""


class EnvReply(BaseModel):
    id: str
    ok: bool
    error: str = ""
    """One line, for the user (never a traceback)."""
    mode: EnvMode | None = None
    checkpoint: str | None = None
    diff: TurnDiff | None = None
    size: int = 0


class HostAdvert(BaseModel):
    """What a host says of its environments, beside each worker's record (`host_key(host)`)."""

    host: str
    mode: EnvMode
    """overlay where the worker may mount it; a copy of the base otherwise (said in `toolq workers`)."""
    bases: list[str] = Field(default_factory=list)
    """Base ids unpacked in its cache: placement prefers a host that holds the base."""
    environments: int = 0
    used_bytes: int = 0
    cap_bytes: int = 0


# ---- keys and queues -----------------------------------------------------------------------------

def env_key(env_id: str) -> str:
    return f"toolq:env:{env_id}"


def host_envs_key(host: str) -> str:
    """A set of the environment ids placed on `host` (the reaper and `toolq envs` read it)."""
    return f"toolq:envs:{host}"


ALL_ENVS_KEY = "toolq:envs"
"""A set of every environment id with a record (`toolq envs`)."""


def host_key(host: str) -> str:
    """The host's `HostAdvert`, with a TTL its workers renew."""
    return f"toolq:host:{host}"


def host_requests_key(host: str) -> str:
    return f"toolq:envq:{host}"


def reply_key(request_id: str) -> str:
    return f"toolq:envr:{request_id}"


def git_cache_key(url: str, commit: str) -> str:
    return f"toolq:git:{hashlib.sha256(url.encode()).hexdigest()[:16]}:{commit}"


HOST_QUEUE_PREFIX = "toolq.h."


def host_queue(host: str, route: str) -> str:
    """The queue of one declaration on one host, from its fleet-wide queue (`advert.tool_queue`,
    `toolq.t.<tool>.<digest>`): an environment's calls go to `toolq.h.<host>.<tool>.<digest>`, which
    every worker process on `host` that serves the declaration consumes."""
    return HOST_QUEUE_PREFIX + host + "." + route.removeprefix("toolq.t.")
