"""A worker's presence in the fleet catalog: advertised when it is ready, kept alive by a
heartbeat, marked draining at warm shutdown, withdrawn at a clean exit.

Records (`toolq.core.advert`) live in Redis with a TTL that the heartbeat thread refreshes, so
a worker that dies without a clean exit (SIGKILL, a lost machine) drops out after `TTL` seconds.
The hooks in `toolq.workers.app` call this module from Celery's signals; it imports no Celery.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from toolq.core import keys
from toolq.core.advert import TOOL_QUEUE_PREFIX, ToolAdvert, ToolRef, WorkerAdvert, consumer_queues
from toolq.core.catalog import Catalog
from toolq.core.environments import HOST_QUEUE_PREFIX, host_queue
from toolq.core.session_records import instance_queue
from toolq.core.settings import Settings
from toolq.workers import redis_clients
from toolq.workers.config import broker_target

log = logging.getLogger("toolq.worker.presence")

#: Seconds between heartbeats, and how long a record outlives the last one (three beats missed).
HEARTBEAT = 2.0
TTL = 8

_current: Advertiser | None = None
_instance: str | None = None


def instance_id() -> str:
    """This worker instance's id, fixed at first use (before the pool forks, so children share it)."""
    global _instance
    if _instance is None:
        _instance = uuid.uuid4().hex
    return _instance

#: Run by the heartbeat thread before each beat, with the advertiser: what changes what a worker
#: serves after its start (its MCP servers, `toolq.workers.mcp.follow`) re-advertises from here.
_on_beat: list[Callable[[Advertiser], None]] = []


def on_beat(fn: Callable[[Advertiser], None]) -> None:
    _on_beat.append(fn)


class Advertiser:
    """Publishes one worker instance's record and its tools' declarations, and keeps them alive."""

    def __init__(self, r: redis.Redis, record: WorkerAdvert, tools: list[ToolAdvert], *, ttl: int = TTL,
                 interval: float = HEARTBEAT) -> None:
        self.r = r
        self.record = record
        self.tools = tools
        self.ttl = ttl
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return keys.fleet_worker(self.record.instance)

    def publish(self) -> None:
        with self.r.pipeline(transaction=True) as p:
            # Declarations first: a reader that sees the worker can always read what it serves.
            for t in self.tools:
                p.set(keys.fleet_tool(t.digest), t.model_dump_json(), ex=self.ttl)
            p.set(self.key, self.record.model_dump_json(), ex=self.ttl)
            p.sadd(keys.FLEET_WORKERS, self.record.instance)
            p.execute()

    def beat(self) -> None:
        """Refresh the TTLs; if any record is gone (expired while the worker was stalled, or Redis
        restarted empty), publish them all again."""
        with self.r.pipeline(transaction=False) as p:
            for t in self.tools:
                p.expire(keys.fleet_tool(t.digest), self.ttl)
            p.expire(self.key, self.ttl)
            refreshed = p.execute()
        if not all(refreshed):
            self.publish()

    def serve(self, tools: list[ToolRef], adverts: list[ToolAdvert]) -> None:
        """What this worker serves changed after its start: publish the new record at once."""
        self.record = self.record.model_copy(update={"tools": tools})
        self.tools = adverts
        self.publish()

    def start(self) -> None:
        try:
            self.publish()
        except (redis.RedisError, OSError) as e:  # the heartbeat publishes it once Redis answers
            log.warning("could not advertise in the fleet catalog yet: %s", e)
        self._thread = threading.Thread(target=self._run, name="toolq-presence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for fn in list(_on_beat):
                try:
                    fn(self)
                except Exception:  # a follower's bug must not stop the heartbeat
                    log.exception("fleet catalog: a beat hook failed")
            try:
                self.beat()
            except (redis.RedisError, OSError) as e:  # Redis away: the next beat tries again
                log.warning("fleet catalog heartbeat failed: %s", e)

    def mark_draining(self) -> None:
        self.record = self.record.model_copy(update={"draining": True})
        self.publish()

    def withdraw(self) -> None:
        """A clean exit: the record goes at once. Declarations stay until their TTL: another worker
        may serve the same one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
        with self.r.pipeline(transaction=True) as p:
            p.delete(self.key)
            p.srem(keys.FLEET_WORKERS, self.record.instance)
            p.execute()


def configured_queues(consume_from: Any) -> list[str]:
    """The queues a worker was told to consume, without the per-tool ones added to them (nor their
    host queues), nor its instance queue (`write_stdin` to its own sessions: no tool is routed
    there by its spec)."""
    own = instance_queue(instance_id())
    return sorted(q for q in consume_from
                  if not q.startswith((TOOL_QUEUE_PREFIX, HOST_QUEUE_PREFIX)) and q != own)


def add_tool_queues(amqp_queues: Any, catalog: Catalog) -> list[str]:
    """At worker setup, after `--queues` has been applied: consume the per-tool queues too."""
    added = consumer_queues(catalog, configured_queues(amqp_queues.consume_from))
    for q in added:
        amqp_queues.select_add(q)
    return added


def add_host_queues(amqp_queues: Any, catalog: Catalog, host: str) -> list[str]:
    """With environments: each per-tool queue on this host too (`host_queue`), where the calls of
    the host's environments arrive; every worker process of the host consumes them."""
    added = [host_queue(host, q) for q in consumer_queues(catalog, configured_queues(amqp_queues.consume_from))]
    for q in added:
        amqp_queues.select_add(q)
    return added


def _sandbox_in_use(settings: Settings) -> str:
    """The backend the worker actually chose (`auto` resolved), as its banner names it."""
    from toolq.workers import isolation

    sandbox = isolation.current(settings)
    return "unavailable" if sandbox.unavailable else sandbox.backend


def worker_record(*, hostname: str, concurrency: int, queues: list[str], catalog: Catalog,
                  settings: Settings, env_host: str | None = None,
                  env_mode: str | None = None) -> tuple[WorkerAdvert, list[ToolAdvert]]:
    served = [s for s in catalog if s.queue in set(queues)]
    record = WorkerAdvert(instance=instance_id(), hostname=hostname, host=socket.gethostname(), pid=os.getpid(),
                          started_at=time.time(), concurrency=concurrency, queues=queues,
                          sandbox=_sandbox_in_use(settings), env_host=env_host, env_mode=env_mode,
                          tools=[ToolRef.of(s) for s in served])
    return record, [ToolAdvert.of(s) for s in served]


def advertise(consumer: Any, catalog: Catalog, settings: Settings) -> None:
    """At `worker_ready` (its sender is the consumer): the worker takes calls from now on."""
    global _current
    from toolq.workers.environments import agent as environments

    controller = getattr(consumer, "controller", None)
    envs = environments.current()
    record, tools = worker_record(hostname=str(consumer.hostname),
                                  concurrency=int(getattr(controller, "concurrency", 0) or settings.concurrency),
                                  queues=configured_queues(consumer.app.amqp.queues.consume_from), catalog=catalog,
                                  settings=settings, env_host=envs.host if envs else None,
                                  env_mode=envs.mode if envs else None)
    advertiser = Advertiser(redis_clients.sync_client(broker_target(consumer.app.conf), client_name="toolq-presence"),
                            record, tools)
    advertiser.start()
    _current = advertiser
    log.info("advertised as instance %s: %d tool(s)", record.instance, len(tools))


def draining() -> None:
    """At `worker_shutting_down`: still alive (running calls finish) but serving nothing new."""
    if _current is not None:
        try:
            _current.mark_draining()
        except (redis.RedisError, OSError):
            pass


def withdraw() -> None:
    """At `worker_shutdown`: a clean exit removes the record at once."""
    global _current
    if _current is not None:
        try:
            _current.withdraw()
        except (redis.RedisError, OSError):
            pass
        _current = None
