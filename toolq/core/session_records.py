"""Where the fleet records live sessions (Redis), shared by the host, pool children and the orchestrator.

`toolq:conv:<id>` exists while a conversation lives (the orchestrator refreshes its TTL);
`toolq:sessions:<id>` maps each live session id of that conversation to the worker instance that
holds it; `toolq:sessions:<id>:next` hands out session ids, unique per conversation across the fleet.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from toolq.core.keys import PREFIX

#: How long a conversation key outlives the orchestrator's last refresh.
CONVERSATION_TTL = 8
CONVERSATION_BEAT = 2.0


def conversation_key(conversation: str) -> str:
    return f"{PREFIX}:conv:{conversation}"


def sessions_key(conversation: str) -> str:
    return f"{PREFIX}:sessions:{conversation}"


def next_id_key(conversation: str) -> str:
    return f"{PREFIX}:sessions:{conversation}:next"


def instance_queue(instance: str) -> str:
    """The queue only this worker instance consumes (`write_stdin` for the sessions it holds)."""
    return f"toolq.w.{instance}"


def unknown_session(session_id: object) -> str:
    """What a write to a session its conversation does not hold is told (Codex's words)."""
    return f"write_stdin failed: Unknown process id {session_id}"


def lost_session(record: SessionRecord) -> str:
    """What a write to a session whose worker is gone is told."""
    return (f"write_stdin failed: session {record.session_id} was lost with its worker {record.hostname} "
            f"(the worker is gone; `{record.command[:80]}` is no longer running); start it again with exec_command")


class SessionRecord(BaseModel):
    session_id: int
    instance: str
    hostname: str
    command: str
    started_at: float
    tty: bool = False
    shell: str = "bash"
    """What runs `command` (`shell -c command`), for the command line a write_stdin's item shows."""

    @classmethod
    def new(cls, session_id: int, instance: str, hostname: str, command: str, tty: bool,
            shell: str = "bash") -> SessionRecord:
        return cls(session_id=session_id, instance=instance, hostname=hostname, command=command[:300],
                   started_at=time.time(), tty=tty, shell=shell)
