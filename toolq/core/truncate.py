"""Bounded model-visible output: head + tail with Codex's marker (docs/reference/codex-behaviour.md#truncation).

Budgets count UTF-8 bytes (4 bytes per token for token policies); cuts never split a character.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

APPROX_BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class TruncationPolicy:
    mode: Literal["bytes", "tokens"]
    limit: int

    @classmethod
    def tokens(cls, n: int) -> TruncationPolicy:
        return cls("tokens", n)

    @classmethod
    def bytes(cls, n: int) -> TruncationPolicy:
        return cls("bytes", n)

    @property
    def byte_budget(self) -> int:
        return self.limit * APPROX_BYTES_PER_TOKEN if self.mode == "tokens" else self.limit

    def scaled(self, factor: float) -> TruncationPolicy:
        return TruncationPolicy(self.mode, math.ceil(self.limit * factor))


#: Codex's default for gpt-5.x models.
DEFAULT_POLICY = TruncationPolicy.tokens(10_000)
#: What a tool's output may be in history: the policy * 1.2, so formatted tool output (exec_command
#: cuts its own to `max_output_tokens`) is not cut twice. Workers cut every output to it before it
#: travels (`bound_output`), and the orchestrator again on arrival, for outputs it makes itself.
HISTORY_POLICY = DEFAULT_POLICY.scaled(1.2)


def approx_token_count(text: str) -> int:
    return math.ceil(len(text.encode()) / APPROX_BYTES_PER_TOKEN)


def _head(data: bytes, n: int) -> bytes:
    """The longest prefix of at most n bytes that ends on a character boundary."""
    if n >= len(data):
        return data
    while n > 0 and (data[n] & 0xC0) == 0x80:  # data[n] continues a character: cut before it
        n -= 1
    return data[:n]


def _tail(data: bytes, n: int) -> bytes:
    """The longest suffix of at most n bytes that starts on a character boundary."""
    if n >= len(data):
        return data
    start = len(data) - n
    while start < len(data) and (data[start] & 0xC0) == 0x80:
        start += 1
    return data[start:]


def truncate_text(text: str, policy: TruncationPolicy) -> str:
    """Keep the head and tail (budget split 50/50) and say how much was cut between them."""
    data = text.encode()
    budget = policy.byte_budget
    if len(data) <= budget:
        return text
    left = budget // 2
    head, tail = _head(data, left), _tail(data, budget - left)
    removed = data[len(head) : len(data) - len(tail)]
    if policy.mode == "tokens":
        marker = f"…{math.ceil(len(removed) / APPROX_BYTES_PER_TOKEN)} tokens truncated…"
    else:
        marker = f"…{len(removed.decode(errors='replace'))} chars truncated…"
    return head.decode() + marker + tail.decode()


def formatted_truncate_text(text: str, policy: TruncationPolicy) -> str:
    """`truncate_text` with Codex's line-count header when anything was cut."""
    if len(text.encode()) <= policy.byte_budget:
        return text
    total_lines = len(text.splitlines())
    return f"Total output lines: {total_lines}\n\n" + truncate_text(text, policy)


#: A cut text is its budget plus the marker: a text within this much over the budget is left as
#: it is, so the orchestrator's cut after the worker's changes nothing.
MARKER_SLACK = 64


def bound_text(text: str, policy: TruncationPolicy = HISTORY_POLICY) -> str:
    """`truncate_text`, unless `text` is within `MARKER_SLACK` of the budget: idempotent, so the
    worker and the orchestrator can both apply it."""
    limit = policy.byte_budget + MARKER_SLACK
    if len(text) * 4 <= limit or len(text.encode()) <= limit:  # the first test spares encoding short texts
        return text
    return truncate_text(text, policy)


def bound_output(body: Any, policy: TruncationPolicy = HISTORY_POLICY) -> Any:
    """A tool's output (a string, or a list of content parts as models or dicts) with every text
    bounded by `bound_text`; anything else unchanged. Workers return it so, and a 10 MB output
    never travels whole through Redis to be cut on arrival."""
    if isinstance(body, str):
        return bound_text(body, policy)
    if isinstance(body, list):
        return [_bound_part(part, policy) for part in body]
    return body


def _bound_part(part: Any, policy: TruncationPolicy) -> Any:
    if isinstance(part, dict):
        text = part.get("text")
        return {**part, "text": bound_text(text, policy)} if isinstance(text, str) else part
    text = getattr(part, "text", None)
    if isinstance(text, str) and hasattr(part, "model_copy"):
        return part.model_copy(update={"text": bound_text(text, policy)})
    return part
