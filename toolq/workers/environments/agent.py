"""A worker process's environment agent (issue 28): one thread in each worker's main process.

It takes the orchestrator's signed requests off `host_requests_key(host)` (any worker process of
the host may take one: they share the host's root), runs them on the host's `EnvHost`, writes the
record's new state to `env_key(id)` and pushes a signed `EnvReply` to `reply_key(request id)`.
The same thread renews the host's `HostAdvert` (what placement reads) and runs the reaper.

A worker whose environment root cannot be made or written serves no environments: it logs one
line, consumes no host queue and starts no agent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from toolq.core import metrics as declared
from toolq.core.environments import (
    ALL_ENVS_KEY,
    HOST_ID,
    EnvReply,
    EnvRequest,
    env_key,
    host_envs_key,
    host_key,
    host_requests_key,
    reply_key,
)
from toolq.core.settings import Settings, mask_url_password
from toolq.core.signing import Signer, signer_for
from toolq.telemetry import metrics
from toolq.workers.environments import archive, namespace
from toolq.workers.environments.host import EnvError, EnvHost, update_record
from toolq.workers.store import StoreError, open_store

log = logging.getLogger("toolq.worker.environments")

#: Seconds between the host's adverts, and how long one outlives the last renewal.
ADVERT_EVERY = 2.0
ADVERT_TTL = 8
REAP_EVERY = 5.0
#: How long a reply waits for its reader, who BLPOPs it at once if still waiting.
REPLY_TTL = 60
POLL = 1
#: Requests one worker process runs at once (each holds its environment's lock while it runs).
RUNNERS = 4

_host: EnvHost | None = None
_agent: Agent | None = None


def host_id(settings: Settings) -> str:
    """`TOOLQ_HOST_ID`, else the machine's name, made a valid host id."""
    raw = settings.host_id or socket.gethostname()
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", raw).lstrip("._-")[:100]
    return clean if HOST_ID.match(clean) else "host"


def env_root(settings: Settings) -> Path:
    if settings.env_root is not None:
        return Path(settings.env_root)
    if os.geteuid() == 0:
        return Path("/var/lib/toolq/envs")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "toolq" / "envs"


def fleet_of(settings: Settings) -> str:
    """Names the fleet's Redis (not its password): what a host's environments on disk belong to."""
    url = mask_url_password(settings.redis_url or "")
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def limits(settings: Settings) -> archive.Limits:
    return archive.Limits(max_bytes=settings.upload_max_mb * 1024 * 1024, max_files=settings.upload_max_files)


_namespace: str | None = None


def enter_namespace(settings: Settings) -> None:
    """At the worker's start, before it has threads: an unprivileged worker joins (or makes) its
    host's namespace, where it may mount its environments' overlays (`namespace.py`)."""
    global _namespace
    signer = signer_for(settings.signing_key)
    _namespace = (namespace.enter(env_root(settings), signer.host_namespace_key(), fleet_of(settings))
                  if signer is not None else "no fleet key to prove the host's namespace with")


def setup(settings: Settings, r: redis.Redis | None = None) -> EnvHost | None:
    """At worker setup, before the pool forks (children inherit it): this host's environments, or
    None (logged once) if its root cannot be used."""
    global _host
    root = env_root(settings)
    if namespace.stranded():
        log.warning("environments: this worker serves none (%s)", _namespace)
        _host = None
        return None
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        store = open_store(settings)
        _host = EnvHost(root, host_id(settings), store, settings.env_disk_mb * 1024 * 1024, limits(settings), r=r,
                        fleet=fleet_of(settings))
    except Exception as e:  # any reason at all: the worker still serves shared-workspace calls
        log.warning("environments: root %s cannot be used (%s); this worker serves no environments", root,
                    getattr(e, "strerror", None) or e)
        _host = None
        return None
    if _host.mode == "copy" and _namespace is not None and not namespace.inside():  # why copies
        log.info("environments: host %s, copy mode (%s), root %s", _host.host, _namespace, root)
    else:
        log.info("environments: host %s, %s mode, root %s", _host.host, _host.mode, root)
    return _host


def current() -> EnvHost | None:
    """This worker's host of environments (set at setup; inherited by pool children)."""
    return _host


def start(r: redis.Redis, signer: Signer | None) -> None:
    """At `worker_ready`, in the main process."""
    global _agent
    if _host is None or _agent is not None:
        return
    _host.r = r
    _agent = Agent(_host, r, signer)
    _agent.start()
    host = _host
    # Read when scraped (the worker's main process serves /metrics), from what the host knows:
    # its environments' records in one MGET, and the sizes last computed (never a walk).
    metrics.add_source(declared.ENVIRONMENTS.name,
                       lambda: {(state,): float(n) for state, n in host.state_counts().items()})
    metrics.add_source(declared.WORKSPACE_BYTES.name, lambda: {(): float(host.used_bytes(walk=False))})


def stop() -> None:
    global _agent
    if _agent is not None:
        _agent.stop()
        _agent = None


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class Agent:
    def __init__(self, envs: EnvHost, r: redis.Redis, signer: Signer | None) -> None:
        self.envs, self.r, self.signer = envs, r, signer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._advertiser: threading.Thread | None = None
        # Requests run beside the loop: a create from a cold base or a big checkpoint takes longer
        # than the advert's TTL, and a host whose advert lapsed is taken for dead. A request is
        # taken off the queue only when a runner is free, so another process of the host may take it.
        self._runners = ThreadPoolExecutor(max_workers=RUNNERS, thread_name_prefix="toolq-environment")
        self._free = threading.BoundedSemaphore(RUNNERS)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="toolq-environments", daemon=True)
        self._thread.start()
        # The advert on a thread of its own: nothing slow (walking an environment's files for its
        # size, reaping, a Redis call of the loop) may let it lapse and the host pass for dead.
        self._advertiser = threading.Thread(target=self._advertise_loop, name="toolq-environments-advert",
                                            daemon=True)
        self._advertiser.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._advertiser):
            if thread is not None:
                thread.join(timeout=POLL + 5)
        self._runners.shutdown(wait=False, cancel_futures=True)

    def _advertise_loop(self) -> None:
        while True:
            try:
                self.advertise()
            except (redis.RedisError, OSError) as e:  # Redis away: the next renewal tries again
                log.warning("environments agent: advert not renewed: %s", e)
            except Exception:
                log.exception("environments advert failed; going on")
            if self._stop.wait(ADVERT_EVERY):
                return

    def _run(self) -> None:
        next_sizes = next_reap = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_sizes:  # what the advert says (it never walks the files itself)
                    next_sizes = now + ADVERT_EVERY
                    self.envs.used_bytes()
                if now >= next_reap:
                    next_reap = now + REAP_EVERY
                    self.envs.reap()
                if not self._free.acquire(timeout=POLL):
                    continue
                try:
                    item = self.r.blpop([host_requests_key(self.envs.host)], timeout=POLL)
                except BaseException:
                    self._free.release()
                    raise
                if item is None:
                    self._free.release()
                else:
                    self._runners.submit(self._serve, item[1])
            except (redis.RedisError, OSError) as e:  # Redis away: try again shortly
                log.warning("environments agent: %s", e)
                self._stop.wait(POLL)
            except Exception:  # a bug must not end the host's environments for good
                log.exception("environments agent failed; going on")
                self._stop.wait(POLL)

    def _serve(self, raw: bytes | str) -> None:
        try:
            self.handle(raw)
        except Exception:  # Redis gone as it replied: the orchestrator's wait says so
            log.exception("environments: a request could not be answered")
        finally:
            self._free.release()

    def advertise(self) -> None:
        self.r.set(host_key(self.envs.host), self.envs.advert().model_dump_json(), ex=ADVERT_TTL)

    def handle(self, raw: bytes | str) -> EnvReply | None:
        """One request off the queue: checked, run, answered. A refused one gets no reply (its
        reply key is named by whoever forged it)."""
        try:
            message = json.loads(raw)
            request, signature = message["request"], message.get("sig")
        except (ValueError, TypeError, KeyError):
            log.warning("environments: dropped a message that is not a request")
            return None
        refusal = (self.signer.env_request_refusal(request, signature) if self.signer is not None
                   else "this worker has no TOOLQ_SIGNING_KEY to check it with")
        if refusal:
            log.warning("environments: refused request %s: %s; not run", str(request.get("id"))[:64]
                        if isinstance(request, dict) else "?", refusal)
            return None
        try:
            req = EnvRequest.model_validate(request)
        except ValueError:
            log.warning("environments: dropped a signed request that does not parse")
            return None
        reply = self.run(req)
        assert self.signer is not None
        with self.r.pipeline(transaction=True) as p:
            p.lpush(reply_key(req.id), json.dumps(self.signer.seal_env_reply(reply.model_dump(mode="json"))))
            p.expire(reply_key(req.id), REPLY_TTL)
            p.execute()
        return reply

    def run(self, req: EnvRequest) -> EnvReply:
        env = req.env
        try:
            if env.host != self.envs.host:
                raise EnvError(f"environment {env.id} is placed on host {env.host}, not {self.envs.host}")
            if req.op == "create":
                return self._create(req)
            if req.op == "checkpoint":
                checkpoint, diff = self.envs.checkpoint(env)
                size = self.envs.env_bytes(env.id)
                update_record(self.r, env.id, checkpoint=checkpoint, size=size, used_at=time.time())
                return EnvReply(id=req.id, ok=True, checkpoint=checkpoint, diff=diff, size=size,
                                mode=self.envs.mode)
            self.envs.destroy(env.id)
            update_record(self.r, env.id, state="destroyed", size=0)
            self.r.srem(host_envs_key(self.envs.host), env.id)
            return EnvReply(id=req.id, ok=True)
        except Exception as e:
            error = self._error(req, e)
            if req.op == "create":
                try:
                    update_record(self.r, env.id, state="failed", error=error)
                except redis.RedisError:
                    pass
            return EnvReply(id=req.id, ok=False, error=error)

    def _create(self, req: EnvRequest) -> EnvReply:
        env = req.env.model_copy(deep=True)
        # The orchestrator wrote the record at placement; a host that finds none (written and
        # lost, or never) keeps the request's copy, so the reaper and `toolq envs` see it.
        with self.r.pipeline(transaction=True) as p:
            p.set(env_key(env.id), env.model_dump_json(), nx=True)
            p.sadd(host_envs_key(self.envs.host), env.id)
            p.sadd(ALL_ENVS_KEY, env.id)
            p.execute()
        mode = self.envs.create(env)
        size = self.envs.env_bytes(env.id)
        fields: dict[str, Any] = {"state": "ready", "mode": mode, "size": size, "used_at": time.time(),
                                  "base": env.base, "error": ""}
        update_record(self.r, env.id, **fields)
        return EnvReply(id=req.id, ok=True, mode=mode, size=size)

    def _error(self, req: EnvRequest, e: Exception) -> str:
        known = (EnvError, archive.ArchiveError, StoreError, OSError, ValueError, redis.RedisError)
        if isinstance(e, known):
            text = one_line(e)
            return text if text.startswith("host ") else f"host {self.envs.host}: {req.op} {req.env.id}: {text}"
        log.exception("environments: %s of %s failed", req.op, req.env.id)
        return f"host {self.envs.host}: {req.op} {req.env.id} failed ({type(e).__name__}); see the worker's log"
