"""Agents: tools (typed Python functions run in worker processes), environments (reset / step) and
multi-turn rollouts on the run's engine, trained on the model's own tokens only. See docs/agents.md.

The names below load on first use: the config's validation imports ``agents.settings`` alone, and
must not pull the rollout (torch, transformers) in with it."""

import importlib

_NAMES = {
    "Environment": "environments", "ReasoningGymEnvironment": "environments", "SingleTurnEnvironment": "environments",
    "StepResult": "environments", "ToolEnvironment": "environments", "ToolCall": "parsing",
    "parse_tool_calls": "parsing", "MultiTurnRolloutOperator": "rollout", "build_operator": "rollout",
    "ToolExecutor": "tools", "ToolResult": "tools", "tool_schema": "tools",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'verl_fast.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(f"verl_fast.agents.{_NAMES[name]}"), name)
