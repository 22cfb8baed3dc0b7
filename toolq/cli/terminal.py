"""What may reach a terminal of what the model, a tool or the ledger said.

A model's message, its reasoning, a tool's name, a call id, a failure's reason and a command's
output are all untrusted: an escape sequence in them can clear the screen, move the cursor to
rewrite what was shown, retitle the window or write the clipboard (OSC 52), and a bidi override
can make a line read as something it is not. Every printer of the live view, `toolq status`,
`toolq turns`, `toolq workers` and `toolq batch`'s progress passes its text through `printable`.
JSON lines go through `json_line`: JSON escapes C0 controls itself, but not (unless everything
non-ASCII is escaped) the C1 controls and bidi characters a terminal obeys.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

#: Whole escape sequences (CSI, OSC and other strings ended by BEL or ST, two-byte escapes), the
#: 8-bit CSI/OSC/DCS forms, then what is left of the control characters, DEL, C1 controls and the
#: bidi embeddings, overrides and isolates.
_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x1b\x9d\x90\x9e\x9f\x98]\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                       r"|\x1b[PX^_][^\x1b\x9c]*(?:\x1b\\|\x9c)?|\x9b[0-?]*[ -/]*[@-~]|\x1b[ -/]*[0-~]?")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")
_CONTROL_OR_NEWLINE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def printable(text: str, *, lines: bool = True) -> str:
    """`text` without escape sequences, and each other control character shown as U+FFFD; tabs
    stay, and newlines when `lines` (else they are controls too: a one-line field)."""
    text = _SEQUENCE.sub("", text)
    return (_CONTROL if lines else _CONTROL_OR_NEWLINE).sub("\ufffd", text)


#: What JSON leaves raw that a terminal still obeys: DEL, the C1 controls, bidi characters.
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def json_line(value: Any) -> str:
    """`value` as one line of JSON that is safe on a terminal: non-ASCII text stays readable,
    and the characters a terminal would obey are written as `\\uXXXX` (they only ever occur
    inside strings, so the JSON means the same)."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def human_age(seconds: float) -> str:
    """A duration as a table shows it (a worker's uptime, an environment's age): 45s, 12m, 3.5h, 2.0d."""
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


class _PrintableFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def log_to_stderr(level: int = logging.WARNING) -> None:
    """Log records on stderr as `logger: message`, each through `printable`: a front door logs what
    its client named (a method, a session or process id), and a client may name escape sequences."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrintableFormatter("%(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
