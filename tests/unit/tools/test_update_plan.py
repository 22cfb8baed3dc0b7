"""update_plan: acknowledges a well-formed plan; a malformed one is a parse error."""

from __future__ import annotations

import json

import pytest

from tests.unit.tools import call
from toolq.core.errors import RespondToModel
from toolq.workers.tools.update_plan import update_plan

PLAN = [{"step": "read the code", "status": "completed"}, {"step": "fix it", "status": "in_progress"}]


def test_plan_is_acknowledged(tmp_path):
    assert call(update_plan, tmp_path, json.dumps({"explanation": "started", "plan": PLAN})) == "Plan updated"
    assert call(update_plan, tmp_path, json.dumps({"explanation": None, "plan": []})) == "Plan updated"


def test_unknown_status_is_a_parse_error(tmp_path):
    with pytest.raises(RespondToModel, match=r"^failed to parse function arguments: invalid value for `plan.0.status`"):
        call(update_plan, tmp_path, json.dumps({"plan": [{"step": "x", "status": "done"}]}))


def test_missing_plan_is_a_parse_error(tmp_path):
    with pytest.raises(RespondToModel, match="missing field `plan`"):
        call(update_plan, tmp_path, json.dumps({"explanation": "x"}))


def test_spec_is_serial_with_a_status_enum():
    spec = update_plan.tool_spec
    assert spec.parallel is False
    params = spec.model_spec()["parameters"]
    item = params["$defs"]["PlanItem"]
    assert item["properties"]["status"]["enum"] == ["pending", "in_progress", "completed"]
    assert set(params["required"]) == {"explanation", "plan"}  # strict: optional keys are nullable
