"""A tool whose output is not valid Unicode, as a plain `os.listdir` gives it for a non-UTF-8 name.

Loaded by the workers of `test_hostile_inputs.py` only (queue `hostile`), beside the test tools.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from toolq.core.catalog import ToolContext, tool

QUEUE = "hostile"
NAME = b"caf\xe9-latin1.txt"
"""A Latin-1 file name: not UTF-8, so Python reads it back as `caf\\udce9-latin1.txt`."""


class NoArgs(BaseModel):
    pass


@tool(queue=QUEUE)
def list_raw_names(args: NoArgs, ctx: ToolContext) -> str:
    """Create a file with a Latin-1 name in the workspace and list the workspace with os.listdir."""
    with open(os.fsencode(ctx.workspace) + b"/" + NAME, "wb"):
        pass
    return "\n".join(sorted(os.listdir(ctx.workspace)))
