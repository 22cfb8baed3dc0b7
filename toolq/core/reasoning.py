"""Which models reason, and the `reasoning` field their requests carry.

toolq's requests are stateless (`store: false`), so a reasoning item can only be sent back with
its `encrypted_content`, which the API returns only when asked (`include`). A reasoning model
reasons whether or not the request says so, hence the default `auto`: reasoning settings (and the
`include` that goes with them, `client.build_request`) for the models the API documents as
reasoning models, as Codex does for its models (`reasoning: {effort: "medium"}`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ReasoningSetting = Literal["auto", "off", "none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""`TOOLQ_REASONING_EFFORT`: an effort to send; `auto`: `DEFAULT_EFFORT` for reasoning models and
no `reasoning` field for others; `off`: never a `reasoning` field (servers that refuse one)."""

#: Codex's effort for gpt-5.5, and the API's default.
DEFAULT_EFFORT: Effort = "medium"

# The API's `Reasoning` schema: "gpt-5 and o-series models only". Their chat variants
# (gpt-5-chat-latest) take no reasoning settings.
_REASONING_MODEL = re.compile(r"(gpt-5|o[1-9])($|[-.])")


def is_reasoning_model(model: str) -> bool:
    """gpt-5, gpt-5.5, gpt-5-mini, o1, o3, o4-mini...; a `provider/` prefix is ignored."""
    name = model.rsplit("/", 1)[-1].lower()
    return _REASONING_MODEL.match(name) is not None and "-chat" not in name


def reasoning_for(model: str, setting: ReasoningSetting) -> dict[str, Any] | None:
    """The request's `reasoning` field for `model` under the setting (None: leave it out)."""
    if setting == "off":
        return None
    if setting == "auto":
        return {"effort": DEFAULT_EFFORT} if is_reasoning_model(model) else None
    return {"effort": setting}
