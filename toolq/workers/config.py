"""Celery's configuration for toolq, for both sides: the workers' app and each orchestrator's
sending app (`toolq.orchestrator.transport.dispatch`). Building an app here loads no tool and starts nothing.

Settings follow what Celery did when measured (docs/reference/celery-notes.md#settings-toolq-chose):
JSON only, prefork, `acks_late` + prefetch 1 (fair, and queued revokes are honoured), STARTED
tracked (to tell lost from queued), task events when Flower asks for them, a visibility timeout
above the longest tool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from toolq.core import signing
from toolq.core.catalog import ToolSpec
from toolq.core.contracts import TIME_LIMIT_MARGIN
from toolq.core.redis_target import RedisTarget, parse_redis_url
from toolq.core.settings import Settings
from toolq.workers import kombu_clients

if TYPE_CHECKING:  # Celery is imported by `make_app`, when an app is made: `longest_timeout` needs none
    from celery import Celery


def longest_timeout(specs: Iterable[ToolSpec]) -> float:
    return max((s.timeout for s in specs), default=60.0)


def celery_config(settings: Settings, longest: float, *, worker: bool = False) -> dict[str, Any]:
    """`longest`: the longest tool timeout, which the visibility timeout must stay above.
    `worker`: the worker's own app (its queues' poll interval), not a client's."""
    broker = settings.redis_target() or RedisTarget("redis://127.0.0.1:6379/0")
    backend = settings.result_target() or broker
    poll = {"polling_interval": settings.worker_poll} if worker and settings.worker_poll is not None else {}
    backend_class = "NoSubscribeSentinelBackend" if backend.is_sentinel else "NoSubscribeRedisBackend"
    return dict(
        broker_url=broker.celery_url(),
        result_backend=f"toolq.workers.backend:{backend_class}+{backend.celery_url()}",
        # kombu's and Celery's Sentinel options: the master's name, the sentinels' own password.
        result_backend_transport_options=_sentinel_options(backend),
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        # Task events (task-received, -started, -succeeded) only once a monitor asks for them: Flower
        # broadcasts `enable_events` every 5 s and `toolq flower` once at its start (flower.py). A
        # worker nobody watches saves their CPU (about a fifth of its main process's per call);
        # worker events (heartbeats, online/offline) go out regardless.
        worker_send_task_events=False,
        # Off: a sent event carries the real task name and, arriving after task-received, makes
        # Flower show `toolq.run` instead of `tool:<name>`; the ledger records "queued" anyway.
        task_send_sent_event=False,
        result_expires=6 * 3600,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            # Never below the longest tool, or healthy calls get delivered twice
            # (docs/reference/celery-notes.md#lost-workers-and-the-visibility-timeout).
            "visibility_timeout": int(longest + 2 * TIME_LIMIT_MARGIN + 60),
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 1,
            # toolq sends no message priorities: one list per queue, not four, so each BRPOP of a
            # worker's many queues (one per tool declaration) names a quarter of the keys.
            "priority_steps": [0],
            # The BRPOP's timeout, which a warm shutdown waits out. Never a client's: kombu also
            # sleeps that long between a client's empty polls (pings, inspect).
            **poll,
            **_sentinel_options(broker),
        },
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        # toolq's own: the fleet key (signing.py; Celery masks it in `inspect conf`) and whether
        # task-succeeded log lines and Flower may show tool output (summary.py).
        **{signing.CONF_KEY: settings.signing_key, "toolq_log_tool_output": settings.log_tool_output},
    )


def _sentinel_options(target: RedisTarget) -> dict[str, Any]:
    if not target.is_sentinel:
        return {}
    return {"master_name": target.master, **({"sentinel_kwargs": target.sentinel_kwargs()}
                                             if target.sentinel_password else {})}


def broker_target(conf: Any) -> RedisTarget:
    """The Redis an app's broker is on (`app.conf`), for the worker's own clients: a Sentinel
    broker's master name and sentinel password are in its transport options."""
    options = conf.broker_transport_options or {}
    return parse_redis_url(conf.broker_url, options.get("master_name"),
                           (options.get("sentinel_kwargs") or {}).get("password"))


def configure_app(app: Celery, settings: Settings, longest: float, *, worker: bool = False) -> Celery:
    kombu_clients.install()  # a Redis client per kombu pool, not per command (both sides)
    app.conf.update(celery_config(settings, longest, worker=worker))
    return app


def make_app(settings: Settings, longest: float = 60.0, *, worker: bool = False) -> Celery:
    """A Celery app on the settings' Redis. Workers use `toolq.workers.app.app`; each orchestrator
    runtime makes its own, so one process can talk to several brokers (tests do)."""
    from celery import Celery

    return configure_app(Celery("toolq", set_as_current=False), settings, longest, worker=worker)
