"""What both sides share (`toolq.core.contracts`): a failed call's exception, as Flower shows it."""

from toolq.core.contracts import TASK, TASK_IDEMPOTENT, ToolCallFailed, task_name


def test_a_failed_calls_exception_names_its_state_and_exit_code_but_never_its_output():
    exc = ToolCallFailed({"status": "failed", "exit_code": 3, "output": "password=hunter2"})
    assert repr(exc) == str(exc) == "ToolCallFailed(failed, exit code 3)"
    assert str(ToolCallFailed({"status": "rejected", "output": "secret"})) == "ToolCallFailed(rejected)"


def test_only_idempotent_tools_go_to_the_redelivering_task():
    assert (task_name(False), task_name(True)) == (TASK, TASK_IDEMPOTENT)
