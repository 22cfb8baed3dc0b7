"""The two classes of call errors, named for who must act (Codex's `FunctionCallError`).

`RespondToModel`: the model can fix it; the message becomes that call's output and the turn goes
on. `Fatal`: a runtime contract broke (a registered tool got a payload kind it does not take);
the turn ends with an error naming the tool, and the history still gets a paired output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pydantic import ValidationError


class RespondToModel(Exception):
    """Raise it in a tool to answer the model with `message` (bad input it can fix): the message
    becomes the call's output, the call is marked failed, and the turn goes on."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ToolTimedOut(Exception):
    """Raise it in a tool whose own time limit ran out and whose work was stopped: the call ends
    `timed_out` with the same output as one the pool's time limit stopped."""

    def __init__(self, seconds: float) -> None:
        self.message = f"call timed out after {seconds:g}s and was stopped"
        super().__init__(self.message)
        self.seconds = seconds


class Fatal(Exception):
    """A runtime contract broke (a tool got a payload kind it does not take): the turn ends."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"Fatal error: {self.message}"


class ConfigurationError(Exception):
    """A mistake in how toolq was set up (duplicate tool, bad setting): the developer acts."""


class Problem(NamedTuple):
    """One error of a pydantic validation, as every message of toolq names it."""

    where: str
    """The field's dotted path ('' for the value as a whole)."""
    message: str
    """pydantic's message, less the "Value error, " a validator's own message carries."""
    kind: str
    """pydantic's error type (`missing`, `extra_forbidden`, ...)."""


def problems(e: ValidationError) -> list[Problem]:
    return [Problem(".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, "), err["type"])
            for err in e.errors()]
