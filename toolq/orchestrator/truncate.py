"""Bounded model-visible output: head + tail with Codex's marker (codex-contracts.md §8).

Budgets count UTF-8 bytes (4 bytes per token for token policies); cuts never split a character.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

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
