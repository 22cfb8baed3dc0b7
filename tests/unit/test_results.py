"""Celery's result format in, typed outcomes out (`results.outcome_from_meta`): the barrier never
reads a meta."""

from toolq.core.calls import ToolResult
from toolq.core.states import CallState
from toolq.orchestrator.transport.results import outcome_from_meta

FAILED = ToolResult(call_id="call_1", output="Process exited with code 3", status=CallState.FAILED, success=False,
                    exit_code=3).model_dump(mode="json")


def test_a_success_carries_the_workers_result():
    done = ToolResult(call_id="call_1", output="ok").model_dump(mode="json")
    outcome = outcome_from_meta({"status": "SUCCESS", "result": done})
    assert outcome.state is CallState.COMPLETED and outcome.result.output == "ok"


def test_a_tool_call_failed_failure_carries_the_result_unchanged():
    meta = {"status": "FAILURE", "result": {"exc_type": "ToolCallFailed", "exc_message": [FAILED],
                                            "exc_module": "toolq.core.contracts"}}
    outcome = outcome_from_meta(meta)
    assert outcome.state is CallState.FAILED
    assert outcome.result.model_dump(mode="json") == FAILED  # what the model reads is the worker's output


def test_celerys_own_failures_and_a_revoke_have_no_result_but_a_reason():
    lost = outcome_from_meta({"status": "FAILURE", "result": {"exc_type": "WorkerLostError",
                                                              "exc_message": ["Worker exited prematurely"]}})
    assert (lost.state, lost.result) == (CallState.LOST, None)
    assert lost.reason == ("the worker process running this call died (Worker exited prematurely); "
                           "the call may have partially executed")
    killed = outcome_from_meta({"status": "FAILURE", "result": {"exc_type": "TimeLimitExceeded",
                                                                "exc_message": ["65.0"]}})
    assert killed.state is CallState.TIMED_OUT
    assert outcome_from_meta({"status": "REVOKED", "result": None}).state is CallState.CANCELLED


def test_a_task_that_expired_in_the_queue_says_it_was_not_run_rather_than_aborted_by_user():
    meta = {"status": "REVOKED", "result": {"exc_type": "TaskRevokedError", "exc_message": ["expired"]}}
    outcome = outcome_from_meta(meta)
    assert outcome.state is CallState.TIMED_OUT
    assert outcome.reason.startswith("call was not run: its deadline passed")
    other = outcome_from_meta({"status": "FAILURE", "result": {"exc_type": "KeyError", "exc_message": ["x"]}})
    assert (other.state, other.reason) == (CallState.FAILED, "call failed on the worker: KeyError: x")
