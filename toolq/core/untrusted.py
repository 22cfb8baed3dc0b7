"""JSON and text from the model, made safe where they enter toolq.

Two kinds of input parse fine in Python and break later, far from where they came in:
- JSON nested deeper than the stack: `json.loads` raises `RecursionError` (not `ValueError`),
  and a few hundred levels that do parse make pydantic's serializer and `json.dumps` (Celery,
  Redis, the next request) fail instead. `MAX_JSON_DEPTH` is serde_json's limit, the one Codex
  parses with, so anything deeper is refused here as it is there.
- Lone surrogates (`"\\ud800"` is valid JSON, but not valid Unicode): every later `.encode()`
  raises `UnicodeEncodeError`: a request body, a Celery message, a file path, the terminal.
  Non-UTF-8 file names read with `os.listdir` come back the same way (`surrogateescape`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: serde_json's default recursion limit (Codex parses SSE frames and arguments with serde_json).
MAX_JSON_DEPTH = 128

_SURROGATE = re.compile("[\ud800-\udfff]")
# A frame can only hold a lone surrogate as a raw one or as a `\uD8xx`-`\uDFxx` escape.
_MAY_HOLD_SURROGATE = re.compile(r"\\u[dD][89abcdefABCDEF]|[\ud800-\udfff]")


class TooDeep(ValueError):
    def __init__(self) -> None:
        super().__init__(f"nesting too deep (more than {MAX_JSON_DEPTH} levels)")


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number out of range: {text[:40]}")
    return number


def loads(text: str) -> Any:
    """`json.loads` that raises only `ValueError`: `TooDeep` past `MAX_JSON_DEPTH` levels, and
    `NaN`, `Infinity` or a number too large for a double (`1e400`) refused, as serde_json refuses
    them (Python takes them, and they reached the tools: an OverflowError, a session host that
    hung up)."""
    # Depth can only pass the limit if the text has that many brackets: counting them is C speed,
    # so the walk below runs only for big documents.
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    try:
        obj = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise TooDeep() from None
    if deep and _depth_exceeds(obj, MAX_JSON_DEPTH):
        raise TooDeep()
    return obj


def may_hold_surrogate(text: str) -> bool:
    """False when the JSON text cannot decode to a string with a lone surrogate."""
    return _MAY_HOLD_SURROGATE.search(text) is not None


def _depth_exceeds(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def valid_utf8(text: str) -> str:
    """`text` with each lone surrogate (or `surrogateescape`d byte) replaced by U+FFFD."""
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub("\ufffd", text)


def first_surrogate(obj: Any) -> str | None:
    """The first string (key or value) in parsed JSON that holds a lone surrogate, if any."""
    if isinstance(obj, str):
        return obj if _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        for key, value in obj.items():
            found = first_surrogate(key) or first_surrogate(value)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for value in obj:
            found = first_surrogate(value)
            if found is not None:
                return found
    return None


def scrub(obj: Any) -> Any:
    """Parsed JSON (depth already bounded) with every string made `valid_utf8`, keys included."""
    if isinstance(obj, str):
        return valid_utf8(obj)
    if isinstance(obj, dict):
        return {valid_utf8(k) if isinstance(k, str) else k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    return obj


def describe_surrogate(text: str) -> str:
    """`lone surrogate \\ud800 in a string: not valid Unicode`."""
    m = _SURROGATE.search(text)
    code = f"\\u{ord(m.group()):04x}" if m else "?"
    return f"lone surrogate {code} in a string: not valid Unicode"
