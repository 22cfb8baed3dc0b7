"""Celery's Redis result backend, minus the subscribe-at-send, plus signed metas.

Stock `RedisBackend` SUBSCRIBEs the sending client to every task it sends and only lets go
when `get()` is called (celery-lab.md §3). toolq never calls `get()`: the orchestrator's barrier
owns its subscriptions (one pattern per turn), so sends must not pile up channels.

Every meta a worker stores is signed with the fleet key, and a stored meta that fails the check
reads as absent (toolq/workers/signing.py): the orchestrator only believes signed metas.
"""

from celery.backends.redis import RedisBackend

from toolq.workers import signing


class NoSubscribeRedisBackend(RedisBackend):
    def on_task_call(self, producer, task_id):  # noqa: ANN001 - Celery's signature
        pass

    def encode(self, data):  # noqa: ANN001 - Celery's signature
        return super().encode(signing.seal_stored(self.app.conf.get(signing.CONF_KEY), data))

    def _get_task_meta_for(self, task_id):  # noqa: ANN001 - Celery's signature
        meta = super()._get_task_meta_for(task_id)
        return signing.genuine_stored(self.app.conf.get(signing.CONF_KEY), task_id, meta)
