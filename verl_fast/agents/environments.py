"""Environments: what answers the model between its turns.

The interface is the shape of verl's interactions and OpenEnv's: one environment per trajectory,
``reset(row)`` gives the first messages (chat messages: ``{"role", "content"}``), then
``step(assistant_message)`` gives the observation messages that follow the model's turn, an optional
reward for that turn (placed on the turn's last token), and whether the episode is over::

    class Guess(Environment):
        def reset(self, row):
            self.target = row.ground_truth
            return [{"role": "user", "content": "Guess my number (1-100)."}]

        def step(self, message):
            guess = int(message["content"].strip() or 0)
            if guess == self.target:
                return StepResult([], reward=1.0, done=True)
            hint = "higher" if guess < self.target else "lower"
            return StepResult([{"role": "user", "content": hint}])

Built in: ``tools`` (``ToolEnvironment``: the observations are the results of the tool calls the
model made; done when it makes none), ``reasoning_gym`` (``ReasoningGymEnvironment``: the model
answers a reasoning-gym question and is told to try again when wrong, reward 1 for the first right
answer) and ``single_turn`` (done after the first turn: a row may ask for it in a multi-turn batch).
Custom ones are named ``module:Class`` (``rollout.multi_turn.environment``), built once per
trajectory with ``rollout.multi_turn.environment_kwargs``. What ``reset`` and ``step`` return is
checked (``checked_reset`` / ``checked_step``): a wrong type is one line naming the environment, the
method and what was wrong, and the messages' text is made valid UTF-8 (lone surrogates replaced).
``agents/guarded.py`` runs them under a time limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from verl_fast.agents.isolation import as_text
from verl_fast.agents.parsing import ToolCall, parse_tool_calls
from verl_fast.agents.tools import ToolExecutor, ToolResult
from verl_fast.data import PromptRow

Message = Dict[str, Any]


@dataclass
class StepResult:
    """What follows a model's turn: observation messages, the turn's reward (None: none), done."""

    messages: List[Message] = field(default_factory=list)
    reward: Optional[float] = None
    done: bool = False


class Environment:
    """One trajectory's environment (see the module docstring)."""

    def reset(self, row: PromptRow) -> List[Message]:
        raise NotImplementedError

    def step(self, message: Message) -> StepResult:
        raise NotImplementedError

    def metrics(self) -> Dict[str, float]:
        """Counts for the step's metrics (summed over trajectories), e.g. ``{"tool_calls": 2}``."""
        return {}


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.80}"


def checked_messages(value: Any, where: str) -> List[Message]:
    """``value`` as chat messages (a list of dicts with a string ``role`` and ``content``, the text
    made valid), or a ValueError that starts with ``where`` and says what is wrong."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must return a list of chat messages ({{'role': ..., 'content': ...}}), "
                         f"got {_shown(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message [{i}] must be a dict with 'role' and 'content', got {_shown(m)}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: message [{i}] needs a string 'role', got {_shown(m)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message [{i}] needs a string 'content', got {_shown(m)}")
        out.append({**m, "content": as_text(m["content"])})
    return out


def checked_reset(value: Any, name: str) -> List[Message]:
    """What environment ``name``'s ``reset`` returned, checked (one message at least)."""
    messages = checked_messages(value, f"environment {name}: reset")
    if not messages:
        raise ValueError(f"environment {name}: reset returned no messages; the first prompt needs one at least")
    return messages


def checked_step(value: Any, name: str) -> StepResult:
    """What environment ``name``'s ``step`` returned, checked: a StepResult with chat messages, a
    finite reward or None, and a bool ``done``."""
    where = f"environment {name}: step"
    if not isinstance(value, StepResult):
        raise ValueError(f"{where} must return a StepResult(messages, reward, done), got {_shown(value)}")
    reward = value.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise ValueError(f"{where}: the reward must be a finite number or None, got {_shown(reward)}")
    if not isinstance(value.done, bool):
        raise ValueError(f"{where}: done must be a bool, got {_shown(value.done)}")
    return StepResult(checked_messages(value.messages, where), reward, value.done)


def row_messages(row: PromptRow, system_prompt: Optional[str] = None) -> List[Message]:
    """The row's prompt as chat messages (its ``prompt`` column), ``system_prompt`` first where it has none."""
    prompt = row.columns.get("prompt", row.prompt_text)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


class SingleTurnEnvironment(Environment):
    """The row's prompt, one answer, done."""

    def __init__(self, system_prompt: Optional[str] = None):
        self.system_prompt = system_prompt

    def reset(self, row: PromptRow) -> List[Message]:
        return row_messages(row, self.system_prompt)

    def step(self, message: Message) -> StepResult:
        return StepResult(done=True)


class ToolEnvironment(Environment):
    """The model calls tools; each call's result comes back as a ``tool`` message. Done when a turn
    makes no call. After ``max_tool_calls`` calls in the trajectory, further calls are answered with
    an error and the episode ends."""

    def __init__(self, executor: ToolExecutor, tool_format: str, max_tool_calls: int,
                 system_prompt: Optional[str] = None):
        self.executor, self.format, self.max_calls = executor, tool_format, max_tool_calls
        self.system_prompt = system_prompt
        self.counts = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "tool_crashes": 0.0,
                       "tool_seconds": 0.0, "tool_calls_refused": 0.0, "tool_calls_malformed": 0.0,
                       "tool_results_truncated": 0.0, "tool_stdout_bytes": 0.0, "tool_stderr_bytes": 0.0,
                       "tool_output_truncated": 0.0}

    def reset(self, row: PromptRow) -> List[Message]:
        return row_messages(row, self.system_prompt)

    def _run(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            self.counts["tool_calls_malformed"] += 1
            return ToolResult(call.error, "error", 0.0)
        result = self.executor.call(call.name, call.arguments)
        limit = self.executor.output_limit
        self.counts["tool_results_truncated"] += result.result_bytes > self.executor.limit
        self.counts["tool_stdout_bytes"] += result.stdout_bytes
        self.counts["tool_stderr_bytes"] += result.stderr_bytes
        self.counts["tool_output_truncated"] += result.stdout_bytes > limit or result.stderr_bytes > limit
        return result

    def step(self, message: Message) -> StepResult:
        calls = parse_tool_calls(message["content"], self.format)
        if not calls:
            return StepResult(done=True)
        out, over = [], False
        for call in calls:
            if self.counts["tool_calls"] >= self.max_calls:
                self.counts["tool_calls_refused"] += 1
                out.append(_tool_message(call, f"tool call limit reached ({self.max_calls} per trajectory)"))
                over = True
                continue
            result = self._run(call)
            self.counts["tool_calls"] += 1
            self.counts["tool_seconds"] += result.seconds
            key = {"error": "tool_errors", "timeout": "tool_timeouts", "crash": "tool_crashes"}.get(result.status)
            if key:
                self.counts[key] += 1
            out.append(_tool_message(call, result.content))
        return StepResult(out, done=over)

    def metrics(self) -> Dict[str, float]:
        return dict(self.counts)


def _tool_message(call: ToolCall, content: str) -> Message:
    return {"role": "tool", "name": call.name or "unknown", "tool_call_id": call.id, "content": content}


class ReasoningGymEnvironment(Environment):
    """A reasoning-gym question, answered in up to ``max_attempts`` turns: a wrong answer (the last
    number of the turn, scored by reasoning-gym's checker, 1.0 only) is told to try again; the first
    right answer ends the episode with reward 1 on its turn."""

    def __init__(self, max_attempts: int = 2, system_prompt: Optional[str] = None,
                 retry_message: str = "That is not right. Try again; answer with just the number."):
        self.max_attempts, self.system_prompt, self.retry = max_attempts, system_prompt, retry_message
        self.attempts = 0

    def reset(self, row: PromptRow) -> List[Message]:
        from verl_fast.rewards.rule import ReasoningGymReward

        entry = row.ground_truth
        if not isinstance(entry, dict):
            raise ValueError("environment reasoning_gym needs the reasoning-gym entry (a dict) as the row's ground "
                             "truth (reward_model.ground_truth; datasets reasoning_gym:<task> have it)")
        self.entry, self.score = entry, ReasoningGymReward()
        self.attempts = 0
        return row_messages(row, self.system_prompt)

    def step(self, message: Message) -> StepResult:
        from verl_fast.rewards.interface import RewardInput

        self.attempts += 1
        right = self.score([RewardInput(prompt="", response=message["content"], ground_truth=self.entry)])[0] == 1.0
        if right:
            return StepResult(reward=1.0, done=True)
        if self.attempts >= self.max_attempts:
            return StepResult(reward=0.0, done=True)
        return StepResult([{"role": "user", "content": self.retry}], reward=0.0)

    def metrics(self) -> Dict[str, float]:
        return {"env_attempts": float(self.attempts)}


def custom_environment(spec: str) -> Callable[..., Environment]:
    """The Environment class ``spec`` (``module:Class`` or ``file.py:Class``) names."""
    from verl_fast.agents.tools import load_tool

    cls = load_tool(spec)
    if not (isinstance(cls, type) and hasattr(cls, "reset") and hasattr(cls, "step")):
        raise ValueError(f"rollout.multi_turn.environment={spec} must name a class with reset(row) and step(message)")
    return cls

