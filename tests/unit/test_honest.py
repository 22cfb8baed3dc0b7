"""toolq's three statements about a call whose output is not the tool's own (`toolq/core/honest.py`),
read back as the fault campaign reads them."""

from __future__ import annotations

import pytest

from toolq.core.calls import aborted_text
from toolq.core.errors import ToolTimedOut
from toolq.core.honest import INFRASTRUCTURE_TEXT, Known, interrupted, known_form, not_run


@pytest.mark.parametrize(("output", "form"), [
    (not_run("exec_command", "the session host does not answer"), Known.NOT_RUN),
    (interrupted("exec_command", "the session host hung up before it answered"), Known.INTERRUPTED),
    ("this call was already started by worker w1, which was lost; it was not run again because the tool is "
     "not idempotent (it may have partially executed)", Known.NOT_RUN),
    ("the task queue (Redis) restarted and this call's task was lost; toolq stopped it, and it may or may not "
     "have run", Known.INTERRUPTED),
    (aborted_text(True, 1.5), Known.STOPPED),
    (ToolTimedOut(3.0).message, Known.STOPPED),
    ("call stopped: the turn's deadline passed while it waited for a max_concurrency permit of t; it was not "
     "run", Known.NOT_RUN),
    ("woke up", None),
    ("Process exited with code 1", None),
])
def test_each_statement_reads_back_as_its_form(output, form):
    assert known_form(output) is form


def test_an_exception_standing_in_for_the_tool_is_caught_and_a_reason_inside_a_statement_is_not():
    assert INFRASTRUCTURE_TEXT.search("tool exec_command failed: ConnectionError: Error 111 connecting to "
                                      "127.0.0.1:6379. Connection refused.")
    assert INFRASTRUCTURE_TEXT.search("tool count_tags failed: TimeoutError: Timeout reading from socket")
    assert not INFRASTRUCTURE_TEXT.search(not_run("t", "the worker lost Redis as it started the call (Error 111 "
                                                       "connecting to 127.0.0.1:6379. Connection refused.)"))
    assert not INFRASTRUCTURE_TEXT.search("tool t failed: ValueError: the tool's own bug")
