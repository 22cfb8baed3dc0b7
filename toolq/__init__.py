"""toolq: run an LLM agent's tool calls on a Celery fleet (Responses API in, paired outputs back).

Public names, for whoever uses them (like `temporalio.activity` / `temporalio.client`):

- tool authors: `tool`, `ToolContext`, `ToolReturn`, `RespondToModel`;
- callers with their own agent loop: `Fleet` (`tool_specs()`, `run_calls(items)`);
- the whole loop, as `toolq run` runs it: `Session` on a `Runtime`, with typed events
  (`TurnEvent`, `ToolCallView`, `CallState`); `Settings` for configuration;
- workspaces on the fleet: `Environment` (`Fleet.environment(...)`), each turn's `TurnDiff`;
- users' own tests: `toolq.testing` (the fake model, one call in-process).

Imports are lazy: `from toolq import tool` loads neither Celery nor the built-in tools.
"""

from __future__ import annotations

import sys

if sys.argv[:1] == ["-m"]:  # `python -m toolq...`: before any import the current directory could answer
    from toolq.core import import_path

    if import_path.started_as_module():
        import_path.isolate()

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "tool": "toolq.core.catalog",
    "ToolContext": "toolq.core.catalog",
    "ToolReturn": "toolq.core.catalog",
    "RespondToModel": "toolq.core.errors",
    "Settings": "toolq.core.settings",
    "Fleet": "toolq.orchestrator.fleet",
    "Session": "toolq.orchestrator.turn",
    "Runtime": "toolq.orchestrator.turn",
    "TurnOutcome": "toolq.orchestrator.turn",
    "CallState": "toolq.core.states",
    "TurnEvent": "toolq.orchestrator.turn_events",
    "ToolCallView": "toolq.orchestrator.turn_events",
    "Environment": "toolq.orchestrator.environments",
    "TurnDiff": "toolq.core.environments",
}

__all__ = ["CallState", "Environment", "Fleet", "RespondToModel", "Runtime", "Session", "Settings", "ToolCallView",
           "ToolContext", "ToolReturn", "TurnDiff", "TurnEvent", "TurnOutcome", "tool"]

if TYPE_CHECKING:
    from toolq.core.catalog import ToolContext, ToolReturn, tool
    from toolq.core.environments import TurnDiff
    from toolq.core.errors import RespondToModel
    from toolq.core.settings import Settings
    from toolq.core.states import CallState
    from toolq.orchestrator.environments import Environment
    from toolq.orchestrator.fleet import Fleet
    from toolq.orchestrator.turn import Runtime, Session, TurnOutcome
    from toolq.orchestrator.turn_events import ToolCallView, TurnEvent


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'toolq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
