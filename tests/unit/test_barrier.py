"""Which calls of a step may start (contract 9: Codex's read/write lock), and the aborted texts."""

import pytest

from toolq.orchestrator.barrier import startable
from toolq.orchestrator.calls import aborted_text

P, S = False, True


@pytest.mark.parametrize(
    "calls, ready",
    [
        ([("pending", P), ("pending", P)], [0, 1]),  # parallel calls start together
        ([("pending", P), ("pending", S), ("pending", P)], [0]),  # P1 -> S -> P2
        ([("queued", P), ("pending", S), ("pending", P)], []),  # S waits for P1
        ([("done", P), ("pending", S), ("pending", P)], [1]),  # S alone
        ([("done", P), ("running", S), ("pending", P)], []),  # later calls wait for S
        ([("done", P), ("done", S), ("pending", P), ("pending", P)], [2, 3]),
        ([("pending", S), ("pending", S)], [0]),  # serial calls one at a time, in order
        ([("done", S), ("pending", S)], [1]),
        ([], []),
    ],
)
def test_startable_follows_the_read_write_lock(calls, ready):
    assert startable(calls) == ready


def test_aborted_text_for_shell_tools_reads_like_codex():
    assert aborted_text(True, 1.84) == "Wall time: 1.8 seconds\naborted by user"


def test_aborted_text_for_other_tools_and_the_minimum():
    assert aborted_text(False, 12.345) == "aborted by user after 12.3s"
    assert aborted_text(False, 0.0) == "aborted by user after 0.1s"
