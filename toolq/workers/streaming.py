"""A running command's output, published while it runs: for the live view and `--json` only.

The worker batches what the command prints (every `INTERVAL` seconds, or `BATCH_BYTES`) and
publishes each batch, signed like a result meta, on the call's pub/sub channel
(`keys.call_output`), which the orchestrator's result reader hears under one pattern per turn.
A call streams only when its invocation asks (`stream_output`: a watched turn, and
`TOOLQ_STREAM_OUTPUT` on). At most `STREAM_BYTES` are published per call; past them the stream
stops (the command reads on, under the flood throttle of `toolq.workers.processes`), so a flood
costs Redis and the orchestrator a bounded amount. A command done within `INTERVAL` publishes
nothing. The call's output is still its signed result alone: a batch is never part of it.

Import-safe (no Celery, no tool): the orchestrator reads the bounds from here.
"""

from __future__ import annotations

import codecs
import json
import logging
import time
from collections.abc import Callable

from toolq.core.contracts import STREAM_BYTES
from toolq.core.signing import Signer

log = logging.getLogger("toolq.streaming")

#: Seconds between batches at most (the first one waits this long too).
INTERVAL = 0.1
#: A batch this big goes out at once.
BATCH_BYTES = 16 * 1024

Publish = Callable[[str, str], object]
"""`publish(channel, message)`: redis-py's `Redis.publish`."""


class OutputStream:
    """Batches one call's output and publishes it. Never raises into the call: a failed publish
    ends the stream, not the command."""

    def __init__(self, publish: Publish, signer: Signer, task_id: str, channel: str, *,
                 interval: float = INTERVAL, batch: int = BATCH_BYTES, budget: int = STREAM_BYTES) -> None:
        self._publish, self._signer, self._task_id, self._channel = publish, signer, task_id, channel
        self._interval, self._batch, self._left = interval, batch, budget
        self._pending = bytearray()
        self._last = time.monotonic()
        self._seq = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.published = 0
        """Bytes published so far."""

    @property
    def open(self) -> bool:
        return self._left > 0

    def write(self, data: bytes) -> None:
        if not data or self._left <= 0:
            return
        take = data[: self._left - len(self._pending)]
        self._pending += take
        if len(self._pending) >= self._batch or len(self._pending) >= self._left:
            self.flush()
        else:
            self.tick()

    def tick(self) -> None:
        """Called from the read loop: sends what waits once `interval` has passed."""
        if self._pending and time.monotonic() - self._last >= self._interval:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data, self._pending = bytes(self._pending), bytearray()
        self._last = time.monotonic()
        self._left -= len(data)
        text = self._decoder.decode(data, final=self._left <= 0)
        if not text:
            return
        self._seq += 1
        try:
            self._publish(self._channel, json.dumps(self._signer.seal_output(self._task_id, self._seq, text)))
            self.published += len(data)
        except Exception as e:  # Redis away: the view misses the rest, the call does not
            log.info("output stream of %s stopped: %s", self._task_id, e)
            self._left = 0
