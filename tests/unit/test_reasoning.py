"""Which models get reasoning settings by default (toolq/core/reasoning.py)."""

from __future__ import annotations

import pytest

from toolq.core.errors import ConfigurationError
from toolq.core.reasoning import is_reasoning_model, reasoning_for
from toolq.core.settings import Settings


@pytest.mark.parametrize("model", ["gpt-5", "gpt-5.5", "gpt-5-mini", "gpt-5.1-codex", "o1", "o3", "o3-pro",
                                   "o4-mini", "openai/gpt-5", "GPT-5"])
def test_gpt5_and_o_series_models_reason(model):
    assert is_reasoning_model(model)


@pytest.mark.parametrize("model", ["gpt-5-chat-latest", "gpt-4o", "gpt-4.1", "gpt-oss-20b", "omni", "ollama",
                                   "gpt-50", "o", "llama3.1", "gpt-test"])
def test_other_models_do_not(model):
    assert not is_reasoning_model(model)


def test_auto_is_the_default_and_turns_reasoning_on_only_for_reasoning_models():
    setting = Settings.load({}).reasoning_effort
    assert setting == "auto"
    assert reasoning_for("gpt-5.5", setting) == {"effort": "medium"}
    assert reasoning_for("gpt-4.1", setting) is None


def test_off_sends_nothing_and_an_effort_is_sent_to_any_model():
    assert reasoning_for("gpt-5.5", "off") is None
    assert reasoning_for("gpt-oss-20b", "low") == {"effort": "low"}
    assert reasoning_for("gpt-5.1", "none") == {"effort": "none"}


def test_an_unknown_effort_is_one_line_naming_the_variable():
    with pytest.raises(ConfigurationError, match=r"^invalid setting reasoning_effort \(TOOLQ_REASONING_EFFORT\): "
                                                 r"Input should be 'auto', 'off', 'none'"):
        Settings.load({"TOOLQ_REASONING_EFFORT": "hard"})
