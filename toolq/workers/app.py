"""toolq's Celery app: the only worker-side module that imports Celery.

One task runs one `ToolInvocation`. Settings follow celery-lab.md's measurements: JSON only,
prefork, `acks_late` + prefetch 1 (fair, and queued revokes are honoured), STARTED tracked
(to tell lost from queued), events on for Flower, a visibility timeout above the longest tool.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, SoftTimeLimitExceeded
from celery.signals import worker_process_init, worker_shutdown, worker_shutting_down

from toolq.orchestrator import keys
from toolq.orchestrator.settings import Settings
from toolq.workers import signing
from toolq.workers.catalog import Catalog, load_catalog
from toolq.workers.execute import execute
from toolq.workers.mcp.worker import sync as sync_mcp_tools
from toolq.workers.sandbox import install_sigterm_handler
from toolq.workers.summary import returned

log = logging.getLogger("toolq.worker")

TASK = "toolq.run"
#: Same body, but a call whose worker died is redelivered (only idempotent tools go here).
TASK_IDEMPOTENT = "toolq.run_idempotent"

#: Slack between a tool's own timeout and Celery's hard kill, and above it for redelivery.
TIME_LIMIT_MARGIN = 5.0

_catalog: Catalog | None = None
_redis: redis.Redis | None = None


def catalog() -> Catalog:
    global _catalog
    if _catalog is None:
        _catalog = load_catalog(Settings.load().tools)
    return _catalog


def celery_config(settings: Settings) -> dict[str, Any]:
    longest = max((s.timeout for s in catalog()), default=60.0)
    broker = settings.redis_url or "redis://127.0.0.1:6379/0"
    backend = settings.result_backend_url() or broker
    return dict(
        broker_url=broker,
        result_backend=f"toolq.workers.backend:NoSubscribeRedisBackend+{backend}",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        worker_send_task_events=True,
        # Off: a sent event carries the real task name and, arriving after task-received, makes
        # Flower show `toolq.run` instead of `tool:<name>`; the ledger records "queued" anyway.
        task_send_sent_event=False,
        result_expires=6 * 3600,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            # Never below the longest tool, or healthy calls get delivered twice (celery-lab §6).
            "visibility_timeout": int(longest + 2 * TIME_LIMIT_MARGIN + 60),
            "unacked_restore_interval": 10,
            "unacked_restore_throttle": 1,
        },
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        # toolq's own: the fleet key (signing.py; Celery masks it in `inspect conf`) and whether
        # task-succeeded log lines and Flower may show tool output (summary.py).
        **{signing.CONF_KEY: settings.signing_key, "toolq_log_tool_output": settings.log_tool_output},
    )


def make_app(settings: Settings) -> Celery:
    """A Celery app on the settings' Redis. Workers use the module's `app`; each orchestrator
    runtime makes its own, so one process can talk to several brokers (tests do)."""
    app = Celery("toolq", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


app = make_app(Settings.load())


def configure(settings: Settings) -> Celery:
    """Re-point the worker app (before the worker starts) at the given settings."""
    app.conf.update(celery_config(settings))
    return app


def redis_client() -> redis.Redis:
    """This process's connection to the ledger (the broker's Redis)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    return _redis


@worker_process_init.connect
def _child_init(**_: Any) -> None:
    global _redis
    _redis = None  # never share a socket across fork


@worker_shutting_down.connect
def _draining(sender: Any = None, **_: Any) -> None:
    """Warm shutdown: running calls finish, but pings go unanswered until the worker is gone.
    Say so, for as long as the longest call may still take, so they are not reported lost."""
    longest = max((s.timeout for s in catalog()), default=60.0)
    try:
        redis_client().set(keys.draining(str(sender)), "1", ex=int(longest + 2 * TIME_LIMIT_MARGIN))
    except redis.RedisError:
        pass


@worker_shutdown.connect
def _drained(sender: Any = None, **_: Any) -> None:
    try:
        redis_client().delete(keys.draining(str(getattr(sender, "hostname", sender))))
    except redis.RedisError:
        pass


def _hostname(task: Any) -> str:
    return task.request.hostname or f"{os.getpid()}@{socket.gethostname()}"


def _execute(task: Any, invocation: dict, signature: str, redelivery: bool) -> Any:
    # A task the orchestrator did not sign (pushed by whoever reached Redis) is not run, and
    # stores no state: Ignore acks it without a result, so it cannot answer a live call's id.
    refusal = signing.refuse_invocation(app.conf.get(signing.CONF_KEY), task.name, task.request.id, invocation,
                                        signature)
    if refusal:
        log.warning("refused task %s (%s): %s; not run", task.request.id, task.name, refusal)
        raise Ignore()
    # revoke(terminate=True) SIGTERMs the pool child; its command's process group must die too.
    # Installed per call: billiard resets the pool child's signal handlers after
    # worker_process_init, so a handler set there is gone by the time a task runs.
    install_sigterm_handler()
    sync_mcp_tools(catalog(), invocation)  # an MCP server may have listed its tools anew since the fork
    result = execute(invocation, hostname=_hostname(task), r=redis_client(), catalog=catalog(), redelivery=redelivery,
                     time_limit_errors=(SoftTimeLimitExceeded,))
    return returned(result, log_output=bool(app.conf.get("toolq_log_tool_output")))


@app.task(name=TASK, bind=True, acks_late=True, reject_on_worker_lost=False, track_started=True)
def run_tool(self: Any, invocation: dict, signature: str = "") -> Any:
    return _execute(self, invocation, signature, redelivery=False)


@app.task(name=TASK_IDEMPOTENT, bind=True, acks_late=True, reject_on_worker_lost=True, track_started=True)
def run_tool_idempotent(self: Any, invocation: dict, signature: str = "") -> Any:
    return _execute(self, invocation, signature, redelivery=True)
