"""A worker that stops promptly (toolq/workers/stopping.py): the shutdown notice wakes the event
loop's poll, a pool child closed with its pool exits without billiard's one-second linger, and the
queues' poll interval comes from the settings."""

from __future__ import annotations

import os

from kombu.asynchronous import Hub

from toolq.core.settings import Settings
from toolq.workers import stopping
from toolq.workers.config import celery_config


def test_the_shutdown_notice_makes_the_event_loops_poll_return(monkeypatch):
    monkeypatch.setattr(stopping, "_wake", None)
    stopping.wake()  # a notice before the loop runs: no poll to wake, no pipe made
    assert stopping._wake is None
    hub = Hub()
    try:
        stopping.Wakeup.register_with_event_loop(None, None, hub)  # what the consumer does at each (re)start
        stopping.Wakeup.register_with_event_loop(None, None, hub)  # a consumer restart: the same pipe
        read = stopping._wake[0]
        poller = hub.poller
        assert poller.poll(0) == []  # nothing to read: a poll would wait its whole timeout
        stopping.wake()
        assert [fd for fd, _ in poller.poll(0)] == [read]
        callback, args = hub.readers[read]
        callback(*args)  # the loop drains it, and sleeps again
        assert poller.poll(0) == []
    finally:
        hub.close()
        for fd in stopping._wake or ():
            os.close(fd)


def test_a_pool_child_closed_with_its_pool_exits_at_once_one_signalled_alone_goes_billiards_way():
    for exitcode, expected in ((0, 0), (15, 99)):
        pid = os.fork()
        if pid == 0:  # the child, at billiard's `_do_exit`: the receiver, then (if it returns) the rest
            try:
                stopping.exit_without_lingering(exitcode=exitcode, pid=os.getpid())
            finally:
                os._exit(99)  # billiard's own path: DEATH to the parent, a second's sleep, exit
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == expected


def test_a_worker_polls_its_queues_as_often_as_the_settings_say_and_a_client_never_sleeps_between_polls():
    def options(settings: Settings, worker: bool) -> dict:
        return celery_config(settings, 60, worker=worker)["broker_transport_options"]

    assert "polling_interval" not in options(Settings(), worker=True)  # kombu's own: a 1 s BRPOP
    fast = Settings(worker_poll=0.1)
    assert options(fast, worker=True)["polling_interval"] == 0.1
    assert "polling_interval" not in options(fast, worker=False)  # kombu would sleep it between empty polls
