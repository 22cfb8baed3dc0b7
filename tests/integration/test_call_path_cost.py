"""What a call costs on the way through kombu and Redis, counted (not timed) on real parts."""

from __future__ import annotations

import time

import pytest
import redis

from tests.integration import conftest as c
from toolq.workers.config import make_app

pytestmark = pytest.mark.integration


def test_sending_tasks_builds_one_redis_client_not_one_per_message(redis_server, monkeypatch):
    app = make_app(c.Settings(redis_url=redis_server.url, signing_key=c.SIGNING_KEY))
    made: list[object] = []
    init = redis.Redis.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    try:
        app.send_task("toolq.test.nothing", queue="toolq-test-unconsumed").forget()  # connect, declare
        monkeypatch.setattr(redis.Redis, "__init__", counting)
        for _ in range(20):
            app.send_task("toolq.test.nothing", queue="toolq-test-unconsumed")
        assert len(made) <= 1, f"{len(made)} redis clients for 20 sends"
    finally:
        monkeypatch.undo()
        redis.Redis.from_url(redis_server.url).delete("toolq-test-unconsumed")
        app.close()


def test_a_workers_poll_names_each_of_its_queues_once(fleet, redis_server):
    """No priority lists: a BRPOP over a worker's queues (one per tool declaration) names each
    queue's one list, not four."""
    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 15
    with r.monitor() as m:
        for event in m.listen():
            assert time.monotonic() < deadline, "no worker polled its queues"
            args = event["command"].split()
            if args[0].upper() == "BRPOP":
                queues = args[1:-1]
                break
    r.close()
    assert "toolq" in queues and len(queues) == len(set(queues)) > 1, queues
    assert not [q for q in queues if "\\x06\\x16" in q], queues  # kombu's priority list separator
