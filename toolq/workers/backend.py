"""Celery's Redis result backend, minus the subscribe-at-send, plus signed metas.

Stock `RedisBackend` SUBSCRIBEs the sending client to every task it sends and only lets go
when `get()` is called (docs/reference/celery-notes.md#the-subscribe-at-send-leak). toolq never
calls `get()`: the orchestrator's barrier owns its subscriptions (one pattern per turn), so sends
must not pile up channels.

Every meta a worker stores is signed with the fleet key, and a stored meta that fails the check
reads as absent (toolq/core/signing.py): the orchestrator only believes signed metas.

A store is one round trip, not Celery's two (GET to see whether a SUCCESS is already stored,
then SET + PUBLISH): a script does the check and the write, and hands a stored SUCCESS back
for the signature check, which only Python can do.
"""

from __future__ import annotations

from typing import Any

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

from toolq.core import signing
from toolq.core.contracts import ToolCallFailed
from toolq.workers import spans

# KEYS: the meta. ARGV: the encoded meta, its TTL (0: none). Returns a stored SUCCESS, left in
# place, or nil once the meta is stored and published. A genuine meta is kombu's JSON of Celery's
# dict, which starts with its status: a prefix test, so a large stored result is never decoded in
# the server, and anything else (a forged SUCCESS written otherwise included) is overwritten.
_STORE = """
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, ARGV[3]:len()) == ARGV[3] then
    return current
end
if tonumber(ARGV[2]) > 0 then
    redis.call('SETEX', KEYS[1], ARGV[2], ARGV[1])
else
    redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return false
"""


_SUCCESS_PREFIX = '{"status": "SUCCESS"'


class NoSubscribeRedisBackend(RedisBackend):
    def on_task_call(self, producer, task_id):
        pass

    def encode(self, data):
        return super().encode(signing.seal_stored(self.app.conf.get(signing.CONF_KEY), data))

    def _get_task_meta_for(self, task_id):
        meta = super()._get_task_meta_for(task_id)
        return signing.genuine_stored(self.app.conf.get(signing.CONF_KEY), task_id, meta)

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        """Celery's `_store_result` (a stored genuine SUCCESS is never overwritten), in one round trip.
        A call that did not complete (`ToolCallFailed`) is an expected outcome: stored without
        Celery's traceback (of toolq's own frames), which says nothing its state and exit code do not."""
        if isinstance(result, dict) and result.get("exc_type") == ToolCallFailed.__name__:
            traceback = None
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        key = bytes_to_str(self.get_key_for_task(task_id))
        expires = self.failure_expires if state == states.FAILURE else self.expires
        with spans.result_store(state):  # the call's `toolq.result.store`, when it is traced
            stored = self.ensure(self._store, (key, value, int(expires or 0)))
            if stored is not None:
                current = signing.genuine_stored(self.app.conf.get(signing.CONF_KEY), bytes_to_str(task_id),
                                                 self.decode_result(stored))
                if current["status"] != states.SUCCESS:  # a forged SUCCESS blocks nothing: overwrite it
                    self.set(key, value, expires=expires)
        return result

    def _store(self, key: str, value: str, expires: int) -> Any:
        script = self.__dict__.get("_store_script")
        if script is None:
            script = self.__dict__["_store_script"] = self.client.register_script(_STORE)
        return script(keys=[key], args=[value, expires, _SUCCESS_PREFIX])


class NoSubscribeSentinelBackend(NoSubscribeRedisBackend, SentinelBackend):
    """The same on a Sentinel-managed primary: Celery's `SentinelBackend` finds it (its
    `master_name` and `sentinel_kwargs` in `result_backend_transport_options`)."""
