"""Fleet-wide limits of a tool, as declared and as settings override them (pure: no Redis).

A tool declares `@tool(max_concurrency=2, rate_limit="10/s")`; `TOOLQ_TOOL_LIMITS` (JSON, one
object per tool name) overrides a declared limit or sets one for a tool toolq did not declare
(built-ins, MCP tools): `{"exec_command": {"max_concurrency": 8}, "git.git_log": {"rate_limit":
"100/m"}}`; a `null` removes a declared limit. Limits are policy, not interface: they are not
part of a declaration's digest, so changing one never reroutes a call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_serializer, model_validator

from toolq.core.errors import problems

_RATE = re.compile(r"\s*(\d+)\s*/\s*(s|sec|second|m|min|minute)\s*")
_WINDOW = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0}


class Rate(BaseModel):
    """At most `calls` starts in any window of `window` seconds, across the fleet."""

    model_config = ConfigDict(frozen=True)

    calls: int = Field(ge=1)
    window: float = Field(gt=0)

    @classmethod
    def parse(cls, text: str) -> Rate:
        m = _RATE.fullmatch(text)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"rate_limit {text!r} is not N/s or N/m (calls per second or minute, N >= 1)")
        return cls(calls=int(m.group(1)), window=_WINDOW[m.group(2)])

    def __str__(self) -> str:
        return f"{self.calls}/{'s' if self.window == 1 else 'm'}"


class ToolLimit(BaseModel):
    """One tool's limits; None: unlimited."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrency: int | None = Field(default=None, ge=1)
    """Calls of this tool running at once across the fleet."""
    rate_limit: Rate | None = None
    """Calls of this tool started per second or minute across the fleet (`"10/s"`, `"100/m"`)."""

    @model_validator(mode="before")
    @classmethod
    def _rate_text(cls, v: Any) -> Any:
        rate = v.get("rate_limit") if isinstance(v, dict) else None
        if isinstance(rate, str):
            return {**v, "rate_limit": Rate.parse(rate)}
        if rate is not None and not isinstance(rate, (Rate, dict)):
            raise ValueError(f"rate_limit {rate!r} is not N/s or N/m (a string such as \"10/s\" or \"100/m\")")
        return v

    @field_serializer("rate_limit")
    def _rate_as_text(self, rate: Rate | None) -> str | None:
        return None if rate is None else str(rate)  # as it is written: `toolq config` shows "10/s"

    @property
    def limited(self) -> bool:
        return self.max_concurrency is not None or self.rate_limit is not None

    def over(self, override: ToolLimit | None) -> ToolLimit:
        """This declared limit with the settings' override applied: each field given there wins."""
        if override is None:
            return self
        return self.model_copy(update={k: getattr(override, k) for k in override.model_fields_set})

    def describe(self) -> str:
        parts = [f"max_concurrency={self.max_concurrency}"] if self.max_concurrency else []
        return ", ".join(parts + ([f"rate_limit={self.rate_limit}"] if self.rate_limit else [])) or "none"


UNLIMITED = ToolLimit()

_LIMITS = TypeAdapter(dict[str, ToolLimit])


def parse_tool_limits(value: Any) -> dict[str, ToolLimit]:
    """`TOOLQ_TOOL_LIMITS` (a JSON object, or the dict itself) as limits by tool name; one
    `ValueError` line naming the tool and the field when a value is wrong."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f'not JSON ({e.msg}); e.g. {{"exec_command": {{"max_concurrency": 4}}}}') from None
    if not isinstance(value, dict):
        raise ValueError('must be a JSON object of tool name -> {"max_concurrency": N, "rate_limit": "N/s"}')
    try:
        return _LIMITS.validate_python(value)
    except ValidationError as e:
        where, message, _ = problems(e)[0]
        raise ValueError(f"{where}: {message}") from None


def declared_limit(max_concurrency: int | None, rate_limit: str | Rate | None) -> ToolLimit:
    """A `@tool(max_concurrency=..., rate_limit=...)` declaration as a `ToolLimit` (raises ValueError)."""
    return ToolLimit.model_validate({"max_concurrency": max_concurrency, "rate_limit": rate_limit})
