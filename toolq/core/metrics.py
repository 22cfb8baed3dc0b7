"""The metrics toolq exports, declared once (no I/O, no prometheus_client): the one list that
`toolq/telemetry/metrics.py` registers, docs/operating.md documents, the deploy dashboards query
and the tests read.

Names are in Prometheus' form (a counter's name ends in `_total`, as it is scraped; a duration is
in seconds). Labels are bounded: a tool name comes from the catalog (an undeclared name is
"unknown"), a state from `CallState`, a reason from `toolq.core.honest.Known` or "" (the tool wrote
the output), a queue from the configuration. Never a call id, a turn id, a path or a command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]
Side = Literal["orchestrator", "worker"]

#: The OpenTelemetry GenAI conventions' explicit buckets for an operation's duration
#: (`gen_ai.client.operation.duration`), which `gen_ai.execute_tool.duration` follows.
GENAI_DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)
#: A wait (queue, limit): from a millisecond to minutes.
WAIT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)
#: A start or a stop (a sandbox's start, a cancel until the process is dead).
START_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

#: The value of `tool` for a name the catalog does not declare.
UNKNOWN_TOOL = "unknown"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    #: Which process records it (the other side never registers it).
    side: Side = "orchestrator"

    @property
    def base_name(self) -> str:
        """The name without a counter's `_total` (how prometheus_client and OTLP name it)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


EXECUTE_TOOL_DURATION = Metric(
    "gen_ai_execute_tool_duration_seconds", "histogram",
    "A tool call from its commit (the model's output_item.done) to its output in the barrier "
    "(gen_ai.execute_tool.duration), by tool and final call state.",
    ("tool", "state"), GENAI_DURATION_BUCKETS,
)
TOOL_RUN = Metric(
    "toolq_tool_run_seconds", "histogram",
    "A call's handler on the worker, from its start to its result.",
    ("tool", "queue"), GENAI_DURATION_BUCKETS, "worker",
)
QUEUE_WAIT = Metric(
    "toolq_queue_wait_seconds", "histogram",
    "A call's wait in its queue, from the orchestrator's send to the worker's start.",
    ("queue", "tool"), WAIT_BUCKETS, "worker",
)
QUEUE_DEPTH = Metric(
    "toolq_queue_depth", "gauge",
    "Messages waiting in each queue the worker consumes (the broker's list length, read at scrape).",
    ("queue",), (), "worker",
)
CALLS = Metric(
    "toolq_calls_total", "counter",
    "Calls by final state, and the reason toolq wrote the output instead of the tool "
    "(not run, interrupted, stopped by toolq; \"\" when the tool wrote it).",
    ("tool", "state", "reason"),
)
SANDBOX_START = Metric(
    "toolq_sandbox_start_seconds", "histogram",
    "A sandbox's start, until the command in it runs.",
    ("backend",), START_BUCKETS, "worker",
)
CANCEL_TO_DEAD = Metric(
    "toolq_cancel_to_dead_seconds", "histogram",
    "From a revoke received by the worker to the call's process being dead.",
    ("tool",), START_BUCKETS, "worker",
)
TURNS_IN_FLIGHT = Metric("toolq_turns_in_flight", "gauge", "Turns running in this orchestrator.")
TURNS = Metric("toolq_turns_total", "counter", "Turns ended, by final state.", ("state",))
MODEL_REQUESTS = Metric(
    "toolq_model_requests_total", "counter",
    "Model requests by outcome (completed, failed, retried, cancelled).",
    ("outcome",),
)
SESSIONS_IN_FLIGHT = Metric(
    "toolq_sessions_in_flight", "gauge",
    "Sessions (processes kept between calls) live on the worker's session host.",
    (), (), "worker",
)
LIMIT_WAIT = Metric(
    "toolq_limit_wait_seconds", "histogram",
    "A call's wait held back by a limit (parallel: the turn's cap; concurrency: the tool's "
    "max_concurrency; rate: its rate limit) before it is sent.",
    ("limit", "tool"), WAIT_BUCKETS,
)
ENVIRONMENTS = Metric(
    "toolq_environments", "gauge", "Environments kept by the worker host, by state.",
    ("state",), (), "worker",
)
WORKSPACE_BYTES = Metric(
    "toolq_workspace_bytes", "gauge", "Bytes of the environments' workspaces on the worker host.",
    (), (), "worker",
)
WORKER_TASKS = Metric(
    "toolq_worker_tasks_total", "counter",
    "Tasks the worker ran, by tool and outcome (the result's call state).",
    ("tool", "outcome"), (), "worker",
)

#: Every metric, in the order the docs list them.
METRICS: tuple[Metric, ...] = (
    EXECUTE_TOOL_DURATION, TOOL_RUN, QUEUE_WAIT, QUEUE_DEPTH, CALLS, SANDBOX_START, CANCEL_TO_DEAD,
    TURNS_IN_FLIGHT, TURNS, MODEL_REQUESTS, SESSIONS_IN_FLIGHT, LIMIT_WAIT, ENVIRONMENTS,
    WORKSPACE_BYTES, WORKER_TASKS,
)
BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}

#: `toolq_limit_wait_seconds`' `limit` values.
LIMITS = ("parallel", "concurrency", "rate")
#: `toolq_model_requests_total`'s `outcome` values.
MODEL_OUTCOMES = ("completed", "failed", "retried", "cancelled")


def scraped_names(metric: Metric) -> tuple[str, ...]:
    """The sample names a scrape shows for the metric (a histogram's series, a counter's total)."""
    if metric.kind == "histogram":
        return tuple(metric.name + s for s in ("_bucket", "_count", "_sum"))
    return (metric.name,)
