"""The command line's exit statuses for a turn (`toolq run`, `toolq resume`, `toolq batch`): how a
turn ended is the library's (`TurnOutcome.status`); what a shell sees of it is the CLI's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolq.orchestrator.turn import TurnOutcome

EXIT_FAILED = 1
#: Nothing ran (bad settings, Redis unreachable at the start, a model endpoint nothing listens on).
EXIT_UNSTARTED = 2
#: Ctrl-C, SIGTERM, SIGHUP or `toolq cancel`: the shell's 128 + SIGINT.
EXIT_CANCELLED = 130
EXIT_CODES = {"completed": 0, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}


def exit_status(outcome: TurnOutcome) -> int:
    """0 completed, 1 failed, 130 cancelled; 2 when the turn could not start."""
    if outcome.could_not_start or outcome.model_unreachable:
        return EXIT_UNSTARTED
    return EXIT_CODES.get(outcome.status, EXIT_FAILED)
