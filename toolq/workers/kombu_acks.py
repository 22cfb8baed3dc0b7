"""Keep a worker alive when a call finishes after Redis restarted (celery/kombu#582).

Closing the channel on reconnect restores its unacked messages, and the ack of a message
delivered before the restart goes to that closed channel: both find its connection gone, and
kombu's Redis transport raises `AttributeError: 'NoneType' object has
no attribute 'hostname'` out of the consumer, and Celery exits the worker's main process with
"Unrecoverable error", leaving its tool processes behind. The unacked record that ack would
remove lived on that connection's Redis: gone with a Redis that restarted empty, or (with AOF)
restored after the visibility timeout and redelivered, which the worker's started marker turns
into a "may have run" output, never a second run. So the ack (or the restore) is dropped, with a
warning: the unacked records stay in Redis, and the visibility timeout restores them.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("toolq.worker")


def _closed(qos: Any) -> bool:
    connection = getattr(qos.channel, "connection", None)
    return connection is None or getattr(connection, "client", None) is None


def install() -> None:
    from kombu.transport import redis as kombu_redis
    from kombu.transport import virtual

    qos = kombu_redis.QoS
    if getattr(qos.ack, "_toolq_guarded", False):
        return

    def guarded(original: Any, what: str, local: Any) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                original(self, *args, **kwargs)
            except AttributeError:
                if not _closed(self):
                    raise
                log.warning("dropped the %s of %s: its channel closed when Redis went away", what,
                            args[0] if args else "the unacked messages")
                local(self, *args)

        method._toolq_guarded = True  # type: ignore[attr-defined]
        return method

    # Wrapping kombu's methods on purpose (mypy: method-assign).
    qos.ack = guarded(qos.ack, "ack", virtual.QoS.ack)  # type: ignore[method-assign]  # local bookkeeping only
    qos.restore_unacked = guarded(  # type: ignore[method-assign]
qos.restore_unacked, "restore", lambda self, *a: self._delivered.clear())
