"""A call's transitions, in the one place they happen (`call_entry.CallEntry`): every way a call
can move, and that the first outcome wins whoever settles it (issue 25 item 2). The barrier's own
contract tests (test_barrier.py) drive these through a Step on the in-memory transport."""

from __future__ import annotations

import asyncio

from toolq.core.calls import ToolResult
from toolq.core.states import CallState
from toolq.orchestrator.binding import BoundCall
from toolq.orchestrator.call_entry import CallEntry, startable
from toolq.orchestrator.transport import CallWatch
from toolq.workers.streaming import STREAM_BYTES


def _entry() -> CallEntry:
    return CallEntry(BoundCall(output_index=0, call_id="c1", kind="function", tool="t"))


def _result(state: CallState, text: str = "out") -> ToolResult:
    return ToolResult(call_id="c1", output=text, status=state, success=state is CallState.COMPLETED)


def test_a_call_goes_pending_queued_throttled_queued_running_settled():
    async def go() -> None:
        entry = _entry()
        assert entry.state is CallState.PENDING and entry.unsent
        entry.begin()
        assert entry.state is CallState.QUEUED
        assert entry.throttle("a permit of t") and entry.state is CallState.THROTTLED and entry.unsent
        assert not entry.throttle("a permit of t")  # the same notice again changes nothing
        assert entry.throttle("the turn's cap") and entry.throttled_by == "the turn's cap"
        assert entry.send() and entry.state is CallState.QUEUED and entry.queued_at is not None
        assert not entry.unsent and not entry.send()  # sent once, it was not throttled
        watch = CallWatch(task_id="t:0:0:c1")
        watch.hostname, watch.started_at = "w1", 123.0
        entry.run(watch)
        assert (entry.state, entry.worker, entry.started_at) == (CallState.RUNNING, "w1", 123.0)
        assert entry.settle(_result(CallState.COMPLETED))
        assert entry.state is CallState.COMPLETED and entry.done.is_set() and entry.finished_at is not None

    asyncio.run(go())


def test_the_first_settle_wins_and_nothing_moves_a_settled_call():
    async def go() -> None:
        entry = _entry()
        entry.begin()
        assert entry.settle(_result(CallState.CANCELLED, "aborted"))
        assert not entry.settle(_result(CallState.COMPLETED, "late result"))  # the worker's, after a cancel
        assert (entry.state, entry.result.output) == (CallState.CANCELLED, "aborted")
        assert not entry.throttle("a late limit notice") and entry.state is CallState.CANCELLED
        assert not entry.printed("late output") and entry.live_output == ""
        assert not entry.unsent

    asyncio.run(go())


def test_streamed_output_is_kept_up_to_its_bound():
    async def go() -> None:
        entry = _entry()
        assert entry.printed("x" * (STREAM_BYTES - 1)) and entry.printed("yz")
        assert len(entry.live_output) == STREAM_BYTES and entry.live_output.endswith("y")
        assert not entry.printed("more")

    asyncio.run(go())


def test_an_aborted_outcome_says_cancelled_with_codex_words():
    async def go() -> None:
        entry = _entry()
        aborted = entry.aborted(worker="w2")
        assert (aborted.status, aborted.success, aborted.worker) == (CallState.CANCELLED, False, "w2")
        assert "aborted" in aborted.output_text()

    asyncio.run(go())


def test_startable_keeps_codex_read_write_lock():
    P, Q, C = CallState.PENDING, CallState.QUEUED, CallState.COMPLETED
    assert startable([(P, False), (P, False)]) == [0, 1]
    assert startable([(Q, False), (P, True), (P, False)]) == []  # a serial call waits for the calls before it
    assert startable([(C, False), (P, True), (P, False)]) == [1]  # and nothing after it starts meanwhile
