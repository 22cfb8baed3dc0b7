"""`update_plan`: the model records its plan; toolq only acknowledges it (Codex's `plan.rs`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from toolq.core.catalog import ToolContext, tool


class PlanItem(BaseModel):
    step: str
    status: Literal["pending", "in_progress", "completed"] = Field(
        description="One of: pending, in_progress, completed"
    )


class UpdatePlanArgs(BaseModel):
    explanation: str | None = None
    plan: list[PlanItem] = Field(description="The list of steps")


@tool(parallel=False, view="todo_list")
def update_plan(args: UpdatePlanArgs, ctx: ToolContext) -> str:
    """Records the plan for the current task: an optional explanation and the list of steps, each
    pending, in_progress or completed. Keep at most one step in_progress."""
    return "Plan updated"
