"""Agents: tools (typed Python functions run in worker processes), environments (reset / step) and
multi-turn rollouts on the run's engine, trained on the model's own tokens only. See docs/agents.md."""

from verl_fast.agents.environments import (Environment, ReasoningGymEnvironment, SingleTurnEnvironment, StepResult,
                                           ToolEnvironment)
from verl_fast.agents.parsing import ToolCall, parse_tool_calls
from verl_fast.agents.rollout import MultiTurnRolloutOperator, build_operator
from verl_fast.agents.tools import ToolExecutor, ToolResult, tool_schema

__all__ = ["Environment", "MultiTurnRolloutOperator", "ReasoningGymEnvironment", "SingleTurnEnvironment", "StepResult",
           "ToolCall", "ToolEnvironment", "ToolExecutor", "ToolResult", "build_operator", "parse_tool_calls",
           "tool_schema"]
