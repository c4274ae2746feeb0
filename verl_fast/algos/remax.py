"""ReMax (Li et al.): a critic or a group of samples is replaced by the reward of the policy's own
greedy answer to the same prompt: ``A_t = sum_{s >= t} r_s - b`` where ``b`` is that greedy reward
(``compute_remax_advantage``), scored by the run's reward function. The greedy rollout uses the
prompt's own sampling settings (its ``max_tokens``, stop strings) with ``n = 1`` and temperature 0,
while the engine is awake for the step's rollout. No critic, no whitening; PPO-clip loss.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Sequence

import torch

from verl_fast.algos.algorithm import Score
from verl_fast.algos.policy_gradient import PolicyGradientSpec
from verl_fast.records.prompts import PromptRow
from verl_fast.records.experience import Experience
from verl_fast.ops.advantage import compute_remax_advantage
from verl_fast.records.generation import Generate, GenerationOutput


def greedy_rollout(generate: Generate, batch: Sequence[PromptRow]) -> GenerationOutput:
    """One greedy completion per prompt of ``batch``, in prompt order."""
    return generate(batch, lambda s: replace(s, n=1, temperature=0.0, seed=None, logprobs=False))


class GreedyBaseline:
    """The greedy rollout, and each sample's baseline: its prompt's greedy reward."""

    def rollout(self, generate: Generate, batch: Sequence[PromptRow]) -> GenerationOutput:
        return greedy_rollout(generate, batch)

    def of(self, batch: Sequence[PromptRow], extra: GenerationOutput, score: Score, exp: Experience,
           metrics: Dict[str, Any]) -> torch.Tensor:
        greedy_scores = score(batch, extra)  # [P]: one per prompt, in prompt order
        metrics["reward/greedy_baseline"] = greedy_scores.mean().item()
        return greedy_scores[exp.prompt_index]


def _remax(exp: Experience, baselines: Optional[torch.Tensor], alg: Any, whiten: bool):
    return compute_remax_advantage(exp.token_level_rewards, baselines, exp.response_mask)


REMAX = PolicyGradientSpec("remax", _remax, baseline=GreedyBaseline())
