"""Celery's Redis result backend, minus the subscribe-at-send.

Stock `RedisBackend` SUBSCRIBEs the sending client to every task it sends and only lets go
when `get()` is called (celery-lab.md §3). toolq never calls `get()`: the orchestrator's barrier
owns its subscriptions (one pattern per turn), so sends must not pile up channels.
"""

from celery.backends.redis import RedisBackend


class NoSubscribeRedisBackend(RedisBackend):
    def on_task_call(self, producer, task_id):  # noqa: ANN001 - Celery's signature
        pass
