"""Which waiting calls go back on their queue: only the ones a worker took and no live worker holds
(the real path, a SIGKILLed worker on real Redis: tests/integration/test_faults.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from toolq.orchestrator.stranded import StrandedCalls


class FakeFleet:
    def __init__(self, hostnames):
        self.hostnames = hostnames

    async def snapshot(self, max_age=None):
        return SimpleNamespace(workers=[SimpleNamespace(hostname=h) for h in self.hostnames])


class FakeDispatcher:
    def __init__(self, taken, held, hostnames=("a@h", "b@h")):
        self._taken, self._held = taken, held
        self.fleet = FakeFleet(hostnames)
        self.asked: list[set[str]] = []
        self.restored: list[str] = []

    async def taken(self):
        return dict(self._taken)

    async def held(self, task_ids, hostnames, timeout=1.0):
        self.asked.append(set(hostnames))
        return self._held

    async def restore(self, tags):
        self.restored += tags


class FakeLedger:
    def __init__(self, started=()):
        self.started = set(started)

    async def started_at(self, task_id):
        return 1.0 if task_id in self.started else None


class FakeRouter:
    def __init__(self, results=()):
        self.results = set(results)

    async def has_result(self, task_id):
        return task_id in self.results


def sweep(dispatcher, *, waiting, ledger=None, router=None):
    stranded = StrandedCalls(dispatcher, router or FakeRouter(), ledger or FakeLedger(), after=0.0, interval=0.0)
    old = time.time() - 10

    async def run():
        for task_id in waiting:
            await stranded.check(task_id, old)

    asyncio.run(run())
    return dispatcher.restored


def test_a_call_taken_by_no_live_worker_goes_back_on_its_queue():
    d = FakeDispatcher({"t1": "tag1", "other-runtime": "tag9"}, held=set())
    assert sweep(d, waiting=["t1"]) == ["tag1"]
    assert d.asked == [{"a@h", "b@h"}], "every live worker of the catalog is asked"


def test_a_call_a_live_worker_holds_stays_where_it_is():
    assert sweep(FakeDispatcher({"t1": "tag1"}, held={"t1"}), waiting=["t1"]) == []


def test_nothing_is_restored_unless_every_live_worker_answered():
    assert sweep(FakeDispatcher({"t1": "tag1"}, held=None), waiting=["t1"]) == []


@pytest.mark.parametrize("why", ["started", "finished"])
def test_a_call_that_started_or_finished_is_left_to_its_own_path(why):
    d = FakeDispatcher({"t1": "tag1"}, held=set())
    kw = {"ledger": FakeLedger(started={"t1"})} if why == "started" else {"router": FakeRouter(results={"t1"})}
    assert sweep(d, waiting=["t1"], **kw) == []


def test_an_empty_catalog_names_no_live_worker_so_nothing_is_restored():
    assert sweep(FakeDispatcher({"t1": "tag1"}, held=set(), hostnames=()), waiting=["t1"]) == []


def test_a_call_still_on_its_queue_costs_no_question_to_the_fleet():
    d = FakeDispatcher({}, held=set())
    assert sweep(d, waiting=["t1"]) == [] and d.asked == []


def test_a_call_queued_a_moment_ago_is_not_looked_for():
    d = FakeDispatcher({"t1": "tag1"}, held=set())
    stranded = StrandedCalls(d, FakeRouter(), FakeLedger(), after=60.0, interval=0.0)
    asyncio.run(stranded.check("t1", time.time()))
    assert d.restored == [] and d.asked == []
