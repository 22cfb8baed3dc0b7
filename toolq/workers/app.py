"""toolq's Celery app and its task: the worker process's entry point.

One task runs one `ToolInvocation`. Settings (`config.py`) follow what Celery did when measured
(docs/reference/celery-notes.md#settings-toolq-chose): JSON only, prefork, `acks_late` + prefetch 1
(fair, and queued revokes are honoured), STARTED tracked (to tell lost from queued), task events
when Flower asks for them, a visibility timeout above the longest tool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any

import celery.utils.imports
import redis
from billiard.einfo import ExceptionWithTraceback
from celery import Celery
from celery.exceptions import Ignore, SoftTimeLimitExceeded
from celery.signals import (
    celeryd_after_setup,
    task_postrun,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.worker.request import Request

from toolq.core import keys, signing
from toolq.core import session_records as session_registry
from toolq.core.calls import ToolName
from toolq.core.catalog import Catalog, ToolSpec
from toolq.core.contracts import TASK, TASK_IDEMPOTENT, TIME_LIMIT_MARGIN, ToolCallFailed
from toolq.core.errors import ConfigurationError
from toolq.core.flower_args import flower_args
from toolq.core.settings import Settings, mask_url_password
from toolq.core.states import FAILURE, CallState, celery_state
from toolq.telemetry import metrics
from toolq.workers import config, isolation, kombu_acks, pool_exits, presence, redis_clients, spans, stopping
from toolq.workers.config import configure_app, longest_timeout, make_app
from toolq.workers.environments import agent as environments
from toolq.workers.execute import StillRunning, execute
from toolq.workers.loader import load_catalog
from toolq.workers.mcp.worker import sync as sync_mcp_tools
from toolq.workers.processes import install_sigterm_handler
from toolq.workers.sessions import start as session_host
from toolq.workers.summary import returned

log = logging.getLogger("toolq.worker")

_catalog: Catalog | None = None
_redis: redis.Redis | None = None


def catalog() -> Catalog:
    global _catalog
    if _catalog is None:
        _catalog = load_catalog(Settings.load().tools)
    return _catalog


# Celery imports task modules and its loader "from the current directory" (it puts the folder on
# sys.path around each import), and a worker may be started in a workspace: toolq imports from
# its explicit path only (toolq/core/import_path.py).
celery.utils.imports.cwd_in_path = contextlib.nullcontext
app = make_app(Settings.load(), longest_timeout(catalog()), worker=True)
kombu_acks.install()  # a call finishing after a Redis restart must not take the worker down
pool_exits.install()  # nor a consumer restart just after a pool child died
app.steps["consumer"].add(stopping.Wakeup)  # a warm shutdown starts when asked, not at the next poll
# First among the shutdown notice's receivers: the others may wait on Redis.
worker_shutting_down.connect(stopping.wake, weak=False)
worker_shutting_down.connect(lambda **_: session_host.stopping(), weak=False)  # sessions hook
# The session host boots beside the pool (launched at setup, below): the worker is ready, and
# advertises its tools (`_advertise`), once the host listens. Calls are taken only after this.
worker_ready.connect(lambda **_: session_host.wait_ready(), weak=False)  # sessions hook


def configure(settings: Settings) -> Celery:
    """Re-point the worker app (before the worker starts) at the given settings, once Redis has
    taken the worker's login (`refuse_a_wrong_login`)."""
    configured = configure_app(app, settings, longest_timeout(catalog()), worker=True)
    refuse_a_wrong_login(settings)
    return configured


#: How long the login check waits for Redis: a Redis that does not answer is Celery's to retry.
LOGIN_CHECK_TIMEOUT = 5.0


def refuse_a_wrong_login(settings: Settings) -> None:
    """A Redis that refuses the worker's user or password (WRONGPASS, NOAUTH, invalid
    username-password pair) stops the worker at start, in one line (`ConfigurationError`: the CLI
    prints it and exits 2): Celery would retry it 100 times, as if Redis were down, and a
    password does not get right by waiting. A Redis that is down or does not answer is left to
    Celery, which retries it (`broker_connection_retry_on_startup`)."""
    for target in dict.fromkeys(t for t in (settings.redis_target(), settings.result_target()) if t):
        url = target.url
        client = redis_clients.sync_client(target, socket_connect_timeout=LOGIN_CHECK_TIMEOUT,
                                           socket_timeout=LOGIN_CHECK_TIMEOUT, retry_on_timeout=False)
        try:
            client.ping()
        except redis.AuthenticationError as e:
            raise ConfigurationError(f"Redis at {mask_url_password(url)} refused the worker's login: {e} "
                                     "(check the user and password in REDIS_URL or TOOLQ_RESULT_URL)") from None
        except (redis.RedisError, OSError):
            pass  # down, starting, or refusing PING to this user: the broker's connection says more
        finally:
            client.close()


def redis_client() -> redis.Redis:
    """This process's connection to the ledger (the broker's Redis)."""
    global _redis
    if _redis is None:
        _redis = redis_clients.sync_client(config.broker_target(app.conf))
    return _redis


@worker_process_init.connect
def _child_init(**_: Any) -> None:
    global _redis
    _redis = None  # never share a socket across fork
    isolation.pool_child_started()
    spans.child_started()  # its own tracer provider (the parent's batch thread did not fork), if traces are on
    metrics.after_fork()  # its own OTLP metrics provider, if OTEL_METRICS_EXPORTER=otlp (Prometheus needs none)
    worker_process_shutdown.connect(stopping.exit_without_lingering, weak=False)  # after the user's receivers


# Traces (toolq/workers/spans.py): a call's spans are exported at its task's end, once its result
# is stored (task_postrun comes after the store), and what a child holds before it exits, ahead of
# `exit_without_lingering` (connected later, in the child), so a replaced child loses none.
task_postrun.connect(lambda **_: spans.call_ended(), weak=False)
worker_process_shutdown.connect(lambda **_: spans.child_exiting(), weak=False)
# Its OTLP metric points, if on, waited for as its spans are (at most 5 s, and not at all for a while
# after an exit's export did not finish): the SDK's force_flush ignores its timeout, and against a
# collector that never answers it held each recycled child ~10 s.
worker_process_shutdown.connect(lambda **_: metrics.on() and spans.exit_flush(metrics.flush), weak=False)


@celeryd_after_setup.connect
def _banner(**_: Any) -> None:
    sandbox = isolation.current()
    log_level = logging.WARNING if sandbox.backend == "none" or sandbox.unavailable else logging.INFO
    logging.getLogger("toolq.worker").log(log_level, "%s", sandbox.describe())


@worker_shutting_down.connect
def _draining(sender: Any = None, **_: Any) -> None:
    """Warm shutdown: running calls finish, but pings go unanswered until the worker is gone.
    Say so, for as long as the longest call may still take, so they are not reported lost."""
    longest = longest_timeout(catalog())
    try:
        redis_client().set(keys.draining(str(sender)), "1", ex=int(longest + 2 * TIME_LIMIT_MARGIN))
    except redis.RedisError:
        pass


@worker_shutdown.connect
def _drained(sender: Any = None, **_: Any) -> None:
    isolation.worker_stopped()
    try:
        redis_client().delete(keys.draining(str(getattr(sender, "hostname", sender))))
    except redis.RedisError:
        pass


# --- fleet catalog hooks (toolq/workers/presence.py): a worker consumes the queue of each tool it
# serves besides its configured queues, and advertises itself from ready to a clean exit.
@celeryd_after_setup.connect
def _tool_queues(sender: Any = None, instance: Any = None, **_: Any) -> None:
    presence.add_tool_queues(instance.app.amqp.queues, catalog())


@worker_ready.connect
def _advertise(sender: Any = None, **_: Any) -> None:
    presence.advertise(sender, catalog(), Settings.load())


worker_shutting_down.connect(lambda **_: presence.draining(), weak=False)
worker_shutdown.connect(lambda **_: presence.withdraw(), weak=False)
# --- end of the fleet catalog hooks


# --- exec_command sessions (toolq/workers/sessions): a session host per worker, and a queue that
# only this instance consumes, where each write_stdin for its sessions arrives.
@celeryd_after_setup.connect
def _session_host(sender: Any = None, instance: Any = None, **_: Any) -> None:
    if not Settings.load().sessions or not any(s.sessions for s in catalog()):
        return
    me = presence.instance_id()
    instance.app.amqp.queues.select_add(session_registry.instance_queue(me))
    session_host.start(instance=me, hostname=str(sender), redis_url=app.conf.broker_url)


worker_shutdown.connect(lambda **_: session_host.stop(), weak=False)
# --- end of the session hooks


# --- environments (toolq/workers/environments): this host's environments, set up before the pool
# forks (children run calls in them), their calls' host queues consumed, and the agent thread (the
# orchestrator's requests, the host's advert, the reaper) in the main process from ready to exit.
@celeryd_after_setup.connect
def _environments(sender: Any = None, instance: Any = None, **_: Any) -> None:
    envs = environments.setup(Settings.load())
    if envs is not None:
        presence.add_host_queues(instance.app.amqp.queues, catalog(), envs.host)


@worker_ready.connect
def _environments_agent(**_: Any) -> None:
    environments.start(redis_clients.sync_client(config.broker_target(app.conf), client_name="toolq-environments"),
                       signing.signer_for(app.conf.get(signing.CONF_KEY)))


worker_shutdown.connect(lambda **_: environments.stop(), weak=False)
# --- end of the environment hooks


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
    spec = _spec_of(invocation) if metrics.on() else None  # metrics: the catalog's name and queue only
    metrics.calling(str(spec.tool_name) if spec else None)
    try:
        result = execute(invocation, hostname=_hostname(task), r=redis_client(), catalog=catalog(),
                         redelivery=redelivery, time_limit_errors=(SoftTimeLimitExceeded,),
                         signer=signing.signer_for(app.conf.get(signing.CONF_KEY)))
    except StillRunning:
        raise Ignore() from None  # the first delivery's result answers the call
    metrics.worker_task(str(spec.tool_name) if spec else None, spec.queue if spec else "unknown", invocation, result)
    if celery_state(CallState(result["status"])) == FAILURE:
        raise ToolCallFailed(result)  # Celery records FAILURE; the result travels in the exception
    return returned(result, log_output=bool(app.conf.get("toolq_log_tool_output")))


def _spec_of(invocation: Any) -> ToolSpec | None:
    try:
        return catalog().get(ToolName.model_validate(invocation["tool_name"]))
    except (TypeError, KeyError, ValueError):
        return None


class ToolRequest(Request):
    """A call as the worker's main process reports it in its task events, which are all Flower
    knows of it (the orchestrator sends no task-sent event):

    - its arguments in short, as this worker's declaration of the tool says (`core.flower_args`):
      built-in, user and MCP tools alike, never the value of an argument whose name looks secret;
    - a call that did not complete (`ToolCallFailed`) is an expected outcome: FAILURE with its
      short reason (state and exit code) and no traceback, and a cancelled one is REVOKED, so
      Flower's "Failed" filter lists failures, not cancels. The stored meta stays FAILURE carrying
      the `ToolResult` (what `orchestrator/transport/results.py` reads the call's output from; it
      reads none from a REVOKED meta), so the model and the ledger get the worker's own output;
      a crash in toolq keeps its traceback.
    """

    @property
    def argsrepr(self) -> str:
        if not (self._eventer and self._eventer.enabled):
            return self._argsrepr  # nobody watches: the message's own, at no cost
        shown = self.__dict__.get("_toolq_argsrepr")
        if shown is None:
            args = self._args
            invocation = args[0] if isinstance(args, (list, tuple)) and args else None
            shown = self.__dict__["_toolq_argsrepr"] = flower_args(invocation, _spec_of(invocation))
        return shown

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = exc_info.exception
        exc = exc.exc if isinstance(exc, ExceptionWithTraceback) else exc
        if isinstance(exc, ToolCallFailed):
            if (exc.result or {}).get("status") == CallState.CANCELLED.value:
                super().on_failure(exc_info, send_failed_event=False, return_ok=return_ok)
                self.send_event("task-revoked", terminated=False, signum=None, expired=False)
                return
            exc_info.traceback = ""  # its reason is the exception's repr; a traceback says nothing more
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


# `throws`: an expected outcome, logged in one line without a traceback.
@app.task(name=TASK, bind=True, acks_late=True, reject_on_worker_lost=False, track_started=True,
          throws=(ToolCallFailed,), Request=ToolRequest)
def run_tool(self: Any, invocation: dict, signature: str = "") -> Any:
    return _execute(self, invocation, signature, redelivery=False)


@app.task(name=TASK_IDEMPOTENT, bind=True, acks_late=True, reject_on_worker_lost=True, track_started=True,
          throws=(ToolCallFailed,), Request=ToolRequest)
def run_tool_idempotent(self: Any, invocation: dict, signature: str = "") -> Any:
    return _execute(self, invocation, signature, redelivery=True)
