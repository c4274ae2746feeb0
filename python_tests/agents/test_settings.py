"""rollout.multi_turn's keys: checked at config validation, each error naming its key."""

from pathlib import Path

import pytest

from verl_fast import config
from verl_fast.agents.settings import parse

TOOL = "examples/tool_calling/tools.py:calculator"


@pytest.fixture(autouse=True)
def at_the_repository_root(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the example's tool is named from there


def cfg(**multi_turn):
    return config.from_dict({"rollout": {"multi_turn": multi_turn}})


def test_the_section_parses_with_its_defaults():
    mt = parse(cfg(tools=[TOOL], max_turns=3).rollout)
    assert (mt.tools, mt.max_turns, mt.environment, mt.tool_format, mt.max_tool_calls) == ([TOOL], 3, "tools", "auto", 8)
    assert parse(config.from_dict({}).rollout) is None


@pytest.mark.parametrize("section, message", [
    ({"turns": 3}, "unknown key rollout.multi_turn.turns"),
    ({"max_turns": 0}, "rollout.multi_turn.max_turns must be >= 1"),
    ({"tool_format": "json"}, "rollout.multi_turn.tool_format must be one of"),
    ({"tool_timeout_s": "soon"}, "rollout.multi_turn.tool_timeout_s must be a number"),
    ({"environment": "gym"}, "rollout.multi_turn.environment must be one of"),
    ({"tools": ["examples/tool_calling/nope.py:calculator"]}, r"rollout.multi_turn.tools\[0\]: tool .*no file"),
    ({"tools": ["verl_fast.agents.tools:load_tool"]}, r"rollout.multi_turn.tools\[0\]: tool 'load_tool': no JSON schema"),
    ({"tools": "calculator"}, "rollout.multi_turn.tools must be a list"),
])
def test_bad_values_name_their_key(section, message):
    with pytest.raises(ValueError, match=message):
        cfg(**section)


def test_dpo_samples_nothing():
    with pytest.raises(ValueError, match="rollout.multi_turn is not supported with algorithm.type=dpo"):
        config.from_dict({"algorithm": {"type": "dpo"}, "rollout": {"multi_turn": {"tools": [TOOL]}}})
