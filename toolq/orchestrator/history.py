"""Conversation history and the pairing normaliser (Codex `normalize.rs`:
docs/reference/codex-behaviour.md#history-repair).

Before every request each call must have exactly one output of the matching kind: a call with
none gets `aborted` right after it, an output with no call is dropped. Every repair is logged
and counted, because a repair means something upstream lost an output.

A reasoning item the server cannot read back is dropped too (counted, logged once): requests are
`store: false`, so its id refers to nothing stored, and without `encrypted_content` (or raw
reasoning text, which open-weight servers take back) the real API rejects the whole request.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from toolq.core.items import (
    CustomToolCallOutputItem,
    FunctionCallOutputItem,
    ReasoningItem,
    ResponseItem,
    ToolSearchOutputItem,
    decode_item,
    is_api_item,
)

log = logging.getLogger(__name__)

ABORTED = "aborted"

# call type -> output type that answers it (a local_shell_call is answered by a function_call_output)
_OUTPUT_FOR = {
    "function_call": "function_call_output",
    "custom_tool_call": "custom_tool_call_output",
    "local_shell_call": "function_call_output",
    "tool_search_call": "tool_search_output",
}
_CALLS_FOR: dict[str, set[str]] = defaultdict(set)
for _call, _out in _OUTPUT_FOR.items():
    _CALLS_FOR[_out].add(_call)


def _role(obj: dict[str, Any]) -> tuple[str, str] | None:
    """("call"|"output", pairing key) for a paired item as wire JSON, else None."""
    t = obj.get("type")
    if t in _OUTPUT_FOR:
        call_id = _call_id(obj)
        if t == "tool_search_call" and (obj.get("execution") != "client" or not call_id):
            return None
        # An empty call_id is still a call (its command runs, and its output says ""): taken for
        # none, its output was dropped as an orphan and the call went to the model unanswered.
        return ("call", f"{_OUTPUT_FOR[t]}:{call_id}") if call_id is not None else None
    if t in _CALLS_FOR:
        if t == "tool_search_output" and (obj.get("execution") == "server" or obj.get("call_id") is None):
            return None  # the provider answered its own search
        return "output", f"{t}:{obj.get('call_id')}"
    return None


def _plan(roles: list[tuple[str, str] | None]) -> tuple[set[int], list[int]]:
    """(indexes of orphan outputs to drop, indexes of calls that lack an output), from each
    item's `_role`.

    Keys are (output type, call_id); duplicates pair up by count, since two calls may share a
    call_id (the API allows it and Codex answers both)."""
    calls = Counter(r[1] for r in roles if r and r[0] == "call")
    kept: Counter[str] = Counter()
    orphans: set[int] = set()
    for i, r in enumerate(roles):
        if r and r[0] == "output":
            if kept[r[1]] < calls[r[1]]:
                kept[r[1]] += 1
            else:
                orphans.add(i)
    answered: Counter[str] = Counter()
    missing: list[int] = []
    for i, r in enumerate(roles):
        if r and r[0] == "call":
            if answered[r[1]] < kept[r[1]]:
                answered[r[1]] += 1
            else:
                missing.append(i)
    return orphans, missing


def pairing_problems(input_items: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a request's `input` (empty when every call has exactly one output)."""
    orphans, missing = _plan([_role(o) for o in input_items])
    return [f"call without output: {input_items[i].get('call_id')}" for i in missing] + [
        f"output without call: {input_items[i].get('call_id')}" for i in sorted(orphans)
    ]


def _call_id(call: dict[str, Any]) -> str | None:
    """The id a call's output names: its call_id, or a local shell call's item id when it has none."""
    if call.get("type") == "local_shell_call":
        return call.get("call_id") or call.get("id")
    return call.get("call_id")


def _aborted_output(call: dict[str, Any]) -> ResponseItem:
    if call["type"] == "tool_search_call":
        return ToolSearchOutputItem(call_id=_call_id(call))
    call_id = call["call_id"]  # these items cannot be made without one
    if call["type"] == "custom_tool_call":
        return CustomToolCallOutputItem(call_id=call_id, output=ABORTED)
    return FunctionCallOutputItem(call_id=call_id, output=ABORTED)


def can_replay(item: ResponseItem) -> bool:
    """False for a reasoning item with nothing the server can read it back from."""
    if not isinstance(item, ReasoningItem):
        return True
    return bool(item.encrypted_content) or any(part.get("text") for part in item.content or ())


class History:
    """Items in the order they happened; `for_prompt()` is the next request's `input`.

    Constant work per step: each item is turned into its wire JSON once, when it is recorded, and
    the pairing is tracked as items come (a count of calls and outputs per pairing key), so a step
    whose history is paired costs nothing more however long the history is. Only a repair walks
    the whole history. The wire dicts are shared, not copied: callers must not change them."""

    def __init__(self, items: Iterable[ResponseItem | dict[str, Any]] = ()) -> None:
        self.repairs: Counter[str] = Counter()
        self._said_reasoning_dropped = False
        self._replace([], [])
        self.record(*items)

    @property
    def items(self) -> list[ResponseItem]:
        """A copy: add with `record`, so the wire JSON and the pairing counts stay in step."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def _replace(self, items: list[ResponseItem], wire: list[dict[str, Any]]) -> None:
        self._items: list[ResponseItem] = []
        self._wire: list[dict[str, Any]] = []
        self._roles: list[tuple[str, str] | None] = []
        self._counts: Counter[str] = Counter()
        """Per pairing key: calls minus outputs (0 when paired)."""
        self._unpaired: set[str] = set()
        self._unreplayable = 0
        for item, obj in zip(items, wire, strict=True):
            self._append(item, obj)

    def _append(self, item: ResponseItem, obj: dict[str, Any]) -> None:
        role = _role(obj)
        self._items.append(item)
        self._wire.append(obj)
        self._roles.append(role)
        if role is not None:
            key = role[1]
            self._counts[key] += 1 if role[0] == "call" else -1
            if self._counts[key]:
                self._unpaired.add(key)
            else:
                self._unpaired.discard(key)
        if not can_replay(item):
            self._unreplayable += 1

    def record(self, *items: ResponseItem | dict[str, Any]) -> list[dict[str, Any]]:
        """Append; returns the wire JSON of what was kept (unknown types are kept aside by the
        caller, never replayed)."""
        added: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, dict):
                item = decode_item(item)
            if is_api_item(item):
                obj = item.to_wire()  # the one conversion this item gets
                self._append(item, obj)
                added.append(obj)
        return added

    def normalize(self) -> None:
        """Repair pairing in place, logging and counting each repair."""
        if not self._unpaired:  # every key has as many outputs as calls: nothing to repair
            return
        wire = self._wire
        orphans, missing = _plan(self._roles)
        missing_set = set(missing)
        items: list[ResponseItem] = []
        objs: list[dict[str, Any]] = []
        for i, item in enumerate(self._items):
            if i in orphans:
                self.repairs["orphan_output_dropped"] += 1
                log.warning("dropped an output with no call: call_id=%s", wire[i].get("call_id"))
                continue
            items.append(item)
            objs.append(wire[i])
            if i in missing_set:
                self.repairs["missing_output_aborted"] += 1
                log.warning("call had no output, recorded 'aborted': call_id=%s", wire[i].get("call_id"))
                aborted = _aborted_output(wire[i])
                items.append(aborted)
                objs.append(aborted.to_wire())
        self._replace(items, objs)

    def drop_unreadable_reasoning(self) -> None:
        """Drop reasoning items `can_replay` refuses; counted each time, logged the first time."""
        if not self._unreplayable:
            return
        kept = [(item, obj) for item, obj in zip(self._items, self._wire, strict=True) if can_replay(item)]
        dropped = len(self._items) - len(kept)
        self._replace([item for item, _ in kept], [obj for _, obj in kept])
        self.repairs["reasoning_without_encrypted_content_dropped"] += dropped
        if not self._said_reasoning_dropped:
            self._said_reasoning_dropped = True
            log.warning("dropped %d reasoning item(s) without encrypted_content from the next request: with "
                        "store=false the server cannot resolve them. Set TOOLQ_REASONING_EFFORT (or leave it at "
                        "auto for a gpt-5/o-series model) so toolq asks for reasoning.encrypted_content; later "
                        "drops are counted in History.repairs, not logged", dropped)

    def for_prompt(self) -> list[dict[str, Any]]:
        self.drop_unreadable_reasoning()
        self.normalize()
        return list(self._wire)

    def to_json(self) -> list[dict[str, Any]]:
        return list(self._wire)
