"""The verifiers example's environment: sums of two numbers, answered in up to three turns (told to
try again after a wrong answer), written against verifiers 0.3's in-process classes (a ``MultiTurnEnv``
with its dataset and a ``Rubric``). verl_fast runs it through
``verl_fast.agents.verifiers_env:VerifiersEnvironment``; ``trainer.dataset:
verifiers:examples/verifiers_env/env.py:load_environment`` gives its dataset's rows.
"""

import random
import re
from typing import Any

from datasets import Dataset

import verifiers as vf

SYSTEM_PROMPT = "Answer with just the number."


def last_number(text: str) -> str:
    numbers = re.findall(r"-?\d+", text or "")
    return numbers[-1] if numbers else ""


def last_answer(completion: vf.Messages) -> str:
    """The number in the model's last turn."""
    turns = [m for m in completion if m.role == "assistant"]
    return last_number(turns[-1].content) if turns else ""


def correct_answer(completion: vf.Messages, answer: str) -> float:
    """1 when the last turn names the sum."""
    return 1.0 if last_answer(completion) == answer else 0.0


async def first_try(completion: vf.Messages, answer: str) -> float:
    """1 when the first turn names it already."""
    turns = [m for m in completion if m.role == "assistant"]
    return 1.0 if turns and last_number(turns[0].content) == answer else 0.0


class SumEnv(vf.MultiTurnEnv):
    """Each wrong answer is told to try again; a right one ends the rollout."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        return [vf.UserMessage(content="Not quite. Try again: answer with just the number.")]

    @vf.stop
    async def answered_right(self, state: vf.State) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and last_answer(trajectory[-1]["completion"]) == state["answer"]


def load_environment(num_examples: int = 64, seed: int = 0, max_turns: int = 3, high: int = 50) -> vf.Environment:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(1, high), rng.randint(1, high)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    rubric = vf.Rubric(funcs=[correct_answer, first_try], weights=[1.0, 0.5])
    return SumEnv(dataset=Dataset.from_list(rows), system_prompt=SYSTEM_PROMPT, rubric=rubric, max_turns=max_turns)


def environment_reward_only(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """reward_fn of the example: nothing beyond the environment's rubric."""
    return 0.0
