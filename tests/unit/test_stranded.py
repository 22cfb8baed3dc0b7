"""Which waiting calls go back on their queue: only the ones a worker took and no live worker holds
(the real path, a SIGKILLed worker on real Redis: tests/integration/test_faults.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolContext, tool
from toolq.core.session_records import SessionRecord
from toolq.core.states import CallState
from toolq.orchestrator.transport import CallWatch
from toolq.orchestrator.transport import stranded as stranded_module
from toolq.orchestrator.transport.stranded import StrandedCalls


class NoArgs(BaseModel):
    pass


CATALOG = Catalog()


@tool(name="noop", catalog=CATALOG)
def noop(args: NoArgs, ctx: ToolContext) -> str:
    return "ok"


SPEC = noop.tool_spec


def inv(call_id: str) -> ToolInvocation:
    return ToolInvocation(turn_id="turn-1", step=0, output_index=0, call_id=call_id, tool_name=ToolName.plain("noop"),
                          payload=FunctionPayload(arguments="{}"), deadline=time.time() + 60, workspace="/tmp",
                          spec_digest=SPEC.digest())


def tid(call_id: str) -> str:
    return inv(call_id).task_id


class FakeFleet:
    def __init__(self, hostnames):
        self.hostnames = hostnames
        self.departed_at = float("-inf")

    async def snapshot(self, max_age=None):
        return SimpleNamespace(workers=[SimpleNamespace(hostname=h, instance=f"inst-{h}", env_host=None)
                                        for h in self.hostnames])


class FakeDispatcher:
    def __init__(self, taken, held, hostnames=("a@h", "b@h"), on_queue=()):
        self._taken = {tid(c): tag for c, tag in taken.items()}
        self._held = None if held is None else {tid(c) for c in held}
        self.on_queue = {tid(c) for c in on_queue}
        self.fleet = FakeFleet(hostnames)
        self.asked: list[set[str]] = []
        self.restored: list[str] = []
        self.resent: list[str] = []

    async def queued(self, task_ids, queues):
        return task_ids & self.on_queue

    async def resend(self, inv, spec):
        self.resent.append(inv.call_id)

    async def taken(self):
        return dict(self._taken)

    async def held(self, task_ids, hostnames, timeout=1.0):
        self.asked.append(set(hostnames))
        return self._held

    async def restore(self, tags):
        self.restored += tags


class FakeLedger:
    def __init__(self, started=()):
        self.started = {tid(c) for c in started}

    async def started_at(self, task_id):
        return 1.0 if task_id in self.started else None


class FakeRouter:
    def __init__(self, results=()):
        self.results = {tid(c) for c in results}

    async def has_result(self, task_id):
        return task_id in self.results


def sweep(dispatcher, *, waiting, ledger=None, router=None, started=()):
    stranded = StrandedCalls(dispatcher, router or FakeRouter(), ledger or FakeLedger(), after=0.0, interval=0.0)
    old = time.time() - 10

    async def run():
        for call_id in waiting:
            watch = CallWatch(task_id=tid(call_id))
            if call_id in started:
                watch.set_started("a@h")
            await stranded.check(inv(call_id), SPEC, old, watch)

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
    assert sweep(d, waiting=["t1"]) == [] and d.asked == [] and d.resent == []


def test_a_call_sent_before_a_worker_died_and_found_nowhere_is_sent_again():
    """Killed between taking the message and recording it as taken: the message is gone."""
    d = FakeDispatcher({}, held=set())
    d.fleet.departed_at = time.time()
    assert sweep(d, waiting=["t1"]) == [] and d.resent == ["t1"]


@pytest.mark.parametrize("where", ["on its queue", "held by a live worker"])
def test_a_call_found_after_a_worker_died_is_not_sent_again(where):
    d = FakeDispatcher({}, held={"t1"} if where != "on its queue" else set(),
                       on_queue={"t1"} if where == "on its queue" else ())
    d.fleet.departed_at = time.time()
    sweep(d, waiting=["t1"])
    assert d.resent == []


def test_a_call_sent_after_the_worker_died_is_not_suspected():
    d = FakeDispatcher({}, held=set())
    d.fleet.departed_at = time.time() - 60
    sweep(d, waiting=["t1"])
    assert d.resent == [] and d.asked == []


def test_a_call_queued_a_moment_ago_is_not_looked_for():
    d = FakeDispatcher({"t1": "tag1"}, held=set())
    stranded = StrandedCalls(d, FakeRouter(), FakeLedger(), after=60.0, interval=0.0)

    async def run():
        await stranded.check(inv("t1"), SPEC, time.time(), CallWatch(task_id=tid("t1")))

    asyncio.run(run())
    assert d.restored == [] and d.asked == []


def test_a_call_that_started_since_it_was_last_checked_is_not_looked_for():
    d = FakeDispatcher({"t1": "tag1"}, held=set())
    assert sweep(d, waiting=["t1"], started=["t1"]) == [] and d.asked == []


@pytest.mark.parametrize("holder", ["inst-gone@h", "inst-a@h"])
def test_a_write_to_a_session_whose_worker_is_gone_is_answered_and_not_resent(monkeypatch, holder):
    monkeypatch.setattr(stranded_module, "GONE_AFTER", 0.0)
    d = FakeDispatcher({}, held=set())
    d.fleet.departed_at = time.time()
    stranded = StrandedCalls(d, FakeRouter(), FakeLedger(), after=0.0, interval=0.0)

    async def run():
        watch = CallWatch(task_id=tid("w1"))
        watch.session = SessionRecord.new(7, holder, "gone@h", "sleep 30", tty=False)
        await stranded.check(inv("w1"), SPEC, time.time() - 10, watch)
        return watch

    watch = asyncio.run(run())
    if holder == "inst-gone@h":
        outcome = watch.done.result()
        assert outcome.state is CallState.FAILED
        assert outcome.reason.startswith("write_stdin failed: session 7 was lost with its worker gone@h ")
    else:  # its worker is alive: the write waits for it
        assert not watch.done.done()
    assert d.resent == []


@pytest.mark.parametrize("on_queue", [True, False])
def test_a_call_of_an_environment_whose_host_is_gone_is_taken_off_its_queue_and_answered_not_run(monkeypatch,
                                                                                                 on_queue):
    """Only that host's workers consume its queue: once none lives, a message still on it is taken
    off (so it can never run) and the call is answered as not run, naming the host."""
    from toolq.core.environments import EnvRef

    monkeypatch.setattr(stranded_module, "GONE_AFTER", 0.0)
    d = FakeDispatcher({}, held=set())
    removed: list[tuple[str, str]] = []

    async def unqueue(task_id, queue):
        removed.append((task_id, queue))
        return on_queue

    d.unqueue = unqueue
    stranded = StrandedCalls(d, FakeRouter(), FakeLedger(), after=0.0, interval=0.0)
    call = inv("e1").model_copy(update={"environment": EnvRef(id="env_1", host="dead-box")})

    async def run():
        watch = CallWatch(task_id=call.task_id)
        await stranded.check(call, SPEC, time.time() - 10, watch)
        return watch

    watch = asyncio.run(run())
    assert removed and removed[0][1].startswith("toolq.h.dead-box.noop.")
    if on_queue:
        outcome = watch.done.result()
        assert outcome.state is CallState.REJECTED
        assert outcome.reason.startswith("noop was not run: the worker host `dead-box`")
    else:  # a dead worker took it: put back first, taken off at a later sweep
        assert not watch.done.done()
