"""Where a write_stdin goes: the model's session_id is parsed before any Redis read."""

import asyncio

import pytest

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import ToolSpec
from toolq.orchestrator.transport import DispatchError
from toolq.orchestrator.transport.session_route import session_for


@pytest.mark.parametrize("arguments", ['{"session_id": 1e400}', '{"session_id": "x"}', '{}', "[1]", "{"])
def test_a_session_id_that_is_no_integer_is_an_unknown_session_not_a_crash(arguments):
    """A red-team helper's 1e400 (inf) raised OverflowError past the route: the ledger kept the call queued."""
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName.plain("write_stdin"),
                         payload=FunctionPayload(arguments=arguments), deadline=0.0, conversation="conv")
    with pytest.raises(DispatchError) as e:
        asyncio.run(session_for(None, inv, ToolSpec(name="write_stdin", route="session")))  # no Redis needed
    assert e.value.output == "write_stdin failed: Unknown process id ?"


def test_a_declaration_that_names_its_answer_for_a_gone_session_gets_it_not_write_stdins_words():
    """A front door's process_write answers in its own JSON, as its worker would: read from its
    declaration (`session_gone`), never from its name."""
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName.plain("any_name"),
                         payload=FunctionPayload(arguments='{"session_id": 3}'), deadline=0.0, conversation=None)
    spec = ToolSpec(name="any_name", route="session", session_gone='{"status": "unknownProcess"}')
    with pytest.raises(DispatchError) as e:
        asyncio.run(session_for(None, inv, spec))  # no conversation: no Redis read
    assert e.value.output == '{"status": "unknownProcess"}'
