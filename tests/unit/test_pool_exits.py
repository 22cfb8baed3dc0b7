"""A consumer restart just after a pool child died must not take the worker down
(toolq/workers/pool_exits.py; found by the fault campaign)."""

import os
from types import SimpleNamespace

from celery.concurrency.asynpool import AsynPool
from kombu.asynchronous import Hub

from toolq.workers import pool_exits


def test_a_child_that_exited_is_not_handed_to_the_event_loop_again():
    pool_exits.install()
    pool = SimpleNamespace(_event_process_exit=lambda *a: None)
    hub = Hub()
    try:
        dead = SimpleNamespace(pid=4242, _sentinel_poll=None)  # what _untrack_child_process leaves
        AsynPool._track_child_process(pool, dead, hub)  # raised ValueError('file descriptor is None')
        assert hub.readers == {}
        r, w = os.pipe()
        live = SimpleNamespace(pid=4243, _popen=SimpleNamespace(sentinel=r))
        AsynPool._track_child_process(pool, live, hub)  # a live child is still watched
        assert live._sentinel_poll in hub.readers
    finally:
        hub.close()
        for fd in (r, w, getattr(live, "_sentinel_poll", None)):
            if fd is not None:
                os.close(fd)


def test_install_is_idempotent():
    pool_exits.install()
    first = AsynPool._track_child_process
    pool_exits.install()
    assert AsynPool._track_child_process is first
