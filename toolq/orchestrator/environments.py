"""Environments, seen from the orchestrator (issue 28): place one on a host, ask the host to make,
checkpoint or destroy it, and keep its record in the ledger.

A host's worker processes answer signed `EnvRequest`s on `host_requests_key(host)` with sealed
`EnvReply`s on `reply_key(request id)` (toolq/workers/environments/agent.py); this module is the
other end. Placement reads every host's `HostAdvert` (`host_key`): a host that already holds the
base first, then the one with the fewest environments. A record is written before its host is
asked, so `toolq envs` and a host's reaper know of an environment from its first instant.

`Environment` is the API's handle: it owns a key of its own (refreshed like a conversation's
lease), so the host's reaper destroys what a SIGKILLed program left behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from toolq.core.environments import (
    ALL_ENVS_KEY,
    EMPTY_BASE,
    Checkpoint,
    EnvironmentRecord,
    EnvReply,
    EnvRequest,
    EnvSource,
    GitSource,
    HostAdvert,
    TurnDiff,
    env_key,
    host_envs_key,
    host_key,
    host_requests_key,
    new_environment_id,
    reply_key,
)
from toolq.core.errors import ConfigurationError
from toolq.core.session_records import conversation_key
from toolq.core.settings import Settings, workspace_problem
from toolq.core.signing import Signer
from toolq.orchestrator.transport.catalog_reader import BOOT_POLL, NOTICE_AFTER, POLL, FleetCatalog
from toolq.orchestrator.transport.conversation import ConversationLease
from toolq.orchestrator.transport.indexed import read_indexed
from toolq.workers.redis_clients import dedicated_pool

if TYPE_CHECKING:
    from toolq.workers.environments.archive import Entry
    from toolq.workers.store import BlobStore

log = logging.getLogger("toolq.environments")

MIB = 1024 * 1024
#: How long a host may take to make an environment (a cold base: fetch, unpack; a git clone).
CREATE_TIMEOUT = 300.0
#: ... to checkpoint or destroy one.
REQUEST_TIMEOUT = 120.0
#: A destroyed or lost record stays listed this long (`toolq envs` shows what happened), then goes.
GONE_RECORD_TTL = 86_400

ONE_SOURCE = "an environment comes from one source: upload, git or checkpoint, not several"
EnvOp = Literal["create", "checkpoint", "destroy"]

NO_HOST = ("no worker host keeps environments: start `toolq worker` (as root for overlay, or as any user for "
           "copies) on a machine that reaches this Redis, then try again")


class EnvironmentRefused(ConfigurationError):
    """An environment could not be made or reached (one line, exit 2): no host keeps environments,
    a disk cap, an archive or the store refused, the host said no."""


class NoEnvironmentHost(EnvironmentRefused):
    """No live worker host advertises environments."""


@dataclass(frozen=True)
class Upload:
    """A folder packed and put in the store: the source to create from, and what it held."""

    source: EnvSource
    manifest: dict[str, Entry]


def choose_host(adverts: Iterable[HostAdvert], base: str | None, *, avoid: Sequence[str] = ()) -> str | None:
    """Where a new environment goes: a host whose cache holds `base` first (no fetch, no unpack),
    then the one with the fewest environments; the host id breaks ties, so the choice is stable.
    `base` None (a git source, known once a host has cloned it): any host. A host past its disk
    cap is taken only when every host is; hosts in `avoid` (one that just died) only if none else."""
    hosts = {a.host: a for a in adverts}
    if not hosts:
        return None

    def rank(a: HostAdvert) -> tuple[bool, bool, bool, int, str]:
        full = bool(a.cap_bytes) and a.used_bytes >= a.cap_bytes
        holds = base is not None and base in a.bases
        return (a.host in avoid, full, not holds, a.environments, a.host)

    return min(hosts.values(), key=rank).host


def source_of(upload: Upload | EnvSource | None = None, git: str | GitSource | None = None,
              checkpoint: str | None = None) -> EnvSource:
    """The one source the API's keywords name (none: an empty environment)."""
    given = [x for x in (upload, git, checkpoint) if x is not None]
    if len(given) > 1:
        raise EnvironmentRefused(ONE_SOURCE)
    if isinstance(upload, Upload):
        return upload.source
    if isinstance(upload, EnvSource):
        return upload
    if git is not None:
        src = git if isinstance(git, GitSource) else parse_git(git)
        return EnvSource(kind="git", git=src, label=f"{shown_url(src.url)}@{src.ref}")
    if checkpoint is not None:
        return EnvSource(kind="checkpoint", checkpoint=checkpoint, label=checkpoint)
    return EnvSource(kind="empty", label="(empty)")


def shown_url(url: str) -> str:
    """A URL as `toolq envs` shows it: a password or token in it is left out."""
    parts = urlsplit(url)
    if parts.scheme and "@" in parts.netloc:
        return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
    return url


def pending_source(upload: Path | str | Upload | EnvSource | None = None, git: str | GitSource | None = None,
                   checkpoint: str | None = None) -> EnvSource | Path:
    """What the API's keywords name: a source, or a folder still to pack (at the handle's `open`)."""
    if isinstance(upload, (str, Path)):
        if git is not None or checkpoint is not None:
            raise EnvironmentRefused(ONE_SOURCE)
        return Path(upload)
    return source_of(upload, git, checkpoint)


def environment_record(env: Environment | EnvironmentRecord | None) -> EnvironmentRecord | None:
    """The record a call is routed by, from what the API takes."""
    if env is None or isinstance(env, EnvironmentRecord):
        return env
    return env._made()


def parse_git(spec: str) -> GitSource:
    """`URL[@REF]`: the ref after the last `@` that is past the URL's host (`git@host:` is a URL)."""
    head, sep, ref = spec.rpartition("@")
    if sep and head and "/" not in ref and ":" not in ref and ("/" in head or ":" in head):
        return GitSource(url=head, ref=ref)
    return GitSource(url=spec)


class Environments:
    """Every environment this process makes or reaches, on the fleet's Redis and workspace store."""

    def __init__(self, r: aioredis.Redis, settings: Settings, signer: Signer | None,
                 catalog: FleetCatalog | None = None) -> None:
        self.r, self.settings, self.signer = r, settings, signer
        self.catalog = catalog or FleetCatalog(r)
        """Where the hosts are found: each live worker names the host it serves environments of."""
        self._store: BlobStore | None = None

    async def store(self) -> BlobStore:
        if self._store is None:
            from toolq.workers.store import StoreError, open_store

            try:
                self._store = await asyncio.to_thread(open_store, self.settings)
            except StoreError as e:
                raise EnvironmentRefused(f"the workspace store cannot be opened: {e}") from None
        return self._store

    async def _in_store(self, fn: Any, *args: Any) -> Any:
        from toolq.workers.store import StoreError

        store = await self.store()
        try:
            return await asyncio.to_thread(getattr(store, fn), *args)
        except StoreError as e:
            raise EnvironmentRefused(str(e)) from None

    # --- sources ---------------------------------------------------------------------------------

    async def upload(self, folder: Path) -> Upload:
        """Pack `folder` (a git checkout: its tracked and untracked-not-ignored files) within
        TOOLQ_UPLOAD_MAX_MB / TOOLQ_UPLOAD_MAX_FILES and put the tar in the store (once)."""
        from toolq.workers.environments.archive import ArchiveError, Limits, pack_dir

        folder = await asyncio.to_thread(lambda: Path(folder).expanduser().resolve())
        if not await asyncio.to_thread(folder.is_dir):
            raise EnvironmentRefused(f"cannot upload {folder}: not a folder")
        # What a shared workspace may not be, an upload may not either: the model reads all of it
        # (a home's keys), and --apply writes its changes back (into toolq's own import path).
        if problem := await asyncio.to_thread(workspace_problem, folder):
            raise EnvironmentRefused(f"cannot upload {folder}: {problem}")
        limits = Limits(max_bytes=self.settings.upload_max_mb * MIB, max_files=self.settings.upload_max_files)
        try:
            packed = await asyncio.to_thread(pack_dir, folder, limits)
        except ArchiveError as e:
            raise EnvironmentRefused(f"cannot upload {folder}: {e} (TOOLQ_UPLOAD_MAX_MB="
                                     f"{self.settings.upload_max_mb}, TOOLQ_UPLOAD_MAX_FILES="
                                     f"{self.settings.upload_max_files})") from None
        blob = await self._in_store("put", packed.tar)
        return Upload(EnvSource(kind="upload", blob=blob, label=str(folder)), packed.manifest)

    async def read_checkpoint(self, checkpoint: str) -> Checkpoint:
        raw = await self._in_store("get", checkpoint)
        try:
            return Checkpoint.model_validate_json(raw)
        except ValidationError:
            raise EnvironmentRefused(f"{checkpoint} is not a checkpoint") from None

    async def base_of(self, source: EnvSource) -> tuple[str | None, str | None]:
        """(the base the host overlays, the checkpoint laid over it); a git base is not known yet."""
        if source.kind == "upload":
            if not source.blob:
                raise EnvironmentRefused("an upload source needs its blob")
            return source.blob, None
        if source.kind == "checkpoint":
            if not source.checkpoint:
                raise EnvironmentRefused("a checkpoint source needs its checkpoint id")
            return (await self.read_checkpoint(source.checkpoint)).base, source.checkpoint
        if source.kind == "git":
            return None, None
        return EMPTY_BASE, None

    # --- hosts -----------------------------------------------------------------------------------

    async def hosts(self) -> list[HostAdvert]:
        """Every live host's advert (an expired one is a host gone). The hosts are named by the live
        workers' records (no scan of the keyspace); a host is live while its own advert is."""
        names = sorted({w.env_host for w in (await self.catalog.snapshot()).workers if w.env_host})
        raws = await self.r.mget([host_key(h) for h in names]) if names else []
        out = []
        for raw in raws:
            if raw is None:
                continue
            try:
                out.append(HostAdvert.model_validate_json(raw))
            except ValidationError:
                log.warning("unreadable host advert: %.80r", raw)
        return out

    async def host_alive(self, host: str) -> bool:
        return bool(await self.r.exists(host_key(host)))

    async def place(self, base: str | None, *, avoid: Sequence[str] = ()) -> str:
        """A host for it. While workers this process started are still booting (an embedded
        stack's, `catalog.starting`) it waits for one as a call waits for its worker: for the boot,
        then the catalog's grace; then it gives up, saying so in one line."""
        began = time.monotonic()
        end = began + self.catalog.grace
        noticed = False
        while (host := choose_host(await self.hosts(), base, avoid=avoid)) is None:
            starting = self.catalog.starting
            if starting is None:
                raise NoEnvironmentHost(NO_HOST)
            now = time.monotonic()
            if starting.booting:
                end = now + self.catalog.grace
            elif starting.error:
                raise NoEnvironmentHost(f"no worker host keeps environments: the workers toolq started failed to "
                                        f"start ({starting.error})")
            if now >= end:
                log.warning("gave up waiting for a worker host that keeps environments after %.0fs", now - began)
                raise NoEnvironmentHost(NO_HOST)
            if not noticed and now - began >= NOTICE_AFTER:
                noticed = True
                log.warning("waiting for a worker host that keeps environments (%s)", starting.what)
            await asyncio.sleep(BOOT_POLL if starting.booting else POLL)
        return host

    # --- records ---------------------------------------------------------------------------------

    async def record(self, env_id: str) -> EnvironmentRecord | None:
        raw = await self.r.get(env_key(env_id))
        if raw is None:
            return None
        try:
            return EnvironmentRecord.model_validate_json(raw)
        except ValidationError:
            return None

    async def records(self) -> list[EnvironmentRecord]:
        """Every environment with a record, oldest first (`toolq envs`). Ids whose record expired
        are dropped from the index."""
        out = []
        for _, raw in await read_indexed(self.r, ALL_ENVS_KEY, env_key):
            try:
                out.append(EnvironmentRecord.model_validate_json(raw))
            except ValidationError:
                continue
        return sorted(out, key=lambda e: (e.created_at, e.id))

    async def _write(self, record: EnvironmentRecord) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            ended = record.state in ("destroyed", "lost", "failed")
            pipe.set(env_key(record.id), record.model_dump_json(), ex=GONE_RECORD_TTL if ended else None)
            pipe.sadd(ALL_ENVS_KEY, record.id)
            if ended:
                pipe.srem(host_envs_key(record.host), record.id)
            else:
                pipe.sadd(host_envs_key(record.host), record.id)
            await pipe.execute()

    # --- requests to a host ----------------------------------------------------------------------

    async def ask(self, op: EnvOp, record: EnvironmentRecord, timeout: float) -> EnvReply:
        """Send a signed request to the record's host and wait for its sealed reply (on a connection
        of its own: a long wait never holds the fleet's pool). EnvironmentRefused past `timeout`."""
        if self.signer is None:
            raise EnvironmentRefused("environments need TOOLQ_SIGNING_KEY (the fleet's key signs their requests)")
        request = EnvRequest(op=op, env=record, deadline=time.time() + timeout)
        body = request.model_dump(mode="json")
        message = json.dumps({"request": body, "sig": self.signer.sign_env_request(body)})
        pool = dedicated_pool(self.r, "toolq-env-reply")
        client = aioredis.Redis(connection_pool=pool)
        try:
            await self.r.lpush(host_requests_key(record.host), message)
            end = time.monotonic() + timeout
            while (left := end - time.monotonic()) > 0:
                got = await client.blpop([reply_key(request.id)], timeout=max(1, min(5, int(left + 0.999))))
                if got is None:
                    if not await self.host_alive(record.host):
                        raise EnvironmentRefused(f"host {record.host} is gone (its workers stopped advertising it) "
                                                 f"before it answered: {op} of {record.id} not done")
                    continue
                reply = self._genuine(request.id, got[1])
                if reply is not None:
                    return reply
            raise EnvironmentRefused(f"host {record.host} did not answer within {timeout:g}s: "
                                     f"{op} of {record.id} not done")
        except (RedisError, OSError) as e:
            raise EnvironmentRefused(f"the task queue (Redis) is unavailable: {e}") from None
        finally:
            await client.aclose()
            await pool.aclose()

    def _genuine(self, request_id: str, raw: bytes | str) -> EnvReply | None:
        assert self.signer is not None
        try:
            message = json.loads(raw)
        except ValueError:
            message = None
        if not self.signer.env_reply_genuine(request_id, message):
            log.warning("refused a reply to environment request %s: not sealed by the fleet's key", request_id)
            return None
        try:
            return EnvReply.model_validate(message["reply"])
        except ValidationError:
            return None

    # --- lifecycle -------------------------------------------------------------------------------

    async def create(self, source: EnvSource, *, owner: str, host: str | None = None, env_id: str | None = None,
                     avoid: Sequence[str] = ()) -> EnvironmentRecord:
        """Place, record and make an environment; its record once the host says it is ready.
        `owner`: a Redis key that lives while the owner does (the host's reaper watches it)."""
        base, start = await self.base_of(source)
        host = host or await self.place(base, avoid=avoid)
        return await self._make(self._new_record(source, base, start, owner, host, env_id))

    def _new_record(self, source: EnvSource, base: str | None, start: str | None, owner: str, host: str,
                    env_id: str | None = None) -> EnvironmentRecord:
        return EnvironmentRecord(id=env_id or new_environment_id(), host=host, source=source, base=base or "",
                                 start=start, owner=owner, idle_limit=self.settings.env_idle,
                                 lifetime=self.settings.env_lifetime)

    async def _make(self, record: EnvironmentRecord) -> EnvironmentRecord:
        await self._write(record)
        try:
            reply = await self.ask("create", record, CREATE_TIMEOUT)
        except EnvironmentRefused as e:
            await self._fail(record, str(e))
            raise
        if not reply.ok:
            await self._fail(record, reply.error)
            raise EnvironmentRefused(reply.error or f"host {record.host} refused environment {record.id}")
        made = await self.record(record.id) or record  # the host may have written it (a git base, its mode)
        made = made.model_copy(update={"state": "ready", "mode": reply.mode or made.mode, "host": record.host,
                                       "size": reply.size or made.size, "used_at": time.time()})
        await self._write(made)
        return made

    async def _fail(self, record: EnvironmentRecord, error: str) -> None:
        try:
            await self._write(record.model_copy(update={"state": "failed", "error": error}))
        except (RedisError, OSError):
            pass

    async def checkpoint(self, env: EnvironmentRecord) -> TurnDiff:
        """Capture the environment's changes against its base (a checkpoint in the store) and
        record it as the environment's newest; the diff a turn's outcome carries."""
        reply = await self.ask("checkpoint", env, REQUEST_TIMEOUT)
        if not reply.ok or not reply.checkpoint:
            raise EnvironmentRefused(reply.error or f"host {env.host} took no checkpoint of {env.id}")
        env.checkpoint = reply.checkpoint
        env.used_at = time.time()
        env.size = reply.size or env.size
        current = await self.record(env.id) or env
        await self._write(current.model_copy(update={"checkpoint": reply.checkpoint, "used_at": env.used_at,
                                                     "size": env.size}))
        return reply.diff or TurnDiff(checkpoint=reply.checkpoint)

    async def destroy(self, env_id: str) -> None:
        """Destroy it on its host (processes, sessions, files); on a host that is gone, only the
        record is left to mark."""
        record = await self.record(env_id)
        if record is None or record.state in ("destroyed", "lost"):
            return
        if await self.host_alive(record.host):
            reply = await self.ask("destroy", record, REQUEST_TIMEOUT)
            if not reply.ok:
                raise EnvironmentRefused(reply.error or f"host {record.host} did not destroy {env_id}")
        # A host that is gone took the environment with it: only its record is left to mark.
        current = await self.record(env_id) or record
        await self._write(current.model_copy(update={"state": "destroyed", "size": 0}))

    async def fork(self, checkpoint: str, n: int, *, owner: str | Sequence[str]) -> list[EnvironmentRecord]:
        """`n` environments from one checkpoint, on one host (they share its base there), made at
        once. `owner`: one key for all, or one per environment."""
        if n < 1:
            raise EnvironmentRefused(f"fork needs n >= 1, not {n}")
        owners = [owner] * n if isinstance(owner, str) else list(owner)
        source = source_of(checkpoint=checkpoint)
        base, start = await self.base_of(source)  # the checkpoint read once, not once per fork
        host = await self.place(base)
        made = await asyncio.gather(*(self._make(self._new_record(source, base, start, o, host)) for o in owners),
                                    return_exceptions=True)
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:  # none half-made: the ones that came up go again
            await asyncio.gather(*(self.destroy(m.id) for m in made if isinstance(m, EnvironmentRecord)),
                                 return_exceptions=True)
            raise failed[0]
        return [m for m in made if isinstance(m, EnvironmentRecord)]

    async def recreate(self, record: EnvironmentRecord) -> EnvironmentRecord:
        """Its host is gone: the same environment on another host, from its last checkpoint (or its
        source again, when it never had one). Its record names the new host."""
        await self._write(record.model_copy(update={"state": "lost"}))
        host = await self.place(record.base or None, avoid=[record.host])
        again = record.model_copy(update={"host": host, "start": record.checkpoint or record.start,
                                          "state": "creating", "mode": None, "error": "",
                                          "created_at": time.time(), "used_at": time.time()})
        return await self._make(again)


def lost_note(record: EnvironmentRecord, old_host: str, *, cause: str | None = None) -> str:
    """What the model is told when its environment came back on another host (or, `cause`, anew)."""
    start = record.start or record.checkpoint
    since = f"its last checkpoint ({start})" if start else "its starting files (no checkpoint had been taken)"
    cause = cause or f"The machine running this conversation's environment ({old_host}) was lost."
    return (f"<environment_restored>\n{cause} "
            f"The environment was recreated on {record.host} from {since}. Every process that was running "
            "(exec_command sessions included) is gone, and changes made since that checkpoint were lost: check "
            "the files before relying on them.\n</environment_restored>")


class Environment:
    """An environment the API holds (`Fleet.environment(...)`): `await` it or `async with` it.

    It owns a key of its own, refreshed while the handle lives, so a host destroys the environment
    once this process is gone even if it never said so. `destroy()` (or leaving the block) ends it."""

    def __init__(self, environments: Environments, source: EnvSource | Path | None = None, *,
                 record: EnvironmentRecord | None = None, lease: ConversationLease | None = None) -> None:
        self.environments = environments
        self._source = source
        self.record: EnvironmentRecord | None = record
        self.lease = lease or ConversationLease(environments.r, f"envh_{uuid.uuid4().hex[:16]}")

    @property
    def owner(self) -> str:
        return conversation_key(self.lease.id)

    @property
    def id(self) -> str:
        return self._made().id

    def _made(self) -> EnvironmentRecord:
        if self.record is None:
            raise RuntimeError("the environment is not made yet: `await fleet.environment(...)` first")
        return self.record

    async def open(self) -> Environment:
        if self.record is None:
            source = self._source or source_of()
            if isinstance(source, Path):
                source = (await self.environments.upload(source)).source
            await self.lease.hold()
            try:
                self.record = await self.environments.create(source, owner=self.owner)
            except BaseException:
                await self.lease.release()
                raise
        return self

    def __await__(self) -> Any:
        return self.open().__await__()

    async def __aenter__(self) -> Environment:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def checkpoint(self) -> TurnDiff:
        return await self.environments.checkpoint(self._made())

    async def fork(self, n: int) -> list[Environment]:
        """`n` new environments from this one's files now (a checkpoint is taken first), each a
        handle with its own key."""
        checkpoint = (await self.checkpoint()).checkpoint
        handles = [Environment(self.environments) for _ in range(n)]
        for h in handles:
            await h.lease.hold()
        try:
            records = await self.environments.fork(checkpoint, n, owner=[h.owner for h in handles])
        except BaseException:
            for h in handles:
                await h.lease.release()
            raise
        for h, r in zip(handles, records, strict=True):
            h.record = r
        return handles

    async def destroy(self) -> None:
        try:
            if self.record is not None:
                await self.environments.destroy(self.record.id)
        finally:
            await self.lease.release()

    aclose = destroy
