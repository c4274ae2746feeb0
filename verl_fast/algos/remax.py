"""ReMax's baseline: one greedy response per prompt, scored by the run's reward function.

ReMax (Li et al.) replaces a critic or a group of samples with the reward of the policy's own
greedy answer to the same prompt: ``A_t = sum_{s >= t} r_s - b`` where ``b`` is that greedy reward
(``compute_remax_advantage``). The greedy rollout uses the prompt's own sampling settings (its
``max_tokens``, stop strings) with ``n = 1`` and temperature 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from verl_fast.data import PromptRow
from verl_fast.rollout.base import GenerationOutput
from verl_fast.rollout.operator import RolloutOperator


def greedy_rollout(operator: RolloutOperator, batch: Sequence[PromptRow]) -> GenerationOutput:
    """One greedy completion per prompt of ``batch``, in prompt order."""
    specs = [replace(s, n=1, temperature=0.0, seed=None, logprobs=False) for s in operator.specs(batch)]
    return operator.engine.generate([row.prompt_ids for row in batch], specs)
