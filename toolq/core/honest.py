"""What toolq says when a call's output is not the tool's own result.

An output is either the tool's own result or toolq's statement of what it knows, in one of three
forms, each with its reason:

- not run: toolq is sure the tool never started;
- interrupted: it may have run, partly or fully, and what was lost (and where) is said;
- stopped by toolq: a timeout, a cancel or a limit ended it (`aborted_text`, `ToolTimedOut`, and
  the "call stopped: ..." outputs).

An exception raised by toolq's own infrastructure (Redis, the session host, the MCP host) never
stands in for the tool's failure: it becomes one of the first two forms. `known_form` reads an
output back, for the fault campaign and the tests.
"""

from __future__ import annotations

import re
from enum import Enum


class Known(str, Enum):
    NOT_RUN = "not run"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped by toolq"


#: The sentence an interrupted call's output ends with.
MAY_HAVE_RUN = "it may have run, partly or fully"


def not_run(tool: object, why: str) -> str:
    return f"{tool} was not run: {why}"


def interrupted(tool: object, what: str) -> str:
    """`what`: what was lost and where, e.g. "the worker lost Redis while the call ran"."""
    return f"{tool} was interrupted and its outcome is unknown: {what}; {MAY_HAVE_RUN}"


class InfrastructureLost(Exception):
    """Raised inside a tool's handler by toolq's own plumbing (the session host's socket, the MCP
    host's) when it lost the call: the worker answers `interrupted(tool, what)`, not "failed"."""

    def __init__(self, what: str, *, started: bool = True) -> None:
        super().__init__(what)
        self.what = what
        self.started = started
        """False when toolq is sure the tool never started (the host refused the connection before
        the request was sent): the output says "not run"."""


_FORMS = (
    (Known.NOT_RUN, re.compile(r"\bwas not run\b|\bnot run\b|\bnot run again\b|did not run")),
    (Known.INTERRUPTED, re.compile(r"outcome is unknown|may (or may not )?have (partially executed|partly run|run)")),
    (Known.STOPPED, re.compile(r"aborted by user|call timed out|timed out after|call stopped|cancelled")),
)


def known_form(output: str) -> Known | None:
    """Which of toolq's statements an output is, if it is one."""
    for form, pattern in _FORMS:
        if pattern.search(output):
            return form
    return None


def honest(output: str, own: str) -> bool:
    """Whether an output is the tool's own result (`own` is in it) or one of toolq's statements,
    and never an infrastructure exception standing in for the tool (what fault tests assert)."""
    return not INFRASTRUCTURE_TEXT.search(output) and (own in output or known_form(output) is not None)


#: The text of an infrastructure exception standing in for a tool's output: what no output may be.
INFRASTRUCTURE_TEXT = re.compile(
    r"failed: (ConnectionError|TimeoutError|BusyLoadingError|ReadOnlyError|RedisError|"
    r"ConnectionRefusedError|ConnectionResetError|BrokenPipeError|OSError)\b"
)
