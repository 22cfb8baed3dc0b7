"""Where a session-routed call (`ToolSpec.route == "session"`: write_stdin) goes: to the one
worker instance that holds the session its `session_id` argument names.

The session's record (written by that worker's session host, toolq/core/session_records.py)
names the instance; its own queue `toolq.w.<instance>` is consumed by it alone. An unknown id,
or an instance gone from the fleet catalog (its record expires within `presence.TTL` seconds of a
crash), is answered here with the model-visible text, without queueing anything.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from toolq.core import keys
from toolq.core.calls import FunctionPayload, ToolInvocation
from toolq.core.catalog import ToolSpec
from toolq.core.session_records import SessionRecord, lost_session, sessions_key, unknown_session
from toolq.core.states import CallState
from toolq.orchestrator.transport import DispatchError


def unknown(session_id: object, spec: ToolSpec) -> DispatchError:
    """The call's session is not its conversation's: its declaration's answer, or write_stdin's words."""
    return DispatchError("unknown session", state=CallState.FAILED,
                         output=spec.session_gone or unknown_session(session_id))


async def session_for(r, inv: ToolInvocation, spec: ToolSpec) -> SessionRecord:
    """The record of the call's session (its instance's queue is `instance_queue(record.instance)`);
    DispatchError (with the output) if none."""
    try:
        assert isinstance(inv.payload, FunctionPayload)
        session_id = int(json.loads(inv.payload.arguments)["session_id"])
    except (AssertionError, ValueError, KeyError, TypeError, OverflowError):  # 1e400 parses as inf
        raise unknown("?", spec) from None
    raw = await r.hget(sessions_key(inv.conversation or ""), str(session_id)) if inv.conversation else None
    if raw is None:
        raise unknown(session_id, spec)
    try:
        record = SessionRecord.model_validate_json(raw)
    except ValidationError:
        raise unknown(session_id, spec) from None
    if not await r.exists(keys.fleet_worker(record.instance)):
        await r.hdel(sessions_key(inv.conversation or ""), str(session_id))
        raise DispatchError("session lost", state=CallState.FAILED,
                            output=spec.session_gone or lost_session(record))
    return record


async def live_sessions(r, conversation: str) -> list[SessionRecord]:
    """The conversation's live sessions, for `toolq status`."""
    records = []
    for raw in (await r.hgetall(sessions_key(conversation))).values():
        try:
            records.append(SessionRecord.model_validate_json(raw))
        except ValidationError:
            continue
    return sorted(records, key=lambda s: s.session_id)
