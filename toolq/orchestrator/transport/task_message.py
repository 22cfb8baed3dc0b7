"""A call's Celery task message, built here as Celery's `send_task` builds it (task protocol 2,
kombu's Redis transport), but without Celery, kombu or a round trip of its own.

Why: dispatch pushes this message from inside the ledger's claim script (`Ledger.claim_and_send`),
so one round trip claims a call, queues it and marks it sent, where `send_task` on the dispatch
threads was the second of three (after the claim, before the `sent` mark), a thread hand-off,
and the larger part of the orchestrator's CPU per call (`toolq bench throughput`). The workers
are stock Celery consumers: they read this message as any other. `tests/unit/test_task_message.py`
checks it against what `send_task` itself publishes, so a Celery or kombu upgrade that changes the
format fails there first.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel


class TaskMessage(BaseModel):
    """What one task message says; `encode()` gives the bytes the broker's queue list holds."""

    task: str
    task_id: str
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str
    expires: float
    """Epoch seconds: a message still queued then is dropped by the worker (Celery's `expires`)."""
    time_limit: float
    soft_time_limit: float
    shadow: str
    """The name Flower and the worker's log show instead of the task's."""
    argsrepr: str
    kwargsrepr: str
    origin: str
    """Who sent it (Celery's `anon_nodename()`, gen<pid>@<host>)."""
    reply_to: str
    """Celery's sending app's oid: unused by the Redis result backend, kept for the format."""

    def encode(self, now: float) -> str:
        """The kombu envelope of the message as `Channel._put` pushes it (body JSON, base64)."""
        body = json.dumps([self.args, self.kwargs, {"callbacks": None, "errbacks": None, "chain": None,
                                                   "chord": None}])
        headers: dict[str, Any] = {
            "lang": "py", "task": self.task, "id": self.task_id, "shadow": self.shadow, "eta": None,
            "expires": datetime.fromtimestamp(self.expires, tz=UTC).isoformat(),
            "group": None, "group_index": None, "retries": 0, "timelimit": [self.time_limit, self.soft_time_limit],
            "root_id": self.task_id, "parent_id": None, "argsrepr": self.argsrepr, "kwargsrepr": self.kwargsrepr,
            "origin": self.origin, "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None,
            "stamps": {},
        }
        properties = {
            "correlation_id": self.task_id, "reply_to": self.reply_to,
            # send_task's extra options land in the properties too; the broker ignores `expiration`
            # (a TTL in ms, for AMQP), the worker reads `expires` above.
            "argsrepr": self.argsrepr, "kwargsrepr": self.kwargsrepr,
            "expiration": str(int(max(self.expires - now, 0.0) * 1000)),
            "delivery_mode": 2, "delivery_info": {"exchange": "", "routing_key": self.queue}, "priority": 0,
            "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
        }
        return json.dumps({"body": base64.b64encode(body.encode()).decode(), "content-encoding": "utf-8",
                           "content-type": "application/json", "headers": headers, "properties": properties})


def anon_nodename() -> str:
    """Celery's name for a process that is not a worker, as the `origin` of what it sends."""
    return f"gen{os.getpid()}@{socket.gethostname()}"


def queue_key(queue: str) -> str:
    """The broker's Redis list of a queue: its name (toolq sends no priorities, `priority_steps`
    is [0] in workers/config.py, and kombu keys priority 0 by the bare name)."""
    return queue


#: kombu's Redis hash of the messages workers have taken and not acked (its transport's default
#: `unacked_key`, which toolq's config keeps): delivery tag -> [message, exchange, routing key].
UNACKED_KEY = "unacked"


def task_id_of(message: Any) -> str | None:
    """The task id of a decoded task message (None if it is not one)."""
    try:
        return str(message["headers"]["id"])
    except (KeyError, TypeError, IndexError):
        return None


def message_task_id(raw: bytes | str) -> str | None:
    """The task id of a task message as the broker's list holds it."""
    try:
        return task_id_of(json.loads(raw))
    except ValueError:
        return None


__all__ = ["UNACKED_KEY", "TaskMessage", "anon_nodename", "message_task_id", "queue_key", "task_id_of"]
